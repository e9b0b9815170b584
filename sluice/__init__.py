"""sluice: the data plane for large training runs.

Keep this module light: `import sluice.client` must not pull in pyarrow,
tokenizers or torch (see DESIGN.md, "heavy, fragile imports"). `sluice.stream`
(files to a resumable stream in one call, sluice/runprep.py) is imported on
first use.
"""

from sluice._lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __all__ = lazy_exports(__name__, {"stream": "sluice.runprep", "prepare": "sluice.runprep"})
