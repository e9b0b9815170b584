"""`sluice manifest diff A B`: what changed between two manifests.

Objects are matched per source by location: a location only in A is
`removed`, only in B `added`, in both with another digest (or size) `changed`.
Objects whose bytes moved to another location show as removed + added with
the same digest, reported once more under `moved`.
"""

from __future__ import annotations

from typing import Any

from sluice.manifest.model import Manifest
from sluice.manifest.sources import Source

_SOURCE_TERMS = ("format", "text_field", "weight", "exhaustion", "split", "filters", "dedup", "notes", "paths")


def _source_diff(a: Source, b: Source) -> dict[str, Any]:
    out: dict[str, Any] = {}
    terms = {}
    for key in _SOURCE_TERMS:
        va, vb = getattr(a, key), getattr(b, key)
        if va != vb:
            terms[key] = {"a": list(va) if isinstance(va, tuple) else va, "b": list(vb) if isinstance(vb, tuple) else vb}
    if terms:
        out["terms"] = terms
    oa = {o.location: o for o in a.objects}
    ob = {o.location: o for o in b.objects}
    added = [{"location": k, "digest": ob[k].digest} for k in ob if k not in oa]
    removed = [{"location": k, "digest": oa[k].digest} for k in oa if k not in ob]
    changed = [
        {"location": k, "a": oa[k].digest, "b": ob[k].digest, "size_a": oa[k].size, "size_b": ob[k].size}
        for k in oa
        if k in ob and (oa[k].digest != ob[k].digest or oa[k].size != ob[k].size)
    ]
    removed_by_digest = {r["digest"]: r["location"] for r in removed}
    moved = [{"digest": x["digest"], "a": removed_by_digest[x["digest"]], "b": x["location"]}
             for x in added if x["digest"] in removed_by_digest]
    order = [o.location for o in a.objects if o.location in ob]
    if order != [o.location for o in b.objects if o.location in oa]:
        out["reordered"] = True
    for key, val in (("added", added), ("removed", removed), ("changed", changed), ("moved", moved)):
        if val:
            out[key] = val
    if a.records != b.records:
        out["records"] = {"a": a.records, "b": b.records}
    return out


def diff(a: Manifest, b: Manifest) -> dict[str, Any]:
    """A JSON-able description of every difference; `identical` iff the dataset IDs match."""
    out: dict[str, Any] = {"a": a.dataset_id, "b": b.dataset_id, "identical": a.dataset_id == b.dataset_id}
    top: dict[str, Any] = {}
    for key in ("name", "access", "notes"):
        if getattr(a, key) != getattr(b, key):
            top[key] = {"a": getattr(a, key), "b": getattr(b, key)}
    ta = a.tokenizer.to_obj() if a.tokenizer else None
    tb = b.tokenizer.to_obj() if b.tokenizer else None
    if ta != tb:
        top["tokenizer"] = {"a": ta, "b": tb}
    for key in ("packing", "mixture"):
        pa, pb = getattr(a, key).to_obj(), getattr(b, key).to_obj()
        changed = {k: {"a": pa.get(k), "b": pb.get(k)} for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)}
        if changed:
            top[key] = changed
    out["fields"] = top
    names_a = [s.name for s in a.sources]
    names_b = [s.name for s in b.sources]
    out["sources_added"] = [n for n in names_b if n not in names_a]
    out["sources_removed"] = [n for n in names_a if n not in names_b]
    out["sources_changed"] = {}
    for s in a.sources:
        if s.name in names_b:
            d = _source_diff(s, b.source(s.name))
            if d:
                out["sources_changed"][s.name] = d
    if [n for n in names_a if n in names_b] != [n for n in names_b if n in names_a]:
        out["sources_reordered"] = True
    return out


def render(d: dict[str, Any]) -> str:
    """Human-readable diff lines."""
    if d["identical"]:
        return f"identical: {d['a']}"
    lines = [f"a {d['a']}", f"b {d['b']}"]
    for key, val in d["fields"].items():
        if key in ("packing", "mixture"):
            for k, v in val.items():
                lines.append(f"~ {key}.{k}: {v['a']!r} -> {v['b']!r}")
        else:
            lines.append(f"~ {key}: {val['a']!r} -> {val['b']!r}")
    for n in d["sources_added"]:
        lines.append(f"+ source {n}")
    for n in d["sources_removed"]:
        lines.append(f"- source {n}")
    if d.get("sources_reordered"):
        lines.append("~ sources reordered")
    for n, sd in d["sources_changed"].items():
        for k, v in sd.get("terms", {}).items():
            lines.append(f"~ source {n}.{k}: {v['a']!r} -> {v['b']!r}")
        for x in sd.get("added", []):
            lines.append(f"+ source {n} object {x['location']} {x['digest']}")
        for x in sd.get("removed", []):
            lines.append(f"- source {n} object {x['location']} {x['digest']}")
        for x in sd.get("changed", []):
            lines.append(f"~ source {n} object {x['location']}: {x['a']} ({x['size_a']} B) -> {x['b']} ({x['size_b']} B)")
        for x in sd.get("moved", []):
            lines.append(f"> source {n} object {x['digest']} moved {x['a']} -> {x['b']}")
        if sd.get("reordered"):
            lines.append(f"~ source {n}: objects reordered")
        if "records" in sd:
            lines.append(f"~ source {n} records: {sd['records']['a']} -> {sd['records']['b']}")
    return "\n".join(lines)
