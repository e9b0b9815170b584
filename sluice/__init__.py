"""sluice: the data plane for large training runs.

Keep this module light: `import sluice.client` must not pull in pyarrow,
tokenizers or torch (see DESIGN.md, "heavy, fragile imports").
"""

__version__ = "0.1.0"
