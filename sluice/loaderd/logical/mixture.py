"""Mixture: which source a lane draws from next, as a pure function of state.

Weights are the manifest's decimal strings, turned into integers over a common
denominator so every comparison is exact (no floats in what is served).

* ``quota``: for counted units (documents, sequences) Tijdeman's
  chairman-assignment rule (earliest deadline among the sources that are
  behind), which keeps every source strictly within one unit of
  ``weight x draws`` at every prefix; for token units the most under-served
  source (largest ``a_s * T - A * c_s``): at most one draw ahead and k-1
  draws behind, in tokens; piece draws (`mixture.piece_tokens` = B, in
  plan.py) bound a draw to B tokens, so the bound is ``B (1 - p_s)`` ahead
  and ``B (k - 2 + p_s)`` behind (docs/logical.md). See `quota_pick`.
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
    """Index of the source to draw next under `quota`; -1 if no source is active.

    Counted units (documents, sequences) use Tijdeman's chairman-assignment
    rule, which keeps ``|c_s - w_s t| <= 1 - 1/(2k - 2)`` (< 1) at every prefix t
    for k sources: among the sources at least ``1/(2k-2)`` behind their target,
    take the one whose deadline ``(c_s + 1 - 1/(2k-2)) / w_s`` comes first.
    (The plain largest-deficit rule can fall a full unit behind, e.g. weights
    1,1,1,3,3,3 after 8 draws.) Token units use the largest deficit
    ``w_s T - c_s``: a source is drawn only while behind, so it is never ahead
    by more than one draw's tokens, and (deficits summing to zero) never
    behind by more than k-1 draws' tokens (a draw: a document, or a piece of
    at most `mixture.piece_tokens`). Ties go to the lowest index; all
    arithmetic is on integers.
    """
    total_w = 0
    total = 0
    k = 0
    for w, c, a in zip(weights, realized, active):
        if a and w:
            total_w += w
            total += c
            k += 1
    if total_w == 0:
        return -1
    if counted and k > 1:
        t = total + 1
        m = 2 * k - 2
        best, best_num, best_den = -1, 0, 1
        for s, (w, c, a) in enumerate(zip(weights, realized, active)):
            # eligible: w/W * t - c >= 1/m  <=>  m * (w t - W c) >= W
            if a and w and m * (w * t - total_w * c) >= total_w:
                num, den = m * c + (m - 1), w  # deadline ~ (m c + m - 1) / (m w)
                if best < 0 or num * best_den < best_num * den:
                    best, best_num, best_den = s, num, den
        if best >= 0:
            return best
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
