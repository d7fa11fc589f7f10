"""Deployment-file text for the tests and benchmarks that launch vLLM engines through
`prfaas serve` (one place for the `[[launch]]` keys they all write)."""

from __future__ import annotations

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
