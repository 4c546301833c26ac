"""The README's first command, scaled down: examples/train_gpt.py trains, the loss goes down, the device peak
stays within the budget (the script exits 1 otherwise) and the memory summary is printed."""

import os
import subprocess
import sys
from pathlib import Path

import offload

ROOT = Path(__file__).resolve().parents[1]

# A few seconds on two cores, and the script's default budget (3/4 of the weights) stays feasible: activations
# grow with tokens x width x depth but weights with width^2 x depth, so 16 tokens of a 4 x 128 model keep the
# activations (~0.5 MiB) and the largest parameter (256 KiB) well under the 2.4 MiB budget.
TINY = "--steps 12 --n-layer 4 --n-embd 128 --n-head 4 --batch 1 --seq 16 --eval-every 6".split()


def test_train_gpt_example():
    env = dict(os.environ, COLUMNS="120")  # rich wraps at 80 columns without a terminal
    # The script imports offload as a user's script would: let it find the package these tests import.
    here = str(Path(offload.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "the weights alone do not fit" in out, out  # the default budget is below the fp32 weights
    assert "val loss" in out, out
    assert "device memory (engine.memory_stats())" in out, out  # the summary table
    for row in ("budget", "device peak", "arena", "pinned host", "buckets", "re-plans"):
        assert row in out, f"memory summary lacks {row!r}:\n{out}"
    assert "within budget" in out, out
