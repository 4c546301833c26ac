"""A user's saved-tensor hooks on a wrapped model (issue 19; offload/runtime/saved_hooks.py, [Note: a user's
saved-tensor hooks]): around the call they apply as in plain PyTorch (bit for bit, also hooks that change
values); inside the forward they are refused before any wrong result; ``disable_saved_tensors_hooks`` is
refused loudly, and the engine goes on after each refusal.

Before: hooks around the call were skipped (the engine's sat on top: ``save_on_cpu`` did nothing, a lossy
pack hook's rounding was missing, so the numbers differed from plain PyTorch); hooks inside the forward
trained silently wrong (``save_on_cpu``: 1.6e-2 off plain PyTorch after 4 steps on the CPU backend);
``disable_saved_tensors_hooks`` around the call raised torch's RuntimeError halfway through the engine's
start of the forward.
"""

import contextlib

import pytest
import torch
from torch.autograd.graph import disable_saved_tensors_hooks, save_on_cpu, saved_tensors_hooks

import offload
from tests.support.compare import assert_bitwise

ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
WIDTH = 64
BUDGETS = {"streamed": 0.6, "resident": 4.0}


class Net(torch.nn.Module):
    """Linear layers with a residual; ``inside`` (a context factory or None) wraps the middle layers' calls
    in the model's own forward."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(6)])
        self.head = torch.nn.Linear(WIDTH, 1)
        self.inside = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            ctx = self.inside() if self.inside is not None and i in (2, 3) else contextlib.nullcontext()
            with ctx:
                x = x + torch.tanh(layer(x))
        return self.head(x)


def _net() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))


def _wrap(model, budget, **kw):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=int(BUDGETS[budget] * nbytes), bucket_bytes=nbytes // 8,
                          device="cpu", **{"overlap_optimizer": False, **kw})
    return engine, opt


def _step(model, opt, step, around=contextlib.nullcontext):
    with around():
        loss = model(_x(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


class Lossy:
    """Saved-tensor hooks that store every saved tensor rounded to bf16 (a user's activation compression):
    they change the numbers, so skipping them shows."""

    def __init__(self):
        self.packed = 0

    def __call__(self):
        def pack(t):
            self.packed += 1
            return t.dtype, t.to(torch.bfloat16)

        def unpack(saved):
            dtype, t = saved
            return t.to(dtype)
        return saved_tensors_hooks(pack, unpack)


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_lossy_hooks_around_the_call_are_plain_torch_bit_for_bit(budget, overlap):
    """The user's pack and unpack apply to every saved tensor, weights included, as in plain PyTorch."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, budget, overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    ours, theirs = Lossy(), Lossy()
    for step in range(4):
        assert _step(model, opt, step, ours) == _step(ref, ref_opt, step, theirs), step
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "lossy hooks around the call")
    assert ours.packed >= theirs.packed > 0  # activations in forward; weight views packed in backward
    plain = _net()  # the hooks do change the numbers: without them the weights differ
    plain_opt = torch.optim.AdamW(plain.parameters(), foreach=False, **ADAMW)
    for step in range(4):
        _step(plain, plain_opt, step)
    assert not torch.equal(plain.layers[0].weight, ref.layers[0].weight)
    engine.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_save_on_cpu_around_the_call_is_plain_torch_and_moves_activations(budget):
    model, ref = _net(), _net()
    engine, opt = _wrap(model, budget)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    for step in range(4):
        assert _step(model, opt, step, save_on_cpu) == _step(ref, ref_opt, step, save_on_cpu), step
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "save_on_cpu around the call")
    # The activations went to save_on_cpu's hooks, not to the engine's device accounting
    x = torch.randn(5, WIDTH)  # another shape: not a fast step (which does not count activations)
    out = model(x).sum()  # no hooks around: its activations are the engine's
    assert engine.memory_stats()["device_parts"]["activations"] > 0
    del out
    with save_on_cpu():
        out = model(x).sum()
    assert engine.memory_stats()["device_parts"]["activations"] == 0
    del out
    engine.close()


def test_nested_hooks_around_the_call_apply_the_innermost_as_torch():
    model, ref = _net(), _net()
    engine, opt = _wrap(model, "streamed")
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    hooks = {side: (Lossy(), Lossy()) for side in ("ours", "theirs")}  # (outer, inner) each

    def nested(side):
        outer, inner = hooks[side]

        @contextlib.contextmanager
        def both():
            with outer(), inner():
                yield
        return both

    for step in range(3):
        assert _step(model, opt, step, nested("ours")) == _step(ref, ref_opt, step, nested("theirs"))
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "nested hooks")
    for outer, inner in hooks.values():  # only the innermost apply, as in torch
        assert outer.packed == 0 and inner.packed > 0
    engine.close()


@pytest.mark.parametrize("inside", ["save_on_cpu", "lossy", "nested"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_hooks_inside_the_forward_are_refused_before_any_wrong_result(budget, inside):
    """In the model's code the hooks sit above the engine's: refused when an op under them reads a weight,
    naming the way that works (the same hooks around the call); that way then trains as plain torch."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, budget)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    _step(model, opt, 0)
    _step(ref, ref_opt, 0)
    if inside == "nested":
        @contextlib.contextmanager
        def hooks():
            with save_on_cpu(), Lossy()():
                yield
        model.inside = hooks
    else:
        model.inside = save_on_cpu if inside == "save_on_cpu" else Lossy()
    with pytest.warns(offload.OffloadWarning, match="the forward raised.*Discarded"), \
            pytest.raises(offload.OffloadError, match=r"saved-tensor hooks were entered inside the forward.*"
                                                      r"around the call instead \(with save_on_cpu\(\): loss = model"):
        _step(model, opt, 1)
    model.inside = None
    for step in range(1, 4):
        assert _step(model, opt, step, save_on_cpu) == _step(ref, ref_opt, step, save_on_cpu), step
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after the refused step")
    engine.close()


def test_hooks_inside_the_first_forward_are_refused_too():
    model = _net()
    model.inside = save_on_cpu
    engine, opt = _wrap(model, "streamed")
    with pytest.warns(offload.OffloadWarning, match="traced again"), \
            pytest.raises(offload.OffloadError, match="inside the forward"):
        _step(model, opt, 0)
    model.inside = None
    _step(model, opt, 0)
    engine.close()


def test_hooks_inside_a_no_grad_forward_are_harmless():
    """Nothing is saved without grad: the forward runs (as plain torch)."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, "streamed")
    _step(model, opt, 0)
    model.inside = ref.inside = save_on_cpu
    with torch.no_grad():
        got = model(_x(5))
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    ref.inside = None
    _step(ref, ref_opt, 0)
    ref.inside = save_on_cpu
    with torch.no_grad():
        assert torch.equal(got, ref(_x(5)))
    engine.close()


def test_disable_saved_tensors_hooks_around_the_call_is_refused_and_the_engine_goes_on():
    model, ref = _net(), _net()
    engine, opt = _wrap(model, "streamed")
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    assert _step(model, opt, 0) == _step(ref, ref_opt, 0)
    with pytest.raises(offload.OffloadError, match=r"disable_saved_tensors_hooks\('my feature'\).*outside"):
        _step(model, opt, 1, lambda: disable_saved_tensors_hooks("my feature"))
    assert not torch.is_autocast_enabled()  # nothing of the engine's forward was left entered
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after the refused forward")
    engine.close()


def test_disable_saved_tensors_hooks_inside_the_forward_raises_and_the_engine_goes_on():
    """torch refuses to enter it while any saved-tensor hooks are active (the engine's are, in its forward):
    its own RuntimeError with the user's message, before anything is saved; the engine goes on."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, "streamed")
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    model.inside = lambda: disable_saved_tensors_hooks("my feature")
    with pytest.warns(offload.OffloadWarning, match="the forward raised RuntimeError: my feature"), \
            pytest.raises(RuntimeError, match="my feature"):
        _step(model, opt, 0)
    model.inside = None
    for step in range(3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after the refused forward")
    engine.close()
