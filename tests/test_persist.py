"""Checkpoints: exact resume, plain-PyTorch readability, clear errors, and no data lost to a kill mid-save."""

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from gpt import GPT, GPTConfig

import offload
from tests.support.models import CASES, run

ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _gpt_with_dropout():
    # dropout draws from the global RNG every step, so an exact resume needs the RNG state restored
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=64, dropout=0.1, bias=False))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _wrap(model, **kw):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    # weights stream (0.6 of them fit), plus room for the activations of these batches
    engine = offload.wrap(model, opt, budget=int(0.6 * nbytes) + 400_000, bucket_bytes=nbytes // 8, device="cpu",
                          **kw)
    return engine, opt, sched


def _train(engine, opt, sched, steps, start):
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        _, loss = engine(x, targets=y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_save_load_resume_is_bitwise_exact(tmp_path):
    path = tmp_path / "ckpt.pt"
    engine, opt, sched = _wrap(_gpt_with_dropout())
    torch.manual_seed(1)
    first = _train(engine, opt, sched, 4, 0)
    engine.save(path, extra={"sched": sched.state_dict(), "step": 4})
    straight = _train(engine, opt, sched, 4, 4)
    want = engine.state_dict()
    engine.close()

    torch.manual_seed(12345)  # whatever the RNG did since, load puts it back
    engine2, opt2, sched2 = _wrap(_gpt_with_dropout())  # the same init weights; overwritten by load anyway
    extra = engine2.load(path)
    assert extra["step"] == 4
    sched2.load_state_dict(extra["sched"])
    resumed = _train(engine2, opt2, sched2, 4, 4)
    got = engine2.state_dict()
    assert resumed == straight, (first, straight, resumed)
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), name
    for k, state in want["optimizer"]["state"].items():
        for field, t in state.items():
            assert torch.equal(got["optimizer"]["state"][k][field], t), (k, field)
    engine2.close()


def test_checkpoint_weights_load_into_a_plain_model(tmp_path):
    path = tmp_path / "ckpt.pt"
    case = CASES["gpt"]()
    engine, opt, sched = _wrap(case.model)
    for step in range(3):
        b = case.make_batch(step)
        engine.backward(case.loss_fn(run(engine, b), b))
        opt.step()
    engine.save(path)
    masters = engine.state_dict()["model"]
    plain = CASES["gpt"]().model
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])  # plain PyTorch, no offload involved
    for name, t in plain.state_dict().items():
        assert torch.equal(t, masters[name]), name
    # the file holds the weights and AdamW state, not the rest of the host arena (grads, staging)
    nparams = sum(p.numel() for p in plain.parameters())
    assert os.path.getsize(path) < nparams * 12 * 1.1 + 200_000
    engine.close()


def test_save_before_the_first_step_and_fp16_scaler_state(tmp_path):
    path = tmp_path / "early.pt"
    case = CASES["mlp"]()
    engine, opt, _ = _wrap(case.model, dtype=torch.float16,
                           loss_scale=offload.LossScaleConfig(init_scale=64.0))
    engine.save(path)  # nothing traced yet: the module's own tensors are written
    b = case.make_batch(0)
    engine.backward(case.loss_fn(run(engine, b), b) * float("inf"))
    opt.step()
    assert engine.memory_stats()["optimizer"]["loss_scale"] == 32.0
    engine.save(path)
    engine.close()
    engine2, opt2, _ = _wrap(CASES["mlp"]().model, dtype=torch.float16)
    engine2.load(path)
    assert engine2.memory_stats()["optimizer"]["loss_scale"] == 32.0
    engine2.close()


def test_loading_another_models_checkpoint_names_the_mismatch(tmp_path):
    path = tmp_path / "gpt.pt"
    engine, _, _ = _wrap(_gpt_with_dropout())
    engine.save(path)
    engine.close()
    other, _, _ = _wrap(CASES["mlp"]().model)
    with pytest.raises(offload.CheckpointError, match=r"another model.*missing from the checkpoint: 0\.bias"):
        other.load(path)
    other.close()
    wider, _, _ = _wrap(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32, bias=False)))
    mismatch = r"shape \(checkpoint vs model\): blocks.0.attn.c_attn.weight \(192, 64\) vs \(96, 32\).*more"
    with pytest.raises(offload.CheckpointError, match=mismatch):
        wider.load(path)
    wider.close()


def test_truncated_or_foreign_files_give_clear_errors(tmp_path):
    path = tmp_path / "ckpt.pt"
    engine, _, _ = _wrap(_gpt_with_dropout())
    engine.save(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(offload.CheckpointError, match="truncated or corrupt"):
        engine.load(cut)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(offload.CheckpointError, match="not an offload checkpoint"):
        engine.load(foreign)
    with pytest.raises(FileNotFoundError):
        engine.load(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.save(tmp_path / "no" / "such" / "dir.pt")
    engine.close()


# One interpreter imports torch and offload once and forks a child per attempt (each fork is a real process that
# trains and saves until the test kills it; the parent reaps it, so the next save sees it gone): the kill is the
# same, without ~2 s of CPU for a fresh interpreter's imports each attempt. Nothing ran torch before the fork.
_CHILDREN = textwrap.dedent("""
    import os, sys, torch, offload
    from torch import nn
    path = sys.argv[1]

    def train_and_save():
        print(f"pid {os.getpid()}", flush=True)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 8.4M params: a ~100 MB checkpoint
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        engine = offload.wrap(model, opt, budget="64MiB", device="cpu")
        for i in range(1000):
            engine.backward(engine(torch.randn(2, 1024)).square().mean())
            opt.step()
            print(f"saving {i}", flush=True)
            engine.save(path, extra={"i": i})
            print(f"saved {i}", flush=True)

    for _ in sys.stdin:  # a line: one more child
        pid = os.fork()
        if pid == 0:
            try:
                train_and_save()
            finally:
                os._exit(1)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")


def test_kill_minus_9_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN)
    mid_write_kills = 0
    parent = subprocess.Popen([sys.executable, str(script), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
                              start_new_session=True)
    try:
        for attempt, delay in enumerate((0.05, 0.15, 0.3, 0.02, 0.1)):
            parent.stdin.write("child\n")
            parent.stdin.flush()
            pid = saved = None
            for line in parent.stdout:  # wait until one checkpoint is complete and the next one has begun
                assert not line.startswith("reaped"), "the child ended before it was killed"
                if line.startswith("pid"):
                    pid = int(line.split()[1])
                if line.startswith("saved"):
                    saved = int(line.split()[1])
                if line.startswith("saving") and saved is not None:
                    break
            time.sleep(delay)
            temporaries = glob.glob(str(tmp_path / ".ckpt.pt.tmp-*"))
            os.kill(pid, signal.SIGKILL)
            for line in parent.stdout:  # its parent reaped it: a save now sees its pid gone
                if line.startswith("reaped"):
                    break
            mid_write_kills += bool(temporaries)
            ck = torch.load(path, weights_only=True)  # complete and readable, whatever moment the kill hit
            assert ck["format"] == "offload-checkpoint" and ck["extra"]["i"] >= saved
            if mid_write_kills >= 2:
                break
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and any child still running (their own session)
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
    assert mid_write_kills >= 1, "no kill landed during a write: the test proved nothing"
    # the next save (in a live process) clears the temporaries the killed one left behind
    engine, _, _ = _wrap(_gpt_with_dropout())
    engine.save(tmp_path / "ckpt.pt")
    engine.close()
    assert glob.glob(str(tmp_path / ".ckpt.pt.tmp-*")) == []
