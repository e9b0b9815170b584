"""The human form of `sluice preflight`'s result: a table of checks, one of rates, the verdict and advice."""

from __future__ import annotations

from typing import Any

from sluice.manifest.cli import terminal_safe  # messages carry manifest locations and source names


def lines(obj: dict[str, Any], *, spec_tokens: int) -> list[str]:
    """The result object `sluice preflight --json` prints, as lines for a terminal."""
    out = [f"preflight {terminal_safe(obj['manifest'])} {terminal_safe(obj['run'])}  ({obj['dataset_id']})", "",
           f"{'CHECK':<10} {'STATUS':<6} WHAT"]
    for c in obj["checks"]:
        out.append(f"{c['name']:<10} {c['status'].upper():<6} {terminal_safe(c['summary'])}")
        out += [f"{'':<17} - {terminal_safe(p)}" for p in c["problems"]]
    required = obj["required_tokens_per_s"]
    out += ["", f"{'RATE':<24} {'TOKENS/S':>14} {'STEPS':>6} {'FIRST STEP':>11}  STOPPED"]
    rates = obj["rates"]
    for key in ("on_the_fly", "from_tokens"):
        phase = rates and rates[key]
        if phase:
            first = "-" if phase["first_step_s"] is None else f"{phase['first_step_s']:.2f} s"
            out.append(f"{phase['name']:<24} {phase['tokens_per_s']:>14,.0f} {phase['steps']:>6} {first:>11}  "
                       f"{terminal_safe(phase['stopped'])}")
            if phase["note"]:
                out.append(f"{'':<24} note: {phase['note']}")
    shown = f"{required:,.0f}" if required >= 10 else f"{required:.3g}"  # (0.001 tokens/s is a valid R_req)
    out.append(f"{'required (N / S)':<24} {shown:>14}  = {obj['tokens_per_step']:,} tokens every "
               f"{obj['step_seconds']:g} s")
    if obj["tokens_per_step"] != spec_tokens:
        out.append(f"{'':<24} note: the run spec serves {spec_tokens:,} tokens a step (global_batch x seq_len)")
    if rates:
        out.append(f"{'':<24} tokenizer: {rates['tokenizer_threads']} Rust threads on {rates['cpus']} CPUs; "
                   f"{rates['tokens_per_step']:,} tokens a step")
    verdict = obj["verdict"]
    out.append("")
    if verdict is None:
        out.append(f"NOT MEASURED: {obj['not_measured'] or 'the data path did not open'} (exit {obj['exit_code']})")
    else:
        head, _, rest = verdict["summary"].partition(": ")
        out.append(f"{head.upper()}: {rest} ({verdict['why_path']})")
        out += [f"  - {a}" for a in verdict["advice"]]
    failed = [c["name"] for c in obj["checks"] if c["status"] == "fail"]
    if failed:
        out.append(f"FAILED CHECKS: {', '.join(failed)} (exit {obj['exit_code']})")
    return out
