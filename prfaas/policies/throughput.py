"""The paper's throughput model (DESIGN.md section 2, Eq. 1-8) as pure, vectorised functions.

Two ways to cost a class of requests (long: L > t, short: L <= t):
- representative (the paper's, the default): evaluate the profile at the class's mean
  length, T(E[L | class]);
- exact expectation: E[T(L) | class], in closed form over the piecewise-linear tables.
Prefill latency is convex in length, so by Jensen's inequality the representative mode
under-states the mean cost and flatters throughput; `plan --exact-expectation` shows by how much.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from prfaas.policies.distributions import Array, LengthDistribution
from prfaas.policies.tables import PiecewiseLinear

BITS_PER_BYTE = 8


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / BITS_PER_BYTE


def bytes_per_s_to_gbps(rate: ArrayLike) -> Array:
    return np.asarray(rate, dtype=np.float64) * BITS_PER_BYTE / 1e9


def kv_throughput(kv_bytes: PiecewiseLinear, prefill_s: PiecewiseLinear, n: ArrayLike) -> Array:
    """Eq. 1: Phi_kv(n) = S_kv(n) / T_prefill(n), the KV bytes/s one prefill instance emits."""
    return kv_bytes(n) / prefill_s(n)


def egress_needed(n_instances: int, phi_kv_bytes_per_s: ArrayLike) -> Array:
    """Eq. 2: the egress (bytes/s) that N busy prefill instances emit, N * Phi_kv(L_avg)."""
    return n_instances * np.asarray(phi_kv_bytes_per_s, dtype=np.float64)


def _safe_div(num: ArrayLike, den: ArrayLike, *, empty: float) -> Array:
    """num / den, with `empty` where den == 0 (a class that carries no work)."""
    n = np.broadcast_to(np.asarray(num, dtype=np.float64), np.broadcast(num, den).shape)
    d = np.broadcast_to(np.asarray(den, dtype=np.float64), n.shape)
    out = np.full(n.shape, empty, dtype=np.float64)
    np.divide(n, d, out=out, where=d > 0)
    return out


def theta_prfaas(n_prfaas: int, prefill_long_s: Array, link_bps: float, kv_long: Array) -> Array:
    """Eq. 3: min(compute, link) rather than their harmonic mean, thanks to layer-wise
    pipelining: N_prfaas / T_prefill(l_long) vs B_out / S_kv(l_long) (req/s)."""
    compute = _safe_div(n_prfaas, prefill_long_s, empty=np.nan)
    link = _safe_div(link_bps, kv_long, empty=np.nan)
    return np.fmin(compute, link)


def theta_prfaas_sequential(
    n_prfaas: int, prefill_long_s: Array, link_bps: float, kv_long: Array
) -> Array:
    """Eq. 3 without pipelining: each instance computes, then ships, one request at a time."""
    per_request_s = prefill_long_s + kv_long * n_prfaas / link_bps
    return _safe_div(n_prfaas, per_request_s, empty=np.nan)


def theta_pd_prefill(n_p: ArrayLike, prefill_short_s: Array) -> Array:
    """Eq. 4: N_p / T_prefill(l_short) (req/s)."""
    return _safe_div(n_p, prefill_short_s, empty=np.nan)


def theta_pd_decode(n_d: ArrayLike, batch_max: int, step_s: float, output_tokens: int) -> Array:
    """Eq. 5: N_d * BS_max / (T_decode * L_out) (req/s)."""
    return np.asarray(n_d, dtype=np.float64) * batch_max / (step_s * output_tokens)


def prfaas_bound(theta_p: Array, p: Array) -> Array:
    """Theta_prfaas / p: the arrival rate at which PrfaaS saturates (inf when p == 0)."""
    return _safe_div(np.nan_to_num(theta_p, nan=0.0), p, empty=np.inf)


def pd_prefill_bound(theta_pdp: Array, p: Array) -> Array:
    """Theta_pd_p / (1 - p): the arrival rate at which PD-prefill saturates (inf when p == 1)."""
    return _safe_div(np.nan_to_num(theta_pdp, nan=0.0), 1.0 - p, empty=np.inf)


def lambda_max(theta_p: Array, theta_pdp: Array, theta_pdd: Array, p: Array) -> Array:
    """Eq. 6: min(Theta_prfaas / p, Theta_pd_p / (1 - p), Theta_pd_d) (req/s)."""
    return np.fmin(np.fmin(prfaas_bound(theta_p, p), pd_prefill_bound(theta_pdp, p)), theta_pdd)


@dataclass(frozen=True)
class ClassSplit:
    """Per threshold t: p = P(L > t) and each class's conditional mean length (nan if empty)."""

    t: Array
    p: Array
    l_long: Array
    l_short: Array


def split_at(dist: LengthDistribution, t: ArrayLike) -> ClassSplit:
    """Split `dist` at every threshold in `t` (Eq. 7's p, l_long, l_short)."""
    ta = np.asarray(t, dtype=np.float64)
    below, mass_below = dist.cdf(ta), dist.partial_mean(ta)
    p = 1.0 - below
    l_short = _safe_div(mass_below, below, empty=np.nan)
    l_long = _safe_div(dist.mean() - mass_below, p, empty=np.nan)
    return ClassSplit(ta, p, l_long, l_short)


def partial_cost(dist: LengthDistribution, f: PiecewiseLinear, x: ArrayLike) -> Array:
    """E[f(L) * 1{L <= x}] in closed form: per linear segment, slope*E[L;seg] + icpt*P(seg)."""
    xa = np.asarray(x, dtype=np.float64)
    slope, intercept = f.segments()
    edges = np.concatenate([[-np.inf], f.breakpoints(), [np.inf]])
    total = np.zeros(xa.shape)
    for k in range(slope.size):
        lo, hi = np.minimum(edges[k], xa), np.minimum(edges[k + 1], xa)
        mass = dist.partial_mean(hi) - dist.partial_mean(lo)
        prob = dist.cdf(hi) - dist.cdf(lo)
        total += slope[k] * mass + intercept[k] * prob
    return total


@dataclass(frozen=True)
class ClassCosts:
    """What one request of each class costs: prefill seconds on either hardware, KV bytes."""

    long_prefill_s: Array
    long_kv_bytes: Array
    short_prefill_s: Array


def class_costs(
    dist: LengthDistribution,
    split: ClassSplit,
    *,
    long_prefill: PiecewiseLinear,
    short_prefill: PiecewiseLinear,
    kv_bytes: PiecewiseLinear,
    exact: bool,
) -> ClassCosts:
    """Cost each class at the representative length, or as an exact conditional expectation."""
    if not exact:
        return ClassCosts(
            long_prefill(split.l_long), kv_bytes(split.l_long), short_prefill(split.l_short)
        )

    def cond_long(f: PiecewiseLinear) -> Array:
        whole = partial_cost(dist, f, np.inf)
        return _safe_div(whole - partial_cost(dist, f, split.t), split.p, empty=np.nan)

    short = _safe_div(partial_cost(dist, short_prefill, split.t), 1 - split.p, empty=np.nan)
    return ClassCosts(cond_long(long_prefill), cond_long(kv_bytes), short)
