"""Mixture: which source a lane draws from next, as a pure function of state.

Weights are the manifest's decimal strings, turned into integers over a common
denominator so every comparison is exact (no floats in what is served).

* ``quota``: pick the most under-served active source: the one maximizing
  ``a_s * (T + d) - A * c_s``, where ``a_s`` is its integer weight, ``A`` the sum
  over active sources, ``c_s`` its realized count and ``T`` the total, in the
  declared unit; ``d`` is 1 for counted units (documents, sequences) and 0 for
  token units. Ties go to the lowest source index. For counted units this keeps
  every source within one unit of ``weight x draws`` at every prefix (the
  classic largest-deficit rule); for token units within one document's tokens.
* ``categorical``: draw ``u`` from a counter-based generator (a pure function
  of seed, lane and draw index) and pick by cumulative integer weights.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

from sluice.loaderd.logical.order import derive_keys, mix64

M64 = (1 << 64) - 1


def integer_weights(weights: list[str]) -> list[int]:
    """Decimal weight strings -> integers with the same ratios (exact)."""
    fracs = [Fraction(Decimal(w)) for w in weights]
    denom = 1
    for f in fracs:
        denom = denom * f.denominator // _gcd(denom, f.denominator)
    return [int(f * denom) for f in fracs]


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def quota_pick(weights: list[int], realized: list[int], active: list[bool], counted: bool) -> int:
    """Index of the most under-served active source; -1 if none is active."""
    total_w = 0
    total = 1 if counted else 0
    for w, c, a in zip(weights, realized, active):
        if a:
            total_w += w
            total += c
    if total_w == 0:
        return -1
    best, best_score = -1, 0
    for s, (w, c, a) in enumerate(zip(weights, realized, active)):
        if a and w:
            score = w * total - total_w * c
            if best < 0 or score > best_score:
                best, best_score = s, score
    return best


class CounterRNG:
    """u64 = f(seed, lane, draw): no state beyond the draw counter."""

    def __init__(self, dataset_id: str, seed: int, lane: int) -> None:
        (self.key,) = derive_keys("mixture-categorical-v1", dataset_id, seed, lane, count=1)

    def u64(self, draw: int) -> int:
        return mix64(mix64(self.key ^ (draw & M64)) ^ 0x9E3779B97F4A7C15)


def categorical_pick(weights: list[int], active: list[bool], u: int) -> int:
    """Source index chosen by `u` (uniform u64) under the active integer weights; -1 if none."""
    total_w = sum(w for w, a in zip(weights, active) if a)
    if total_w == 0:
        return -1
    target = (u * total_w) >> 64  # uniform in [0, total_w)
    acc = 0
    for s, (w, a) in enumerate(zip(weights, active)):
        if not a:
            continue
        acc += w
        if target < acc:
            return s
    raise AssertionError("unreachable: target < total weight")
