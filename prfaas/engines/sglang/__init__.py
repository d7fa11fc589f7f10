"""The SGLang plugin: a `prfaas` disaggregation transfer backend (GPU clusters).

`register()` (the `sglang.srt.plugins` entry point, see `plugin.py`) adds the backend to a
stock `sglang==0.5.23`; start both servers with `--disaggregation-transfer-backend prfaas`
(the prefill also with `--disable-prefill-cuda-graph`). KV pages and Mamba states stream
from prefill to decode over `prfaas.engines.transport`, layer by layer as the prefill's
forward writes them (`layer_tap.py`; the states during the last chunk), through the
device-aware mover `engines/kv_pages` (`TorchPagePool`, `SendQueue`);
`PRFAAS_SGLANG_LAYERWISE=0` sends everything after the last chunk's forward instead.

Files: `plugin.py` registration; `conn.py` SGLang's manager/sender/receiver/bootstrap
classes; `prefill_plane.py`, `shipping.py`, `decode_plane.py` the data plane of each side;
`buffers.py` SGLang's KV memory as a page pool; `messages.py` the control messages;
`loop_thread.py` the transport's event-loop thread; `settings.py` environment settings.
Importing this package imports neither SGLang nor torch.
"""

from __future__ import annotations

from prfaas.engines.sglang.plugin import SGLANG_VERSION, register

__all__ = ["SGLANG_VERSION", "register"]
