"""`sluice manifest show`: a human summary of a manifest (or `--json`)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sluice.manifest.model import Manifest


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def summary(manifest: Manifest) -> dict[str, Any]:
    """Everything `show --json` prints: identity, totals, per-source terms, policies."""
    total_weight = sum(Decimal(s.weight) for s in manifest.sources)
    return {
        "dataset_id": manifest.dataset_id,
        "name": manifest.name,
        "access": manifest.access,
        "notes": dict(manifest.notes),
        "records": sum(s.records for s in manifest.sources),
        "bytes": sum(s.bytes for s in manifest.sources),
        "objects": sum(len(s.objects) for s in manifest.sources),
        "tokenizer": manifest.tokenizer.to_obj() if manifest.tokenizer else None,
        "packing": manifest.packing.to_obj(),
        "mixture": manifest.mixture.to_obj(),
        "sources": [
            {
                "name": s.name,
                "format": s.format,
                "text_field": s.text_field,
                "weight": s.weight,
                # share of the total weight, as a decimal string (no floats)
                "share": format((Decimal(s.weight) / total_weight).quantize(Decimal("0.0001")), "f"),
                "exhaustion": s.exhaustion,
                "split": s.split,
                "filters": list(s.filters),
                "dedup": s.dedup,
                "notes": s.notes,
                "paths": list(s.paths),
                "objects": len(s.objects),
                "records": s.records,
                "bytes": s.bytes,
                "compression": sorted({o.compression for o in s.objects}),
            }
            for s in manifest.sources
        ],
    }


def render(manifest: Manifest) -> str:
    """The human summary."""
    info = summary(manifest)
    lines = [
        f"dataset   {info['dataset_id']}",
        f"name      {info['name']}   access: {info['access']}",
        f"total     {info['records']} records, {info['objects']} objects, {_human_bytes(info['bytes'])}",
    ]
    t = manifest.tokenizer
    lines.append(
        f"tokenizer {t.location}  {t.digest}  version {t.version or '-'}  vocab {t.vocab_size}" if t else "tokenizer (none)"
    )
    p = manifest.packing
    lines.append(
        f"packing   {p.algorithm} seq_len={p.seq_len} separator={p.separator} eos_id={p.eos_id} "
        f"bos_id={p.bos_id} pad_id={p.pad_id} window={p.window} loss_mask={p.loss_mask}"
    )
    mix = manifest.mixture
    pieces = f", pieces of at most {mix.piece_tokens} tokens" if mix.piece_tokens is not None else ""
    lines.append(f"mixture   {mix.policy} by {mix.unit}{pieces}")
    lines.append("sources")
    header = f"  {'name':<16} {'format':<10} {'weight':>8} {'share':>7} {'exhaust':<11} {'objects':>7} {'records':>10} {'bytes':>10}"
    lines.append(header)
    for s in info["sources"]:
        comp = ",".join(c for c in s["compression"] if c != "none")
        fmt = s["format"] + (f"+{comp}" if comp else "")
        lines.append(
            f"  {s['name']:<16} {fmt:<10} {s['weight']:>8} {s['share']:>7} {s['exhaustion']:<11} "
            f"{s['objects']:>7} {s['records']:>10} {_human_bytes(s['bytes']):>10}"
        )
        extra = [f"split={s['split']}"]
        if s["filters"]:
            extra.append(f"filters={','.join(s['filters'])}")
        if s["dedup"] != "none":
            extra.append(f"dedup={s['dedup']}")
        lines.append(f"    paths: {', '.join(s['paths'])}   {' '.join(extra)}")
        if s["notes"]:
            lines.append(f"    notes: {s['notes']}")
    for k, v in sorted(info["notes"].items()):
        lines.append(f"note      {k}: {v}")
    return "\n".join(lines)
