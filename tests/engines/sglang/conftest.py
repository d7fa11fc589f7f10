"""SGLang plugin tests: the real `sglang==0.5.23` (its own environment, see the Makefile),
plugins loaded through SGLang's own `load_plugins()`, one prefill server's arguments and a
real bootstrap server per session, and a fresh prefill/decode manager pair per test.

SGLang's runtime context is process-wide, so both PD roles share one `ServerArgs` (the
prefill's; a decode manager reads only what both roles agree on)."""

from __future__ import annotations

import os

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # loopback only, before SGLang reads it

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sglang_helpers as sh
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
from sglang.srt.plugins import load_plugins

from prfaas.common.ports import free_port
from prfaas.engines.sglang import SGLANG_VERSION
from prfaas.engines.sglang.plugin import check_version

check_version()  # the environment must hold exactly the pinned SGLang
load_plugins()


@pytest.fixture(scope="session")
def bootstrap() -> Iterator[tuple[Any, str]]:
    """(server args, bootstrap address) with SGLang's real bootstrap server running."""
    from sglang.srt.disaggregation.utils import get_kv_class

    port = free_port()
    args = sh.server_args(port)
    server = get_kv_class(TransferBackend.PRFAAS, KVClassType.BOOTSTRAP_SERVER)(
        host=sh.HOST, port=port
    )
    yield args, f"{sh.HOST}:{port}"
    server.close()


@pytest.fixture
def make_pair(
    bootstrap: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., sh.Pair]]:
    """`make_pair(**env)`: a prefill and a decode manager over their own hybrid CPU pools,
    built with `PRFAAS_SGLANG_*` settings `env` (e.g. `TRANSFER_TIMEOUT_S="1"`)."""
    args, address = bootstrap
    made: list[sh.Pair] = []

    def make(**env: str) -> sh.Pair:
        for name, value in env.items():
            monkeypatch.setenv(f"PRFAAS_SGLANG_{name}", value)
        prefill = sh.HybridPool(tokens=128, slots=4, aux_slots=4, seed=1)
        decode = sh.HybridPool(tokens=128, slots=4, aux_slots=4, seed=2)
        p = sh.manager(prefill, DisaggregationMode.PREFILL, args)
        d = sh.manager(decode, DisaggregationMode.DECODE, args)
        made.append(sh.Pair(address, prefill, decode, p, d))
        return made[-1]

    yield make
    for pair in made:
        pair.prefill_mgr.teardown()
        pair.decode_mgr.teardown()


@pytest.fixture
def pair(make_pair: Callable[..., sh.Pair]) -> sh.Pair:
    """A prefill and a decode manager with default settings."""
    return make_pair()


def pytest_report_header() -> str:
    return f"sglang {SGLANG_VERSION} (the prfaas plugin's pinned version)"
