"""Shared test setup: the example's GPT importable as `gpt`, tests/models.py as `models`, fixed seeds."""

import os
import random
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Explicit, so it works whatever pytest's import mode (prepend or importlib) puts on sys.path.
for path in (ROOT / "examples", TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# The reference and the engine run in this process with the same intra-op thread count, so results do not
# depend on it; capping it keeps torch's pool from fighting the engine's copy and optimizer threads.
torch.set_num_threads(min(4, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every test starts from the same global RNG state, whatever ran before it. Test models and batches
    use their own generators anyway (tests/models.py); this catches anything that does not."""
    random.seed(0)
    torch.manual_seed(0)
