"""Whether the node keeps up: the measured rate of the path the run will take against R_req = N / S.

The run's path: "from tokens" when the manifest is pre-tokenized or the
node cache (`--cache`) holds the tokens of every text object; else "on the
fly". It keeps up when that path's rate is at least R_req; the margin is
rate / R_req. What to do when it does not is said from what was measured:

    on the fly short, from tokens enough   put the tokens on the node first (pretokenize, cache warm --tokens)
    on the fly short                       more tokenizer threads / workers for the daemon
    from tokens short too                  data nodes (or fewer replicas per daemon), or a slower step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THIN_MARGIN = 1.5  # below this a run that keeps up is told so: other work on the node can take the rest


@dataclass(frozen=True)
class Verdict:
    keeps_up: bool
    path: str  # "on the fly" | "from tokens"
    why_path: str
    rate: float  # tokens/s of that path
    required: float  # R_req, tokens/s
    margin: float  # rate / required
    summary: str
    advice: tuple[str, ...]

    def to_obj(self) -> dict[str, Any]:
        return {"keeps_up": self.keeps_up, "path": self.path, "why_path": self.why_path,
                "tokens_per_s": round(self.rate, 1), "required_tokens_per_s": round(self.required, 3),
                "margin": round(self.margin, 3), "summary": self.summary, "advice": list(self.advice)}


def rate_text(tokens_per_s: float) -> str:
    """1234567.0 -> '1.23M tokens/s' (3 significant digits)."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g}{unit} tokens/s"
    return f"{tokens_per_s:.3g} tokens/s"


def times_text(ratio: float) -> str:
    """0.0123 -> '0.012x', 2.5 -> '2.5x', 2240.4 -> '2,240x'."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def decide(rates: Any, required: float, *, pretokenized: bool, tokens_cached: bool, manifest: str,
           cache: str | None) -> Verdict:
    """The verdict for `rates` (rate.Rates) against `required` tokens/s; see the module docstring."""
    fly, tok = rates.on_the_fly, rates.from_tokens
    if pretokenized:
        path, why = "from tokens", "every source is pre-tokenized"
    elif tokens_cached:
        path, why = "from tokens", f"the node cache {cache} holds the tokens of every text object"
    else:
        path, why = "on the fly", "the tokens are not on this node yet: the daemon tokenizes as it serves"
    phase = tok if path == "from tokens" and tok is not None else fly if fly is not None else tok
    rate = phase.tokens_per_s if phase is not None else 0.0
    margin = rate / required
    keeps_up = margin >= 1.0
    need = rate_text(required)
    if keeps_up:
        summary = f"keeps up: {path} this node makes {rate_text(rate)}, {times_text(margin)} the {need} the run needs"
        advice: list[str] = []
        if margin < THIN_MARGIN:
            advice.append(f"the margin is thin (under {THIN_MARGIN}x): other work on this node can take it")
        return Verdict(True, path, why, rate, required, margin, summary, tuple(advice))
    summary = (f"does not keep up: {path} this node makes {rate_text(rate)}, {times_text(margin)} the {need} the run "
               f"needs (short by {rate_text(required - rate)})")
    advice = []
    if path == "on the fly" and tok is not None and tok.tokens_per_s >= required:
        advice.append(f"put the tokens on the node before the run: from tokens it makes {rate_text(tok.tokens_per_s)} "
                      f"({times_text(tok.tokens_per_s / required)}): `sluice cache warm {manifest} "
                      f"{cache or 'CACHE_DIR'} --tokens`, or ship shards made by `sluice tokenize pretokenize "
                      f"{manifest} -o DIR` (docs/tokenize.md)")
    if path == "on the fly":
        advice.append(f"give the tokenizer more threads: this measurement had {rates.tokenizer_threads} Rust threads "
                      f"on {rates.cpus} CPUs (RAYON_NUM_THREADS; loaderd --workers, --demand-workers, "
                      "--worker-kind process; docs/loaderd.md)")
    if tok is None:
        advice.append("no step was made in the first phase, so nothing was measured from tokens: see why it "
                      "stopped, or give it longer (--seconds)")
    elif tok.tokens_per_s < required:
        advice.append(f"even from tokens this node makes {rate_text(tok.tokens_per_s)}: serve the run from data "
                      "nodes, or fewer replicas per daemon (docs/deploy.md, 'Data nodes'), or plan a longer step")
    return Verdict(False, path, why, rate, required, margin, summary, tuple(advice))
