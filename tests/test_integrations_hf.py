"""``offload.integrations.hf.OffloadTrainer`` against the plain ``transformers.Trainer``.

Tiny models built from configs (tests/support/hf_models.py; nothing downloaded), the CPU backend, a budget below the
parameter bytes so buckets stream. With ``optim="adamw_torch"`` the engine runs torch's own AdamW ops
(``offload.AdamW(fused=False)``), so fp32 runs must equal the plain Trainer bit for bit: every logged loss and
grad norm, and the final weights. bf16 is compared within a tolerance (the engine keeps every weight in
bf16 on the device; autocast keeps fp32 weights).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState

import offload
from offload.integrations.hf import OffloadTrainer, UnsupportedTrainingArgumentError
from tests.support import hf_models

pytestmark = pytest.mark.hf

BUDGET = 0.8  # of the fp32 parameter bytes: buckets stream, the tiny activations still fit


class Rows(torch.utils.data.Dataset):
    """The case's batches, split into single examples (the Trainer batches and shuffles them itself)."""

    def __init__(self, case: hf_models.HFCase, batches: int, first: int = 0):
        self.rows = [{k: v[i] for k, v in case.make_batch(s).items()}
                     for s in range(first, first + batches) for i in range(hf_models.BATCH)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class Logs(transformers.TrainerCallback):
    def __init__(self):
        self.train, self.eval = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.train.append((state.global_step, logs["loss"], logs.get("grad_norm")))
        if "eval_loss" in logs:
            self.eval.append((state.global_step, logs["eval_loss"]))


def _args(tmp_path, **over) -> transformers.TrainingArguments:
    kw = dict(output_dir=str(tmp_path / "out"), report_to=[], max_steps=4, per_device_train_batch_size=2,
              logging_steps=1, save_strategy="no", optim="adamw_torch", learning_rate=1e-3, weight_decay=0.1,
              warmup_steps=1, lr_scheduler_type="cosine", use_cpu=True, disable_tqdm=True, seed=3)
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def _config(model, **fields) -> offload.OffloadConfig:
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    return offload.OffloadConfig(budget=int(BUDGET * nbytes), bucket_bytes=nbytes // 10, device="cpu", **fields)


def _train(cls, factory, args, *, resume=None, eval_batches=0, **offload_kw):
    # accelerate's AcceleratorState is process-wide and refuses a second mixed_precision: the plain Trainer
    # with bf16 asks for "bf16", OffloadTrainer for "no" (the engine does the precision). A test runs both.
    AcceleratorState._reset_state()
    case = factory()
    logs = Logs()
    extra = {"offload_config": _config(case.model, **offload_kw)} if issubclass(cls, OffloadTrainer) else {}
    eval_ds = Rows(case, eval_batches, first=1000) if eval_batches else None
    trainer = cls(model=case.model, args=args, train_dataset=Rows(case, 8), eval_dataset=eval_ds,
                  callbacks=[logs], **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, logs


def _weights(trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer, OffloadTrainer):
        return trainer.engine.state_dict()["model"]
    return {k: v.detach() for k, v in trainer.model.state_dict().items()}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    wrong = [k for k in a if not torch.equal(a[k], b[k])]
    assert not wrong, f"differ: {wrong[:5]}"


@pytest.mark.parametrize("factory", [hf_models.gpt2, hf_models.llama, hf_models.bert_mlm, hf_models.t5],
                         ids=["gpt2", "llama", "bert", "t5"])
def test_equals_plain_trainer_with_accumulation_and_clipping(tmp_path, factory):
    """4 optimizer steps of 2 accumulated micro-batches, clipped at a max norm the grads exceed, cosine LR with
    warmup and weight decay on two param groups: every loss, every grad norm and the weights match bit for bit.
    (Before engine.clip_grad_norm_ was used, the Trainer's own clip read p.grad: norm 0.0, nothing clipped.)"""
    args = _args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.5)
    plain, ref = _train(transformers.Trainer, factory, args)
    ours, got = _train(OffloadTrainer, factory, args)
    assert len(ref.train) == 4 and all(n > 0.5 for _, _, n in ref.train)  # clipping really happens
    assert got.train == ref.train
    _assert_same_weights(_weights(ours), _weights(plain))
    stats = ours.engine.memory_stats()
    assert stats["plan"]["streamed_buckets"] > 0
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
    assert not stats["optimizer"]["overlap"]  # accumulation and clipping need the deferred updates


class _TrainersOwnClip(OffloadTrainer):
    """OffloadTrainer with the Trainer's own clipping and norm instead of ``engine.clip_grad_norm_``: accelerate's
    ``clip_grad_norm_`` -> ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`` on ``p.grad``
    (what a Trainer subclass with its own clipping, or a callback reading p.grad, meets)."""

    _clip_grad_norm = transformers.Trainer._clip_grad_norm
    _get_grad_norm = transformers.Trainer._get_grad_norm


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_trainers_own_clip_on_p_grad_clips_like_plain_trainer(tmp_path, accumulate):
    """max_grad_norm far below the grads' norm through the Trainer's own path on p.grad (issue 19: before p.grad
    showed the gradients it returned 0.0 and clipped nothing): every logged loss and grad norm and the weights
    equal the plain Trainer's bit for bit, and they differ from a run that does not clip."""
    args = _args(tmp_path, gradient_accumulation_steps=accumulate, max_grad_norm=0.05)
    plain, ref = _train(transformers.Trainer, hf_models.gpt2, args)
    ours, got = _train(_TrainersOwnClip, hf_models.gpt2, args)
    assert len(ref.train) == 4 and all(n > 0.5 for _, _, n in ref.train)  # ten times the max norm and more
    assert got.train == ref.train
    _assert_same_weights(_weights(ours), _weights(plain))
    assert ours.engine.memory_stats()["plan"]["streamed_buckets"] > 0
    unclipped, _ = _train(OffloadTrainer, hf_models.gpt2, _args(tmp_path, gradient_accumulation_steps=accumulate,
                                                               max_grad_norm=1e9))
    differ = [k for k, v in _weights(unclipped).items() if not torch.equal(v, _weights(ours)[k])]
    assert differ, "clipping at 0.05 must change the weights"


def test_overlapped_optimizer_without_accumulation_or_clipping(tmp_path):
    """No accumulation, max_grad_norm=0: updates overlap backward; same numbers, and no grad norm is logged
    (grads are consumed during backward) rather than a wrong one."""
    args = _args(tmp_path, max_grad_norm=0.0)
    plain, ref = _train(transformers.Trainer, hf_models.gpt2, args)
    ours, got = _train(OffloadTrainer, hf_models.gpt2, args)
    assert ours.engine.memory_stats()["optimizer"]["overlap"]
    assert [(s, loss) for s, loss, _ in got.train] == [(s, loss) for s, loss, _ in ref.train]
    assert all(n is None for _, _, n in got.train)
    _assert_same_weights(_weights(ours), _weights(plain))


def test_evaluation_mid_training(tmp_path):
    args = _args(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
                 gradient_accumulation_steps=2)
    plain, ref = _train(transformers.Trainer, hf_models.llama, args, eval_batches=2)
    ours, got = _train(OffloadTrainer, hf_models.llama, args, eval_batches=2)
    assert [s for s, _ in got.eval] == [2, 4]
    assert got.eval == ref.eval and got.train == ref.train
    assert ours.evaluate()["eval_loss"] == plain.evaluate()["eval_loss"]


def test_bf16_close_to_plain_trainer_autocast(tmp_path):
    """bf16: every weight is bf16 on the device (autocast keeps fp32 weights), so close, not equal."""
    args = _args(tmp_path, bf16=True, gradient_accumulation_steps=2)
    _, ref = _train(transformers.Trainer, hf_models.gpt2, args)
    ours, got = _train(OffloadTrainer, hf_models.gpt2, args)
    assert ours.engine.config.dtype == torch.bfloat16
    for (s, a, na), (_, b, nb) in zip(got.train, ref.train):
        assert abs(a - b) <= 0.03 * abs(b), (s, a, b)
        assert abs(na - nb) <= 0.1 * nb, (s, na, nb)


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    """6 steps straight vs 3 steps, checkpoint, a new trainer on a fresh model resumed from it, 3 more:
    the same losses and weights bit for bit (weights, AdamW state, LR schedule, data order, RNG)."""
    args = _args(tmp_path, max_steps=6, gradient_accumulation_steps=2, save_strategy="steps", save_steps=3)
    whole, ref = _train(OffloadTrainer, hf_models.gpt2, args)
    ckpt = os.path.join(args.output_dir, "checkpoint-3")
    assert os.path.isfile(os.path.join(ckpt, "offload.pt"))
    resumed, got = _train(OffloadTrainer, hf_models.gpt2, args, resume=ckpt)
    assert [s for s, _, _ in got.train] == [4, 5, 6]
    assert got.train == ref.train[3:]
    _assert_same_weights(_weights(resumed), _weights(whole))


def test_save_model_writes_real_weights(tmp_path):
    """save_model() writes the engine's fp32 weights (the module holds placeholders), loadable without offload."""
    args = _args(tmp_path, max_steps=2)
    ours, _ = _train(OffloadTrainer, hf_models.gpt2, args)
    ours.save_model(str(tmp_path / "final"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    want = _weights(ours)
    got = loaded.state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("factory,reentrant", [
    pytest.param(f, r, id=f"{name}-{'reentrant' if r else 'default'}",
                 marks=[pytest.mark.slow] if (name, r) == ("llama", True) else [])  # slow: ~15-35 s on 2 cores
    for name, f in (("gpt2", hf_models.gpt2), ("llama", hf_models.llama), ("t5", hf_models.t5)) for r in (False, True)])
def test_activation_checkpointing_equals_plain_trainer(tmp_path, factory, reentrant):
    """``TrainingArguments(activation_checkpointing=True)`` (alias ``gradient_checkpointing``; issue 19, refused
    before): transformers' default, non-reentrant, is mapped to the engine's checkpointing of the same layers;
    ``use_reentrant=True`` is transformers' own checkpoint, which the engine follows. Either way every loss, grad
    norm and weight equals the plain Trainer's with the same checkpointing, streamed, within the budget. Except
    T5's mapped checkpointing: its decoder blocks also take the encoder's output and the position bias as
    arguments, which the engine's checkpoint passes through its region marker (transformers' binds them into a
    partial), so autograd sums their grads from the blocks in another order: the losses and grad norms within a
    few ulps (equal on an Intel Xeon; a loss 1 ulp apart at step 3 on an AMD EPYC), the weights after 4 steps
    within 1 ulp (41 of 50 tensors differ by at most 1.2e-7 when measured)."""
    kw = {"activation_checkpointing_kwargs": {"use_reentrant": True}} if reentrant else {}
    args = _args(tmp_path, activation_checkpointing=True, gradient_accumulation_steps=2, max_grad_norm=0.5, **kw)
    plain, ref = _train(transformers.Trainer, factory, args)
    assert plain.model.is_activation_checkpointing  # the reference really checkpoints
    ours, got = _train(OffloadTrainer, factory, args)
    if factory is hf_models.t5 and not reentrant:
        assert [step for step, *_ in got.train] == [step for step, *_ in ref.train]
        torch.testing.assert_close(got.train, ref.train, rtol=4e-7, atol=0)  # a few float32 ulps
        mine, theirs = _weights(ours), _weights(plain)
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=2.5e-7, msg=name)
    else:
        assert got.train == ref.train
        _assert_same_weights(_weights(ours), _weights(plain))
    stats = ours.engine.memory_stats()
    assert stats["plan"]["streamed_buckets"] > 0
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
    checkpointed = stats["activation_checkpointing"]["checkpointed"]
    assert ours.model.is_activation_checkpointing
    if reentrant:  # transformers' checkpoint runs; the engine's checkpoints nothing itself
        assert not checkpointed
    else:
        assert set(checkpointed) == {n for n, m in ours.model.named_modules()
                                     if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)}


def test_resume_needs_an_offload_checkpoint(tmp_path):
    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    _train(transformers.Trainer, hf_models.gpt2, args)
    with pytest.raises(offload.OffloadError, match="offload.pt"):
        _train(OffloadTrainer, hf_models.gpt2, args, resume=os.path.join(args.output_dir, "checkpoint-2"))


@pytest.mark.parametrize("change, match", [
    ({"deepspeed": "ds_config.json"}, "deepspeed"),
    ({"fsdp": "full_shard"}, "fsdp"),
    ({"torch_compile": True}, "torch_compile"),
    ({"optim": "sgd"}, "optim='sgd'"),
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"offload": True}}, "offload=True"),
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"preserve_rng_state": False}},
     "preserve_rng_state"),
    ({"bf16_full_eval": True}, "full_eval"),
])
def test_refuses_what_it_cannot_do(tmp_path, change, match):
    args = _args(tmp_path)
    for key, value in change.items():  # set after construction: TrainingArguments would import deepspeed etc.
        setattr(args, key, value)
    case = hf_models.gpt2()
    with pytest.raises(UnsupportedTrainingArgumentError, match=match):
        OffloadTrainer(model=case.model, args=args, train_dataset=Rows(case, 2), offload_budget="1GiB")


def test_refuses_another_optimizer_and_needs_a_budget(tmp_path):
    case = hf_models.gpt2()
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedTrainingArgumentError, match="optimizers="):
        OffloadTrainer(model=case.model, args=_args(tmp_path), optimizers=(opt, None), offload_budget="1GiB")
    with pytest.raises(TypeError, match="offload_budget"):
        OffloadTrainer(model=case.model, args=_args(tmp_path))


@pytest.mark.slow
def test_example_hf_trainer(tmp_path, capsys):
    """examples/hf_trainer.py: trains, evaluates, checkpoints, writes its timeline, stays within its budget."""
    import hf_trainer  # examples/ is on sys.path (pyproject's pytest `pythonpath`)

    status = hf_trainer.main(["--steps", "6", "--eval-every", "3", "--output-dir", str(tmp_path / "out"),
                              "--timeline", str(tmp_path / "step.json"), "--device", "cpu"])
    assert status == 0, capsys.readouterr().out
    assert (tmp_path / "out" / "checkpoint-6" / "offload.pt").is_file()
    assert json.loads((tmp_path / "step.json").read_text())["traceEvents"]


def test_fp16_skipped_steps_do_not_advance_the_lr_schedule(tmp_path):
    """fp16 with an initial loss scale that overflows: the engine skips those steps, and the Trainer must not
    step the LR schedule for them (as with the plain Trainer's GradScaler)."""
    args = _args(tmp_path, fp16=True, max_steps=6)
    trainer, _ = _train(OffloadTrainer, hf_models.gpt2, args,
                        loss_scale=offload.LossScaleConfig(init_scale=2.0**20))
    skipped = trainer.engine.memory_stats()["optimizer"]["skipped_steps"]
    assert 0 < skipped < 6
    assert trainer.lr_scheduler.last_epoch == 6 - skipped


def test_engine_device_follows_the_trainer(tmp_path):
    """Without offload_config the engine runs where the Trainer puts the batches (use_cpu=True: the CPU backend,
    even with CUDA present)."""
    case = hf_models.gpt2()
    trainer = OffloadTrainer(model=case.model, args=_args(tmp_path), offload_budget="1GiB")
    assert trainer.engine.config.device == torch.device("cpu")
    trainer.engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refuses_a_config_on_another_device_than_the_batches(tmp_path):
    """use_cpu=True with OffloadConfig(device="cuda"): refused up front, not a device mismatch in the first forward."""
    case = hf_models.gpt2()
    with pytest.raises(UnsupportedTrainingArgumentError, match="make them agree"):
        OffloadTrainer(model=case.model, args=_args(tmp_path),
                       offload_config=offload.OffloadConfig(budget="1GiB", device="cuda"))
