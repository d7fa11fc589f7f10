"""`register()`: make a stock SGLang install speak PrfaaS's transport (no fork, no edit).

Installed as the entry point `prfaas` of the group `sglang.srt.plugins`, so SGLang calls it
in the CLI process before arguments are parsed, in the engine and in every scheduler
subprocess (before `Scheduler.init_disaggregation`). It:

1. adds `prfaas` to `--disaggregation-transfer-backend`'s choices;
2. adds a `TransferBackend.PRFAAS` member (value "prfaas");
3. wraps `sglang.srt.disaggregation.utils.get_kv_class` (an AROUND hook, which SGLang also
   rebinds in every module that imported it by name) to answer for PRFAAS with our
   classes (`conn.py`) and defer to SGLang for every other backend;
4. wraps `prepare_server_args` (the flags) and `ServerArgs.resolve_once` (what SGLang
   resolved them to) to refuse a layer-wise prefill whose forward would bypass the layer
   hooks (`settings.check_prefill_args`: a prefill CUDA graph, two-batch overlap, PD
   multiplexing), and `Scheduler.init_disaggregation` / `run_batch` to install the
   per-layer forward hooks (`layer_tap.py`).

Idempotent; SGLang's modules are imported only when it runs. The interface moves between
SGLang releases, so any version but `SGLANG_VERSION` is refused.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

SGLANG_VERSION = "0.5.23"
BACKEND = "prfaas"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
PREPARE_SERVER_ARGS = "sglang.srt.server_args.prepare_server_args"
RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"
INIT_DISAGGREGATION = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"
RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def check_version(installed: str | None = None) -> None:
    """Raise RuntimeError unless the installed SGLang is the one this plugin was built for."""
    version = installed or importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise RuntimeError(
            f"prfaas's SGLang plugin supports sglang=={SGLANG_VERSION} only (its transfer "
            f"backend interface changes between releases); sglang {version} is installed: "
            f"pip install 'prfaas[sglang]'"
        )


def register() -> None:
    """Register the `prfaas` transfer backend with SGLang (see the module docstring).

    Raises:
        RuntimeError: the installed SGLang is not `SGLANG_VERSION`.
    """
    check_version()
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_disagg_transfer_backend_choices

    from prfaas.engines.sglang import layer_tap

    if BACKEND in TransferBackend._value2member_map_:
        return
    _add_member(TransferBackend, "PRFAAS", BACKEND)
    add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register(GET_KV_CLASS, _get_kv_class, HookType.AROUND)
    HookRegistry.register(PREPARE_SERVER_ARGS, _prepare_server_args, HookType.AROUND)
    HookRegistry.register(RESOLVE_ONCE, _resolve_once, HookType.AROUND)
    HookRegistry.register(INIT_DISAGGREGATION, layer_tap.init_disaggregation, HookType.AROUND)
    HookRegistry.register(RUN_BATCH, layer_tap.run_batch, HookType.AROUND)
    HookRegistry.apply_hooks()  # load_plugins applies them too; applying twice is a no-op


def _add_member(enum: Any, name: str, value: str) -> None:
    """Add a member to an existing Enum class (what `Enum('x')` and `Enum.x` look up)."""
    member = object.__new__(enum)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum
    member.__init__(value)
    type.__setattr__(enum, name, member)
    enum._member_names_.append(name)
    enum._member_map_[name] = member
    enum._value2member_map_[value] = member


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from prfaas.engines.sglang import conn

    return {
        KVClassType.MANAGER: conn.PrfaasKVManager,
        KVClassType.SENDER: conn.PrfaasKVSender,
        KVClassType.RECEIVER: conn.PrfaasKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.PrfaasKVBootstrapServer,
    }[class_type]


def _prepare_server_args(original: Any, argv: list[str]) -> Any:
    from prfaas.engines.sglang.settings import check_prefill_args

    server_args = original(argv)
    check_prefill_args(server_args)
    return server_args


def _resolve_once(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    from prfaas.engines.sglang.settings import check_prefill_args

    result = original(server_args, *args, **kwargs)
    check_prefill_args(server_args)
    return result
