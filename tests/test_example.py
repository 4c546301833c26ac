"""The README's first command, scaled down: examples/train_gpt.py trains, the loss goes down, the device peak
stays within the budget (the script exits 1 otherwise) and the memory summary is printed."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import offload

ROOT = Path(__file__).resolve().parents[1]

# A few seconds on two cores, and the script's default budget (3/4 of the weights) stays feasible: activations
# grow with tokens x width x depth but weights with width^2 x depth, so 16 tokens of a 4 x 128 model keep the
# activations (~0.5 MiB) and the largest parameter (256 KiB) well under the 2.4 MiB budget.
TINY = ["--steps", "12", "--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--batch", "1", "--seq", "16", "--eval-every", "6"]


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
    assert "within budget" in out and "OVER BUDGET" not in out, out  # on a GPU: with its measured headroom


def _main(module: str, *args: str, capsys) -> str:
    """Run an example's main() in this process (no interpreter and torch start-up per run); its output."""
    main = importlib.import_module(module).main
    code = main(list(args))
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_train_gpt_save_and_resume(tmp_path, capsys):
    """--save at every evaluation, --resume continues from the step saved, to the same last loss as an
    uninterrupted run (weights, AdamW state, LR schedule and data position all come back)."""
    ckpt = str(tmp_path / "ckpt.pt")
    small = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--batch", "1", "--seq", "16", "--eval-every", "4"]
    whole = _main("train_gpt", "--steps", "8", *small, capsys=capsys)
    _main("train_gpt", "--steps", "8", *small, "--save", ckpt, "--stop-after", "4", capsys=capsys)
    resumed = _main("train_gpt", "--steps", "8", *small, "--resume", ckpt, capsys=capsys)
    assert "resumed from" in resumed and "at step 4" in resumed, resumed
    last = [line for line in whole.splitlines() if line.startswith("step 8:")]
    assert last and last == [line for line in resumed.splitlines() if line.startswith("step 8:")], (whole, resumed)


@pytest.mark.hf
def test_train_gpt_hf_gpt2_defaults(capsys):
    """`train_gpt.py --model hf-gpt2` (a README command) at its default sizes and budget: GPT-2's eager attention
    saves more than that budget leaves, so its default is --checkpointing auto (it exited 2 with the engine's
    hint before); it trains within the budget (the script exits 1 otherwise). Fewer steps than the default."""
    pytest.importorskip("transformers")
    out = _main("train_gpt", "--model", "hf-gpt2", "--steps", "6", "--eval-every", "6", capsys=capsys)
    assert 'activation_checkpointing="auto"' in out and "within budget" in out, out
    assert importlib.import_module("train_gpt").parse_args([]).checkpointing == "none"  # the built-in GPT: unchanged


def test_finetune_frozen_example(capsys):
    """The script checks itself (exit 1 otherwise): no optimizer state for frozen weights on the host, no
    backward copies of buckets below the lowest trainable parameter, bytes copied = the plan's, peak <= budget."""
    out = _main("finetune_frozen", *["--steps", "8", "--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--seq", "16", "--lora", "4"],
                capsys=capsys)
    assert "not copied for backward" in out and "FAIL" not in out, out


@pytest.mark.hf
def test_bert_mlm_example(capsys):
    pytest.importorskip("transformers")
    # The example's default is --checkpointing auto (its default shapes need it, checked by hand: 4 of 4 blocks,
    # peak 9.3 of 9.5 MiB); at these tiny shapes the activations fit without, and "auto" runs like None within the
    # same budget (1.29 MiB). Regression: its warm-up step checkpoints every block, and its recomputes held their
    # blocks' weights until each block's backward ended, so that step went over the budget (1.55 MiB) and "auto"
    # refused it. The script exits 1 if the device peak (of the whole run: every step) is over the budget.
    args = "--steps 8 --layers 2 --hidden 128 --heads 4 --seq 16 --batch 1 --checkpointing"
    for mode in ("none", "auto"):
        out = _main("bert_mlm", *args.split(), mode, capsys=capsys)
        assert "BertForMaskedLM" in out and "budget" in out and "<= budget" in out, out
