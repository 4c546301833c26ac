"""Issue 19: a wrapped model's parameters between forwards ([Note: parameters between forwards] in
offload/runtime/idle_params.py). Reads give the real weights (what the bucket shows once landed, equal to
``model.state_dict()`` in fp32), writes and reads autograd would record raise ``OffloadError``, and a plain
PyTorch loop that logs ``p.norm()`` and keeps an EMA of the weights gets plain PyTorch's numbers bit for bit.
Before, a streamed parameter read NaN there."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import offload
from offload.runtime import idle_params
from offload.runtime.idle_params import IdleParameter
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise
from tests.support.fake_cuda import simulated_gpu, with_chaos  # noqa: F401 (a fixture)
from tests.support.loops import PLAIN_ADAMW, finish_step, wrap_on_cpu

ADAMW = PLAIN_ADAMW
WIDTH = 32
BUDGETS = {"streamed": 0.6, "resident": 4.0}


def _net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(6)],
                             nn.Linear(WIDTH, 1))


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))


_wrap = wrap_on_cpu


def _step(model, opt, step):
    return finish_step(model(_x(step)).pow(2).mean(), opt)


def _idle(model):
    return [n for n, p in model.named_parameters() if type(p) is IdleParameter]


def _after_one_step():
    """A streamed engine and plain torch after one step each (equal losses), and the engine's first idle
    parameter: (ref, ref_opt, model, engine, opt, its name, the parameter)."""
    ref, model = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    assert _step(model, opt, 0) == _step(ref, ref_opt, 0)
    name = _idle(model)[0]
    return ref, ref_opt, model, engine, opt, name, dict(model.named_parameters())[name]


# -- reads ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", list(BUDGETS))
def test_reads_between_forwards_give_the_real_weights_never_nan_or_stale(budget):
    """Right after ``step()`` (chaos delays every copy by up to 20 ms, so refreshes are in flight), after a
    forward without backward, and after a backward: every parameter reads exactly ``model.state_dict()``'s fp32
    weights, through ``p.detach()``, ``p.data``, ``p.clone()``, ``p.norm()``, ``print(p)`` and as an argument
    of another tensor's op; and the streamed ones are idle (so the reads went through the handler)."""
    model = _net()
    with with_chaos(ChaosConfig(seed=1, max_delay_ms=20)):
        engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    params = dict(model.named_parameters())
    idle_seen = set()

    def check():
        sd = model.state_dict()
        idle_seen.update(_idle(model))
        for name, p in params.items():
            want = sd[name]
            assert isinstance(p, nn.Parameter) and p.shape == want.shape and p.dtype == torch.float32
            assert torch.equal(p.detach(), want), name
            assert torch.equal(p.data, want) and torch.equal(p.detach().cpu(), want)
            with torch.no_grad():
                assert torch.equal(p.clone(), want) and torch.equal(p.norm(), want.norm())
                assert torch.equal(p * 2, want * 2)
                assert torch.equal(torch.zeros_like(want).add_(p), want)  # p as another tensor's source
            assert repr(p) == "Parameter containing:\n" + repr(want.clone().requires_grad_(True))

    for step in range(3):
        _step(model, opt, step)
        check()  # right after step(): copies in flight
        model(_x(100 + step)).sum()  # a forward (no backward) lands what it uses
        check()
    assert idle_seen or budget == "resident"
    if budget == "streamed":
        assert len(idle_seen) >= 4
    engine.close()
    assert not _idle(model) and all(type(p) is nn.Parameter for p in model.parameters())


def test_a_plain_loop_logging_norms_and_keeping_an_ema_is_plain_torch_bit_for_bit():
    """The loop people write: log every weight's norm after each step and keep an EMA of the weights
    (``ema.lerp_(p.detach(), 0.1)`` under ``no_grad``). Losses, logged norms, EMA and weights are plain torch's,
    bit for bit, at a budget that streams most buckets. Before: the norms and the EMA were NaN."""
    ref, model = _net(), _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    ema_ref = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ema = {n: torch.zeros_like(v) for n, v in ema_ref.items()}
    for n, p in model.named_parameters():
        ema[n].copy_(p.detach())  # before the first forward: the original tensors
    for step in range(4):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
        with torch.no_grad():
            norms = {n: p.norm().item() for n, p in model.named_parameters()}
            norms_ref = {n: p.norm().item() for n, p in ref.named_parameters()}
            for n, p in model.named_parameters():
                ema[n].lerp_(p.detach(), 0.1)
            for n, p in ref.named_parameters():
                ema_ref[n].lerp_(p.detach(), 0.1)
        assert norms == norms_ref and _idle(model)
    assert_bitwise(ema, ema_ref, "EMA of the weights")
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
    engine.close()


def test_bf16_reads_are_what_the_landed_bucket_shows():
    """With bf16 compute a parameter is bf16 on the device: an idle one reads its fp32 master rounded to
    bf16, the value a landed bucket shows (the host's bf16 copy), and the same value once landed."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], dtype=torch.bfloat16, overlap_optimizer=False)
    _step(model, opt, 0)
    sd = model.state_dict()
    idle = _idle(model)
    assert idle
    params = dict(model.named_parameters())
    before = {}
    for name in idle:
        p = params[name]
        assert p.dtype == torch.bfloat16
        before[name] = p.detach().clone()
        assert torch.equal(before[name], sd[name].to(torch.bfloat16)), name
    # A forward lands every bucket in turn; a module pre-hook reads its weights while landed.
    shown = {}

    def hook(module, args, out):
        for n, p in module.named_parameters(recurse=False):
            assert type(p) is nn.Parameter  # landed
            shown[id(p)] = p.detach().clone()
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(_x(7))
    for h in handles:
        h.remove()
    for name in idle:
        assert torch.equal(shown[id(params[name])], before[name]), name
    engine.close()


# -- what raises ----------------------------------------------------------------------------------------------

def test_writes_to_an_idle_parameter_raise_and_change_nothing():
    """Every way to write a parameter between forwards raises ``OffloadError`` naming
    ``engine.load_state_dict`` and changes nothing; training goes on as plain torch's, bit for bit."""
    ref, ref_opt, model, engine, opt, name, p = _after_one_step()
    writes = {
        "mul_": lambda: p.mul_(0.5),
        "copy_": lambda: p.copy_(torch.zeros_like(p)),
        "nn.init": lambda: nn.init.zeros_(p),
        "setitem": lambda: p.__setitem__(0, 1.0),
        "iadd": lambda: p.__iadd__(1.0),
        "out=": lambda: torch.add(torch.ones_like(p), 1, out=p),
        "foreach": lambda: torch._foreach_mul_([p], 2.0),
    }
    for what, write in writes.items():
        with torch.no_grad(), pytest.raises(offload.OffloadError, match=rf"writes parameter {name}.*load_state_dict"):
            write()
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after refused writes")
    engine.close()


@pytest.mark.parametrize("alias", ["data.clamp_", "detach.zero_", "data.view.fill_", "getitem.mul_", "detach.copy_",
                                   "data.setitem", "cpu.add_", "foreach"])
def test_a_write_through_an_alias_raises_and_changes_nothing(alias):
    """``p.data.clamp_(-c, c)`` (WGAN-style clipping) writes the parameter in plain PyTorch; here ``p.data`` is a
    copy of an idle parameter's weights (a ``ParamCopy``, as are its views), so the write raises
    ``OffloadError`` naming the parameter at once. The engine goes on, the weights unchanged; a copy of the copy,
    and any other result, is the caller's own."""
    ref, ref_opt, model, engine, opt, name, p = _after_one_step()
    write = {"data.clamp_": lambda: p.data.clamp_(-0.01, 0.01), "detach.zero_": lambda: p.detach().zero_(),
             "data.view.fill_": lambda: p.data.view(-1)[:3].fill_(1.0), "getitem.mul_": lambda: p[0].mul_(2),
             "detach.copy_": lambda: p.detach().copy_(torch.zeros(p.shape)),
             "data.setitem": lambda: p.data.__setitem__(0, 1.0), "cpu.add_": lambda: p.cpu().add_(1),
             "foreach": lambda: torch._foreach_add_([p.data], 1.0)}[alias]
    with torch.no_grad(), pytest.raises(offload.OffloadError, match=rf"(copy of )?parameter {name}.*load_state_dict"):
        write()
    with torch.no_grad():
        mine = [p.detach().clone().mul_(2), p.data * 2, p.detach().sum()]  # the caller's own
        mine[0].add_(1)
        mine[1].add_(1)
    assert all(type(t) is torch.Tensor for t in mine) and type(p.data) is idle_params.ParamCopy
    leaf = p.detach()
    assert leaf.requires_grad_() is leaf  # a method that returns its tensor returns the same object
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), f"after a write through {alias}")
    engine.close()


def test_reads_give_ordinary_tensors_numpy_and_torch_save_work():
    """What a read gives behaves as an ordinary tensor: ``p.detach().numpy()``, ``torch.save(p.detach())`` (loads
    as a plain tensor) and ``print`` work (a read-only copy, tried first, refused the first two)."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    _step(model, opt, 0)
    name = _idle(model)[0]
    p = dict(model.named_parameters())[name]
    want = model.state_dict()[name]
    assert (p.detach().numpy() == want.numpy()).all()
    buf = io.BytesIO()
    torch.save({name: p.detach()}, buf)
    buf.seek(0)
    loaded = torch.load(buf)[name]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, want)
    assert repr(p.detach()) == repr(want)
    _step(model, opt, 1)
    engine.close()


def test_reads_autograd_would_record_raise_with_grad_mode_on():
    """``loss + (p ** 2).sum()`` after the forward would get no gradient for the L2 term (the copy is not
    in the graph): it raises ``OffloadError`` naming the ways. What records nothing reads (comparisons,
    ``.item()`` of a detached value, ``print``), and everything reads under ``no_grad``."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    _step(model, opt, 0)
    name = _idle(model)[0]
    p = dict(model.named_parameters())[name]
    for what, use in {"pow": lambda: (p ** 2).sum(), "norm": lambda: p.norm(), "matmul": lambda: _x(0) @ p.t(),
                      "F.linear": lambda: nn.functional.linear(_x(0), p),
                      "parameters_to_vector": lambda: nn.utils.parameters_to_vector(model.parameters())}.items():
        with pytest.raises(offload.OffloadError, match=rf"parameter {name}.*grad mode on.*torch\.no_grad\(\)"):
            use()
    want = model.state_dict()[name]
    assert bool((p == want).all()) and p.detach().norm().item() == want.norm().item() and not p.isnan().any()
    assert torch.equal(p.detach(), want) and "Parameter containing" in repr(p)
    with torch.no_grad():
        assert torch.equal(nn.utils.parameters_to_vector([p]), want.reshape(-1))
    frozen = nn.Parameter(torch.ones(1))  # not the engine's: untouched
    assert (frozen * 2).requires_grad
    engine.close()


# -- conversions, copies, state_dict -------------------------------------------------------------------------

def test_no_op_conversions_return_the_parameter_and_model_to_same_device_is_harmless():
    """``model.to("cpu")``, ``model.float()`` and ``p.to(p.device)`` are no-ops in plain PyTorch (the tensor
    itself): the parameter itself, so the next forward finds nothing reassigned and trains on, bit for bit.
    A real conversion converts the copy."""
    ref, ref_opt, model, engine, opt, name, p = _after_one_step()
    assert p.to("cpu") is p and p.to(torch.float32) is p and p.float() is p and p.cpu() is p
    assert p.to(torch.zeros(1)) is p and p.to("cpu", torch.float32) is p
    with torch.no_grad():
        wide = p.to(torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, model.state_dict()[name].double())
    model.to("cpu")
    model.float()
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after no-op conversions")
    engine.close()


def test_state_dict_makes_no_copy_per_parameter(monkeypatch):
    """``model.state_dict()`` detaches every parameter; idle ones pass through (its post-hook puts the fp32
    masters in) instead of a device copy each, which for a model larger than the device would not fit."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    _step(model, opt, 0)
    assert _idle(model)
    copies = []
    real = idle_params._copy_of
    monkeypatch.setattr(idle_params, "_copy_of", lambda *a: copies.append(a) or real(*a))
    sd = model.state_dict()
    sub = model[0].state_dict()
    assert copies == [] and engine._runtime.saving == 0
    assert torch.equal(sd["0.0.weight"], sub["0.weight"])
    next(iter(dict(model.named_parameters()).values())).detach().norm()  # outside state_dict: a copy
    assert len(copies) == 1 or not isinstance(model[0][0].weight, IdleParameter)
    engine.close()


def test_deepcopy_of_an_idle_parameter_is_a_plain_copy_and_pickling_raises():
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    _step(model, opt, 0)
    name = _idle(model)[0]
    p = dict(model.named_parameters())[name]
    q = copy.deepcopy(p)
    assert type(q) is nn.Parameter and q.requires_grad and torch.equal(q.detach(), model.state_dict()[name])
    q.data.mul_(2)  # the copy is the caller's own, writable
    with pytest.raises(offload.OffloadError, match=r"engine\.save\(path\)"):
        pickle.dumps(p)
    with pytest.raises(offload.OffloadError, match=r"state_dict"):
        torch.save(p, io.BytesIO())
    engine.close()
    assert type(p) is nn.Parameter
    torch.save(p, io.BytesIO())  # after close: an ordinary parameter


def test_overlapped_updates_refuse_reads_between_backward_and_step():
    """With ``overlap_optimizer=True`` each bucket's update runs during backward while resident buckets show
    the old weights until ``step()``: an idle read there raises (half old, half new otherwise); after
    ``step()`` every parameter reads ``model.state_dict()``."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=True)
    _step(model, opt, 0)
    model(_x(1)).pow(2).mean().backward()
    name = _idle(model)[0]
    p = dict(model.named_parameters())[name]
    with pytest.raises(offload.OffloadError, match=r"between backward\(\) and step\(\) with overlap_optimizer=True"):
        p.detach()
    opt.step()
    sd = model.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), sd[name]), name
    engine.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_training_steps_never_enter_the_handler(budget, monkeypatch):
    """The engine's own code reads idle parameters as plain ones (``engine_code``, the weak hooks, slot views
    built from the specs): a training step with streamed buckets calls the ``__torch_function__`` handler
    not once (each call would cost microseconds on the hot path). In forward the use detector, a mode, sees
    an idle parameter's op first and lands its bucket, so the op runs on a plain parameter."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    for step in range(2):
        _step(model, opt, step)
    calls = []
    real = idle_params._handle
    monkeypatch.setattr(idle_params, "_handle",
                        lambda func, args, kwargs: calls.append(func) or real(func, args, kwargs))
    for step in range(2, 5):
        _step(model, opt, step)
    assert calls == []
    assert _idle(model) or budget == "resident"
    engine.close()


class _ScaleByWeightSum(torch.autograd.Function):
    """A user's Function whose backward reads a module's weight directly (not saved for backward)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x * module.weight.sum()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.module.weight.sum(), None


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((WIDTH,), 0.03))

    def forward(self, x):
        return _ScaleByWeightSum.apply(x, self) + self.weight  # the weight also gets a grad of its own


def _scaled_net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), _Scaled(), nn.Tanh(),
                             *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(5)],
                             nn.Linear(WIDTH, 1))


def test_a_backward_that_reads_a_weight_directly_reads_its_real_value():
    """A custom ``autograd.Function`` whose backward reads ``module.weight`` (not a saved tensor) meets an idle
    parameter when the bucket is streamed: it reads the weights (as plain torch), so training is plain torch's
    bit for bit. Before, it read the placeholder: NaN gradients."""
    ref, model = _scaled_net(), _scaled_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine, opt = _wrap(model, 0.6, overlap_optimizer=False)
    seen = []
    real_backward = _ScaleByWeightSum.backward

    def backward(ctx, grad):
        seen.append(type(ctx.module.weight))
        return real_backward(ctx, grad)
    _ScaleByWeightSum.backward = staticmethod(backward)
    try:
        for step in range(4):
            assert _step(model, opt, step) == _step(ref, ref_opt, step)
    finally:
        _ScaleByWeightSum.backward = staticmethod(real_backward)
    assert IdleParameter in seen  # the case this test is about happened
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after a backward that reads a weight")
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_simulated_gpu_reads_and_ema_like_the_cpu_backend(simulated_gpu, dtype):
    """Through the CUDA backend's ordering rules (a host buffer a copy or an update is still using reads NaN
    there until its event): reads right after ``step()`` and an EMA of the weights give the CPU backend's
    numbers exactly, and no read meets NaN."""
    def train():
        model = _net()
        engine, opt = _wrap(model, BUDGETS["streamed"], dtype=dtype, overlap_optimizer=False)
        ema = {n: torch.zeros(p.shape, dtype=dtype) for n, p in model.named_parameters()}
        norms = []
        for step in range(3):
            _step(model, opt, step)
            with torch.no_grad():
                norms.append([p.norm().item() for p in model.parameters()])
                for n, p in model.named_parameters():
                    ema[n].lerp_(p.detach(), 0.5)
        idle = _idle(model)
        engine.close()
        return norms, ema, idle

    want = train()
    made = simulated_gpu()
    got = train()
    assert made and made[0]._api.copies > 0 and got[2]
    assert got[0] == want[0] and not any(x != x for row in got[0] for x in row)
    assert_bitwise(got[1], want[1], "EMA on the simulated GPU")


def test_ops_mixing_an_idle_parameter_and_a_copy_read_both_and_refuse_writes():
    """An op with both an idle parameter and a ``ParamCopy`` among its arguments: whichever class torch asks
    first, the parameter is read (never its placeholder) and a write to the copy raises."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    _step(model, opt, 0)
    names = _idle(model)
    params = dict(model.named_parameters())
    p, q = params[names[0]], params[names[2]]
    sd = model.state_dict()
    with torch.no_grad():
        for a, b in ((p.detach(), p), (p, p.detach())):  # the copy first, then the parameter first
            assert torch.equal(torch.sub(a, b), torch.zeros_like(sd[names[0]]))
        with pytest.raises(offload.OffloadError, match=rf"copy of parameter {names[2]}"):
            q.detach().copy_(p)
    engine.close()


class TaggedParameter(nn.Parameter):
    """A user's own parameter class (as libraries tag parameters for their optimizers)."""


class DispatchingParameter(nn.Parameter):
    """A user's parameter class with its own ``__torch_function__``: the engine leaves its class alone."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_users_parameter_subclass_is_idle_too_and_keeps_its_class():
    """A parameter of a user's ``nn.Parameter`` subclass becomes an ``IdleTaggedParameter`` (``isinstance``
    of both) while streamed: it reads its real weights, and gets its own class back when its bucket lands and
    at close; training is plain torch's bit for bit. One with its own ``__torch_function__`` keeps its class
    (it reads its placeholder outside a forward, as the README says)."""
    def tagged(model, cls):
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight = cls(m.weight.detach().clone())
        return model
    ref, model = _net(), tagged(_net(), TaggedParameter)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False)
    assert _step(model, opt, 0) == _step(ref, ref_opt, 0)
    sd = model.state_dict()
    idle = [(n, p) for n, p in model.named_parameters() if n.endswith("weight") and isinstance(p, IdleParameter)]
    assert idle
    for name, p in idle:
        assert isinstance(p, TaggedParameter) and type(p).__name__ == "IdleTaggedParameter"
        assert torch.equal(p.detach(), sd[name])
        q = copy.deepcopy(p)
        assert type(q) is TaggedParameter and torch.equal(q.detach(), sd[name])
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "user parameter subclass")
    engine.close()
    assert all(type(m.weight) is TaggedParameter for m in model.modules() if isinstance(m, nn.Linear))

    own = tagged(_net(), DispatchingParameter)
    engine, opt = _wrap(own, BUDGETS["streamed"], overlap_optimizer=False)
    _step(own, opt, 0)
    assert all(type(m.weight) is DispatchingParameter for m in own.modules() if isinstance(m, nn.Linear))
    engine.close()
