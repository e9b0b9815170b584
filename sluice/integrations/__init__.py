"""Adapters from the sluice client to the tools trainers already run.

Each submodule imports its framework (torch, transformers, lightning) itself,
so importing this package pulls in nothing heavy:

    sluice.integrations.torch_data   IterableDataset / StatefulDataLoader forms
    sluice.integrations.hf           transformers.Trainer: row dataset, collator, loss, TrainerCallback

See docs/integrations.md for what each keeps exact.
"""
