"""bench/peers/run.py's report: the table it prints, the fast-path warning lines, the chart it draws.

Each takes the rows `run.summarize` makes (one per loader and workload); nothing
here runs a job.
"""

from __future__ import annotations

from pathlib import Path

FAST_PATHS = ("fused-kernel", "fused-numpy")  # the producer's fast path (docs/logical.md)
FAST_SHARE_MIN = 0.99  # issue 23: the run fails where the fast path served fewer of sluice's steps


def fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = (f"{'loader':<24}{'group':<15}{'workload':<9}{'M tok/s':>9}{'e2e M tok/s':>12}{'CPU s/Mtok':>11}"
            f"{'e2e CPU':>9}{'fast %':>8}{'first s':>9}{'restore s':>11}{'running s':>11}  "
            f"{'x best peer: steady / e2e':<42}status")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = (f"{r['ratio_tokens_per_s']:.2f}x {r['best_peer']} / {fmt(r.get('ratio_e2e'))}x "
                 f"{r.get('best_peer_e2e', '')}" if r.get("ratio_tokens_per_s") else "")
        status = r["status"] if r["status"] != "ok" else f"ok ({r['ok_runs']}/{r['runs']})"
        share = (r.get("fast_path") or {}).get("share")
        lines.append(f"{r['loader']:<24}{r['group']:<15}{r.get('workload', 'single'):<9}"
                     f"{fmt(r['tokens_per_s'], 1e6):>9}{fmt(r['e2e_tokens_per_s'], 1e6):>12}"
                     f"{fmt(r.get('cpu_s_per_mtok'), 1, 3):>11}{fmt(r.get('cpu_e2e_s_per_mtok'), 1, 3):>9}"
                     f"{fmt(share, 0.01, 1):>8}{fmt(r['first_batch_s']):>9}{fmt(r['restore_s'], 1, 3):>11}"
                     f"{fmt(r.get('restore_running_s'), 1, 3):>11}  {ratio:<42}{status}")
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
