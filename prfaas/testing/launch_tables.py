"""Deployment-file text for the tests and benchmarks that launch vLLM engines through
`prfaas serve` (one place for the `[[launch]]` keys they all write)."""

from __future__ import annotations

import json
from pathlib import Path


def vllm_launch(
    name: str, cluster: str, role: str, model: Path | str, python: Path | str, extra: str = ""
) -> str:
    """One `[[launch]]` table: vLLM engine `name` of `model`, run by the vLLM environment's
    `python`, in `cluster` as `role`; `extra`: more `key = value` lines."""
    return (
        f'\n[[launch]]\nid = "{name}"\nengine = "vllm"\ncluster = "{cluster}"\n'
        f'role = "{role}"\nmodel = "{model}"\npython = "{python}"\n{extra}'
    )


def vllm_pd_deployment(
    model: Path | str,
    python: Path | str,
    block_size: int,
    vllm_args: tuple[str, ...] = (),
    *,
    served: str = "tiny",
    gateway: str = "",
) -> str:
    """A whole deployment file: one PrfaaS prefill ("prfaas-p0") and one PD decode
    ("pd-d0") vLLM engine of `model` (its own tokenizer, 4,096-token context, paged in
    `block_size`-token blocks, each started with `vllm_args`) served as `served`, every
    prompt offloaded (threshold 0); `gateway`: more `[gateway]` lines."""
    extra = f"vllm_args = {json.dumps(list(vllm_args))}\n" if vllm_args else ""
    launched = "".join(
        vllm_launch(name, cluster, role, model, python, extra)
        for name, cluster, role in (("prfaas-p0", "prfaas", "prefill"), ("pd-d0", "pd", "decode"))
    )
    return f"""
[model]
name = "{served}"
tokenizer = "{model}"
context_length = 4096
block_size = {block_size}
vocab_size = 384
[gateway]
threshold = 0
{gateway}{launched}"""
