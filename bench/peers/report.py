"""bench/peers/run.py's report: the rows it makes of the jobs' results, the table it prints, the fast-path
warning lines, the chart it draws.

`summarize` makes one row per loader and workload (medians over rounds, ratios
to the best peer of its group and to the raw loop of its backend); nothing
here runs a job.
"""

from __future__ import annotations

import statistics
from pathlib import Path

FAST_PATHS = ("fused-kernel", "fused-numpy")  # the producer's fast path (docs/logical.md; fused-numpy: trees before)
FAST_SHARE_MIN = 0.99  # issue 23: the run fails where the fast path served fewer of sluice's steps



def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None and "error" not in r]
    return statistics.median(vals) if vals else None




def fast_path_of(runs: list[dict]) -> dict | None:
    """sluice's runs' STATS `fast_path` blocks summed: steps by path, fall-backs by reason, and the fast path's
    share of the steps; None where no run reported one (a peer, a tree without it)."""
    blocks = [r["fast_path"] for r in runs if isinstance(r.get("fast_path"), dict) and "error" not in r]
    if not blocks:
        return None
    by_path: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for b in blocks:
        for k, v in b.get("steps_by_path", {}).items():
            by_path[k] = by_path.get(k, 0) + v
        for k, v in b.get("fallbacks", {}).items():
            fallbacks[k] = fallbacks.get(k, 0) + v
    total = sum(by_path.values())
    share = sum(by_path.get(p, 0) for p in FAST_PATHS) / total if total else None
    return {"steps_by_path": by_path, "fallbacks": fallbacks, "share": share}


def summarize(results: dict[str, list[dict]], status: dict[str, str | None], loaders: list,
              workload: str = "single") -> list[dict]:
    """One row per loader of `loaders` (run.LOADERS' shape) that ran or has a status: medians over its runs, its
    fast-path share (sluice), and for sluice's rows the ratios to its group's best peer and raw loops."""
    rows = []
    for label, group, peer, _, _ in loaders:
        if label not in results and label not in status:
            continue
        runs = results.get(label, [])
        errors = [r["error"] for r in runs if "error" in r]
        fast = fast_path_of(runs)
        rows.append({
            "loader": label, "group": group, "workload": workload,
            "tokens_per_s": median_of(runs, "tokens_per_s"),
            "e2e_tokens_per_s": median_of(runs, "e2e_tokens_per_s"),
            "cpu_s_per_mtok": median_of(runs, "cpu_s_per_mtok"),
            "cpu_e2e_s_per_mtok": median_of(runs, "cpu_e2e_s_per_mtok"),
            "fast_path": fast,
            "fast_path_under_99": None if fast is None or fast["share"] is None else fast["share"] < FAST_SHARE_MIN,
            "first_batch_s": median_of(runs, "first_batch_s"),
            "restore_s": median_of(runs, "restore_s"),
            "restore_running_s": median_of(runs, "restore_running_s"),
            "restore_note": next((r.get("restore_note") for r in runs if r.get("restore_note")), None),
            "ok_runs": len(runs) - len(errors), "runs": len(runs),
            "status": status.get(label) or (errors[0] if errors and len(errors) == len(runs) else "ok"),
            "errors": errors,
        })
    for group in {r["group"] for r in rows}:
        mine = [r for r in rows if r["group"] == group]
        peers = [r for r in mine if not r["loader"].startswith(("sluice", "raw")) and r["tokens_per_s"]]
        raw = next((r for r in mine if r["loader"].startswith("raw") and r["tokens_per_s"]), None)
        for r in mine:
            if not r["loader"].startswith("sluice"):
                continue
            if peers:
                _against_peers(r, peers)
                if r["tokens_per_s"] and raw is not None:
                    r["ratio_raw_tokenizers"] = r["tokens_per_s"] / raw["tokens_per_s"]
            same = _raw_of(r["loader"], mine)
            if same is not None and r["tokens_per_s"]:  # against the raw loop of the backend it runs
                r["raw_same"] = same["loader"]
                r["ratio_raw_same"] = r["tokens_per_s"] / same["tokens_per_s"]
                if r["e2e_tokens_per_s"] and same["e2e_tokens_per_s"]:
                    r["ratio_raw_same_e2e"] = r["e2e_tokens_per_s"] / same["e2e_tokens_per_s"]
    return rows


def _against_peers(r: dict, peers: list[dict]) -> None:
    """sluice row `r`'s ratios to the best peer of its group (`peers`: those with a steady rate): steady and end
    to end tokens/s, first batch, and CPU seconds per million tokens (sluice's over the best steady peer's;
    lower is better) steady and end to end."""
    best = max(peers, key=lambda p: p["tokens_per_s"])
    r["best_peer"] = best["loader"]
    if r["tokens_per_s"]:
        r["ratio_tokens_per_s"] = r["tokens_per_s"] / best["tokens_per_s"]
    for key, ratio in (("cpu_s_per_mtok", "ratio_cpu_s_per_mtok"), ("cpu_e2e_s_per_mtok", "ratio_cpu_e2e_s_per_mtok")):
        if r.get(key) and best.get(key):
            r[ratio] = r[key] / best[key]
    e2e = [p for p in peers if p["e2e_tokens_per_s"]]
    if e2e and r["e2e_tokens_per_s"]:
        best_e2e = max(e2e, key=lambda p: p["e2e_tokens_per_s"])
        r["ratio_e2e"] = r["e2e_tokens_per_s"] / best_e2e["e2e_tokens_per_s"]
        r["best_peer_e2e"] = best_e2e["loader"]
    fb = [p["first_batch_s"] for p in peers if p["first_batch_s"]]
    if fb and r["first_batch_s"]:
        r["ratio_first_batch"] = min(fb) / r["first_batch_s"]


def mixture_to_single(rows: list[dict]) -> None:
    """Each mixture-workload row's steady rate over its loader's single-source rate (`ratio_mixture_to_single`;
    issue 23: the realistic spec within 0.85x), where both ran."""
    single = {r["loader"]: r for r in rows if r.get("workload") == "single" and r["tokens_per_s"]}
    for r in rows:
        if r["loader"].startswith("sluice") and r.get("workload") == "mixture" and r["tokens_per_s"] \
                and r["loader"] in single:  # (the peers read the mixture's documents unmixed)
            r["ratio_mixture_to_single"] = r["tokens_per_s"] / single[r["loader"]]["tokens_per_s"]


def _raw_of(label: str, rows: list[dict]) -> dict | None:
    """The raw loop row of the backend sluice row `label` runs (raw_tiktoken, raw_fastokens, else
    raw_tokenizers), if it ran."""
    backend = next((b for b in ("tiktoken", "fastokens") if b in label.split()), "tokenizers")
    return next((r for r in rows if r["loader"] == f"raw_{backend}" and r["tokens_per_s"]), None)

def fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def table(rows: list[dict]) -> str:
    w = max([24, *(len(r["loader"]) + 2 for r in rows)])  # (the loader column fits its longest label)
    head = (f"{'loader':<{w}}{'group':<15}{'workload':<9}{'M tok/s':>9}{'e2e M tok/s':>12}{'CPU s/Mtok':>11}"
            f"{'e2e CPU':>9}{'fast %':>8}{'first s':>9}{'restore s':>11}{'running s':>11}  "
            f"{'x best peer: steady / e2e / CPU per token':<54}status")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = (f"{r['ratio_tokens_per_s']:.2f}x {r['best_peer']} / {fmt(r.get('ratio_e2e'))}x "
                 f"{r.get('best_peer_e2e', '')} / {fmt(r.get('ratio_cpu_s_per_mtok'))}x"
                 if r.get("ratio_tokens_per_s") else "")
        status = r["status"] if r["status"] != "ok" else f"ok ({r['ok_runs']}/{r['runs']})"
        share = (r.get("fast_path") or {}).get("share")
        lines.append(f"{r['loader']:<{w}}{r['group']:<15}{r.get('workload', 'single'):<9}"
                     f"{fmt(r['tokens_per_s'], 1e6):>9}{fmt(r['e2e_tokens_per_s'], 1e6):>12}"
                     f"{fmt(r.get('cpu_s_per_mtok'), 1, 3):>11}{fmt(r.get('cpu_e2e_s_per_mtok'), 1, 3):>9}"
                     f"{fmt(share, 0.01, 1):>8}{fmt(r['first_batch_s']):>9}{fmt(r['restore_s'], 1, 3):>11}"
                     f"{fmt(r.get('restore_running_s'), 1, 3):>11}  {ratio:<54}{status}")
    mixed = [f"{r['loader']} {r['ratio_mixture_to_single']:.2f}x" for r in rows if r.get("ratio_mixture_to_single")]
    if mixed:
        lines.append("mixture / single steady tokens/s: " + ", ".join(mixed))
    return "\n".join(lines)


def fast_path_warnings(rows: list[dict]) -> list[str]:
    """One line per sluice row whose fast path served under `FAST_SHARE_MIN` of its steps, with the reasons."""
    out = []
    for r in rows:
        if r.get("fast_path_under_99"):
            fp = r["fast_path"]
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(fp["fallbacks"].items(), key=lambda kv: -kv[1]))
            paths = ", ".join(f"{k} {v}" for k, v in fp["steps_by_path"].items() if v)
            out.append(f"WARNING: {r['loader']} ({r.get('workload', 'single')}): the fast path served "
                       f"{fp['share'] * 100:.1f}% of steps (under {FAST_SHARE_MIN * 100:.0f}%); steps by path: "
                       f"{paths}; fall-backs: {reasons or 'none counted'}")
    return out


def chart(rows: list[dict], sweep: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["tokens_per_s"]]
    names = [r["loader"] if r.get("workload", "single") == "single" else f"{r['loader']} [{r['workload']}]"
             for r in ok]
    colors = ["tab:blue" if n.startswith("sluice") else "tab:gray" for n in names]
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))
    panels = (("tokens_per_s", "delivered M tokens/s, steady (after 2 batches)", 1e6),
              ("e2e_tokens_per_s", "delivered M tokens/s, end to end (from process start)", 1e6),
              ("first_batch_s", "first batch from process start (s)", 1),
              ("restore_s", "restore to first batch at 90% (s); blank: none\n"
               "hatched: sluice on its running daemon", 1))
    for ax, (key, title, scale) in zip(axes, panels):
        ax.barh(names, [(r[key] or 0) / scale for r in ok], color=colors)
        ax.set_title(title, fontsize=9)
        ax.invert_yaxis()
    running = [r.get("restore_running_s") or 0 for r in ok]
    if any(running):  # a thinner hatched bar over the new-daemon one
        axes[3].barh(names, running, height=0.35, color="white", edgecolor="tab:blue", hatch="//")
    for order in sorted({s.get("order", "block") for s in sweep}):
        good = [s for s in sweep if s.get("order", "block") == order and s.get("first_batch_s") is not None]
        axes[4].plot([s["object_mb"] for s in good], [s["first_batch_s"] for s in good], "o-", label=f"order {order}")
    for s in sweep:
        if s.get("first_batch_s") is None:  # a failed size is marked, never drawn as a value
            axes[4].axvline(s["object_mb"], color="tab:red", linestyle=":")
            axes[4].text(s["object_mb"], 0, " failed", color="tab:red", rotation=90, va="bottom")
    if sweep:
        axes[4].legend(fontsize=8)
    axes[4].set_xscale("log")
    axes[4].set_xlabel("object size (MB)")
    axes[4].set_ylim(bottom=0)
    axes[4].set_title("sluice first batch vs object size (s), cold cache", fontsize=9)
    fig.suptitle("bench/peers: blue = sluice, grey = peers and baseline; failed or not installed loaders absent "
                 "(see the table)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
