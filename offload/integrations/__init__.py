"""Integrations with training frameworks. Each lives in its own module and imports its framework only
when that module is imported (``from offload.integrations.hf import OffloadTrainer``), so ``import offload``
never needs them."""
