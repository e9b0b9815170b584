"""Adapters from the sluice client to the tools trainers already run.

Each submodule imports its framework (torch, transformers, lightning) itself,
so importing this package pulls in nothing heavy:

    sluice.integrations.torch_data   IterableDataset / StatefulDataLoader forms
    sluice.integrations.hf           transformers.Trainer: row dataset, collator, TrainerCallback, SluiceTrainer (N ranks)
    sluice.integrations.lightning    a LightningDataModule whose state rides in Lightning checkpoints
    sluice.integrations.ddp          the data-parallel determinism recipe (flat summed all-reduce)
    sluice.integrations.fsdp         FSDP2 with the recipe; model/optimizer shards checkpointed with the data

See docs/integrations.md for what each keeps exact.
"""
