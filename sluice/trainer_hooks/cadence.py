"""Checkpoint cadence: Young's interval and the expected waste of an interval.

With exposed checkpoint cost C (seconds the training stops per save), mean time
between failures M, restore time R and failure detection time D, checkpointing
every T seconds wastes the fraction

    W(T) = C/T + T/(2M) + (R + D)/M

of the run: C/T saving, T/(2M) recomputing the half-interval lost on average per
failure, (R + D)/M detecting and restoring. dW/dT = 0 gives Young's interval
T* = sqrt(2*C*M) (the R + D term does not depend on T).

Worked example: C = 10 s, M = 24 h = 86400 s -> T* = sqrt(2*10*86400) = 1314.5 s
(about 22 min) and W(T*) = 10/1314.5 + 1314.5/172800 = 1.52% (+ (R+D)/M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.errors import CadenceError

__all__ = ["CadenceError", "cadence_table", "waste", "young_interval"]


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """T* = sqrt(2*C*M) in seconds."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def waste(interval_s: float, cost_s: float, mtbf_s: float, restore_s: float = 0.0, detect_s: float = 0.0) -> float:
    """W(T) = C/T + T/(2M) + (R+D)/M, the expected fraction of the run lost."""
    _check(cost_s, mtbf_s)
    if not interval_s > 0:
        raise CadenceError(f"interval must be > 0 seconds, got {interval_s!r}")
    if restore_s < 0 or detect_s < 0:
        raise CadenceError(f"restore ({restore_s!r}) and detect ({detect_s!r}) times must be >= 0")
    return cost_s / interval_s + interval_s / (2.0 * mtbf_s) + (restore_s + detect_s) / mtbf_s


def _check(cost_s: float, mtbf_s: float) -> None:
    if not (isinstance(cost_s, (int, float)) and math.isfinite(cost_s) and cost_s > 0):
        raise CadenceError(f"checkpoint cost C must be a finite number of seconds > 0, got {cost_s!r}")
    if not (isinstance(mtbf_s, (int, float)) and math.isfinite(mtbf_s) and mtbf_s > 0):
        raise CadenceError(f"MTBF M must be a finite number of seconds > 0, got {mtbf_s!r}")


@dataclass(frozen=True)
class CadenceRow:
    interval_s: float
    waste: float
    label: str  # "T*" for Young's interval, else the multiple of T*

    def to_obj(self) -> dict:
        return {"interval_s": self.interval_s, "waste": self.waste, "label": self.label}


MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)


def cadence_table(cost_s: float, mtbf_s: float, restore_s: float = 0.0, detect_s: float = 0.0,
                  multiples: tuple[float, ...] = MULTIPLES) -> list[CadenceRow]:
    """W(T) at multiples of Young's interval (1.0 is T* itself, the minimum)."""
    best = young_interval(cost_s, mtbf_s)
    rows = []
    for m in multiples:
        t = best * m
        rows.append(CadenceRow(t, waste(t, cost_s, mtbf_s, restore_s, detect_s), "T*" if m == 1.0 else f"{m:g} T*"))
    return rows
