"""The start-up summary `prfaas serve` prints once it listens."""

from __future__ import annotations

import math
from collections.abc import Sequence

from prfaas.gateway.api.assembly import Gateway


def summary_lines(gateway: Gateway, url: str, extra: Sequence[str] = ()) -> list[str]:
    """Clusters, model, policy and threshold, and where the dashboard, API, metrics and
    state are."""
    state = gateway.router.state
    lines = [
        f"PrfaaS gateway listening on {url}",
        f"  model      {gateway.config.model.name} (tokenizer {gateway.config.model.tokenizer})",
        f"  policy     {gateway.router.policy.name}, t = {state.threshold:g} incremental tokens, "
        f"{state.regime}",
    ]
    for cluster in ("prfaas", "pd"):
        members = [s for s in gateway.instances if s.cluster == cluster]
        described = ", ".join(f"{s.instance_id} ({s.role})" for s in members) or "none"
        lines.append(f"  {cluster:<10} {described}")
    co = gateway.coordinator
    if co is not None:
        etcd = ", ".join(co.config.endpoints)
        lines.append(f"  replica    {co.replica_id} of {co.config.prefix} on etcd {etcd}")
    lines += list(extra)
    lines += [
        f"  dashboard  {url}/dashboard (load to watch: {demo_load(gateway, url)})",
        f"  API        {url}/v1/completions, {url}/v1/chat/completions",
        f"  metrics    {url}/metrics",
        f"  state      {url}/admin/state",
        "  Ctrl-C stops the gateway" + (" and its engines" if extra else ""),
    ]
    return lines


def demo_load(gateway: Gateway, url: str) -> str:
    """A `prfaas bench` line that moves the dashboard: a minute of Poisson arrivals with
    prompts around t, token ids inside the model's vocabulary, fitting its context."""
    model = gateway.config.model
    vocab = f" --vocab-size {model.vocab_size}" if model.vocab_size else ""
    mu = math.log(max(gateway.router.state.threshold, 16.0))
    return (
        f"prfaas bench --target {url}{vocab} --input-mu {mu:.1f} --input-sigma 1 "
        f"--input-max {model.context_length // 2} --output-len 16 --rate 0.5 --duration 60"
    )


def print_ready(gateway: Gateway, port: int, host: str = "127.0.0.1") -> None:
    """Print the summary for a gateway bound to `host:port`."""
    print("\n".join(summary_lines(gateway, f"http://{host}:{port}")), flush=True)
