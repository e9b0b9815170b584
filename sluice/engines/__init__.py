"""Engines: who runs the per-object work of preparing a corpus.

Freezing and pre-tokenizing are one shape: the driver plans (lists the
objects), an engine runs one pure per-object function over the list, and the
driver assembles the results in list order and writes the manifest once, last.

| engine | freeze (`scan_job`) | pretokenize (`tokenize_object`) |
| --- | --- | --- |
| `local` (default) | process pool for big GIL-bound scans, else thread pool (`sluice.manifest.scan_pool`) | process pool (`sluice.tokenize.pretokenize`) |
| `ray` (`sluice[ray]`) | one Ray task per object (`sluice.engines.ray_engine`) | one Ray task per object |

Because every engine calls the same per-object function and the driver orders
the results, the outputs (manifest bytes, dataset IDs, shard bytes) do not
depend on the engine. No engine here is a scheduler of our own: beyond one
machine, the work runs on a cluster the user already operates.
"""
