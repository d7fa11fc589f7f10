"""A start-up profile as the embedded deployment measures one (its numbers alone, no
slowdown), for the tests of the profile document and of the simulated twin it feeds."""

from __future__ import annotations

from prfaas.serve.profiling import MeasuredProfile

MEASURED_ALONE = MeasuredProfile(
    lengths=(256, 1024, 3072),
    prefill_s=(0.2, 0.7, 2.3),
    kv_bytes=(770_000, 2_350_000, 6_550_000),
    decode_step_s=0.015,
    decode_batch_max=32,
    link_bytes_per_s=10e6 / 8,
)
