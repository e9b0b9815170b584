"""The checks of `sluice preflight` that need no measurement: objects, node cache, tokenizer, metrics port.

Each returns a `Check` and never raises for what it finds: a missing object,
a damaged cache object or another tokenizer is a failed check naming the
thing, so one preflight names every problem at once. What the checks reuse:

* objects: `sluice.manifest.verify.verify(rehash=False)`: a stat (local) or
  HEAD (s3) per object, sizes compared, no byte read, bounded by a deadline;
  the allowed roots as loaderd checks them (`sluice.cache.roots`);
* cache: `NodeCache.verify_all` (`sluice cache verify`: every published
  object re-hashed, damaged ones quarantined), and which of the manifest's
  objects and tokens it holds (what decides whether the run tokenizes);
* tokenizer: `manifest_tokenizer_identity` (file and digest, as loaderd
  checks at start), `encoder_for_manifest` (parsed, backend built), and for a
  backend other than `tokenizers` the `tokenize check` comparison on a
  sample of local documents (this node's library must give the ids freeze
  proved);
* metrics: the daemon's own exporter (`Metrics.start_http`) bound on the
  port, /metrics read once, then stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import SluiceError

# `tokenize check` of a non-hf backend at preflight: about this many documents and characters (seconds at most).
SAMPLE_DOCUMENTS = 200
SAMPLE_CHARS = 1 << 20
_SHOWN = 20  # problems listed per check (the count covers all)


@dataclass(frozen=True)
class Check:
    """One check's outcome: `status` "ok", "fail", "warn" (does not fail the preflight) or "skip"."""

    name: str
    status: str
    summary: str
    problems: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_obj(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "problems": list(self.problems), **self.details}


def _listed(problems: list[str]) -> tuple[str, ...]:
    shown = problems[:_SHOWN]
    if len(problems) > _SHOWN:
        shown.append(f"... and {len(problems) - _SHOWN} more")
    return tuple(shown)


def check_objects(manifest: Any, allow_root: list[str] | None, timeout_s: float) -> Check:
    """Every object within the allowed roots, reachable, of the recorded size (stat / HEAD; nothing downloaded)."""
    from sluice.cache.roots import check_manifest, roots_for
    from sluice.errors import LocationRefused
    from sluice.manifest.verify import verify

    problems: list[str] = []
    try:
        check_manifest(manifest, roots_for(manifest, allow_root), where="manifest")
    except LocationRefused as exc:
        problems.append(f"{exc} (loaderd refuses such a manifest: give --allow-root)")
    t0 = time.monotonic()
    report = verify(manifest, rehash=False, timeout_s=timeout_s)
    problems += [str(p) for p in report.problems]
    where = f"{report.total} objects, {report.bytes:,} bytes, in {time.monotonic() - t0:.2f} s"
    if problems:
        return Check("objects", "fail", f"{len(report.problems)} of {report.total} objects unreachable or of "
                     f"another size ({where})", _listed(problems), {"objects": report.total})
    return Check("objects", "ok", f"all reachable, sizes as recorded ({where})", details={"objects": report.total})


def check_cache(cache_dir: str | None, manifest: Any) -> Check:
    """With a cache folder: `sluice cache verify` over it, and how many of the manifest's objects and tokens it holds.

    CacheError (not a node cache) propagates: a wrong --cache is bad input.
    """
    if cache_dir is None:
        return Check("cache", "skip", "no --cache given: the run's node cache is not checked")
    from sluice.cache.cli import open_cache

    cache = open_cache(cache_dir, None, must_exist=True, collect=False)
    try:
        report = cache.verify_all()
        held = holdings(cache, manifest)
    finally:
        cache.close()
    problems = [f"damaged cache object {key}: {reason} (quarantined and removed from the index; "
                "the next fetch fills it again)" for key, reason in report.damaged]
    details = {"checked": report.checked, "damaged": len(report.damaged), "busy": len(report.busy), **held}
    what = (f"{report.checked} cached objects re-hashed; holds {held['objects_cached']} of {held['objects']} "
            f"objects, tokens of {held['tokens_cached']} of {held['text_objects']} text objects")
    if problems:
        return Check("cache", "fail", f"{len(report.damaged)} damaged: {what}", _listed(problems), details)
    return Check("cache", "ok", what, details=details)


def holdings(cache: Any, manifest: Any) -> dict[str, int]:
    """How many of the manifest's objects, and of its text objects' tokens, `cache` holds (pins released)."""
    from sluice.tokenize.tokcache import lookup_tokens

    unique = {obj.digest for src in manifest.sources for obj in src.objects}
    cached = 0
    for digest in unique:
        pin = cache.lookup(digest)
        if pin is not None:
            cached += 1
            pin.close()
    texts = [(s, o) for s, src in enumerate(manifest.sources) if src.format != "tokens"
             for o in range(len(src.objects))]
    tokens = 0
    if texts:
        try:
            from sluice.loaderd.physical.assemble import DeferredEncoder

            ident = DeferredEncoder(manifest)  # what cached tokens are keyed by, without parsing the file
        except SluiceError:
            ident = None  # the tokenizer check names the problem
        for s, o in texts if ident is not None else ():
            pin = lookup_tokens(cache, manifest, s, o, ident)
            if pin is not None:
                tokens += 1
                pin.close()
    return {"objects": len(unique), "objects_cached": cached, "text_objects": len(texts), "tokens_cached": tokens}


def check_tokenizer(manifest: Any) -> Check:
    """The manifest's tokenizer file present with its digest, parsed, its backend built and giving hf's ids here."""
    from sluice.tokenize.encoder import encoder_for_manifest, manifest_tokenizer_identity

    if all(src.format == "tokens" for src in manifest.sources):
        return Check("tokenizer", "skip", "every source is pre-tokenized: the run never tokenizes")
    try:
        ident = manifest_tokenizer_identity(manifest)
        encoder = encoder_for_manifest(manifest)
    except SluiceError as exc:
        return Check("tokenizer", "fail", "the run's tokenizer cannot be loaded", (str(exc),))
    details = {"digest": ident.digest, "backend": ident.backend, "recorded_backend": ident.recorded,
               "vocab_size": encoder.vocab_size}
    what = f"{ident.digest[:19]}..., vocabulary {encoder.vocab_size}, backend {ident.backend}"
    if ident.backend != "hf":
        from sluice.tokenize.check import LocalObjects, check_backend

        try:
            result = check_backend(manifest, ident.backend, cache=LocalObjects(), sample=SAMPLE_DOCUMENTS,
                                   sample_chars=SAMPLE_CHARS, other=encoder)
        except SluiceError as exc:
            return Check("tokenizer", "fail", f"backend {ident.backend} could not be compared with tokenizers",
                         (str(exc),), details)
        if not result.equal:
            return Check("tokenizer", "fail", f"backend {ident.backend} gives other ids than tokenizers here",
                         tuple(m.describe(ident.backend) for m in result.mismatches), details)
        what += f" (same ids as tokenizers on {result.documents} sampled documents)"
    if ident.fallback:
        return Check("tokenizer", "warn", f"{what}: the manifest records {ident.recorded}, not installed here "
                     f"(pip install {ident.recorded}); tokenizers serves the same ids, slower", details=details)
    return Check("tokenizer", "ok", what, details=details)


def check_metrics(port: int) -> Check:
    """The daemon's metrics exporter bound on 127.0.0.1:`port` (0: any free port), /metrics read once, stopped."""
    import urllib.request

    from sluice.loaderd.metrics import Metrics

    metrics = Metrics("preflight", "preflight", ["s"], [1.0])
    try:
        bound = metrics.start_http(port)
    except SluiceError as exc:
        return Check("metrics", "fail", f"port {port} cannot be bound", (str(exc),), {"port": port})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=10) as reply:
            body = reply.read(1 << 20)
    except OSError as exc:
        return Check("metrics", "fail", f"bound 127.0.0.1:{bound}, but /metrics did not answer",
                     (f"GET http://127.0.0.1:{bound}/metrics: {exc}",), {"port": bound})
    finally:
        metrics.stop_http()
    return Check("metrics", "ok", f"127.0.0.1:{bound} bound, /metrics answered ({len(body)} bytes)",
                 details={"port": bound})
