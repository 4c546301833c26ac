"""Hostile inputs: each is rejected with an error that says what is wrong and what to do, and where the
engine was already running, it stays usable (training after the refusal matches plain PyTorch).

The README's Reliability section counts the kinds of hostile input here: one test (or parametrized
family) per kind, named test_hostile_<kind>.
"""

import copy
import gc

import pytest
import torch
from torch import nn

import offload
import offload.api
from offload.backend import CUDABackend
from offload.runtime.idle_params import IdleParameter
from tests.support.fake_cuda import FakeCuda

ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=0, atol=0)  # bit for bit: the engine runs offload.AdamW(fused=False), torch's arithmetic (tests/support/compare.py)


def _model(depth=6, width=32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _wrap(model, frac=0.6, **kw):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    return offload.wrap(model, opt, budget=int(frac * nbytes), bucket_bytes=nbytes // 10, device="cpu", **kw), opt


class Pair:
    """An engine and a plain-PyTorch reference trained on the same batches."""

    def __init__(self, model=None, frac=0.6):
        model = model if model is not None else _model()
        self.ref = copy.deepcopy(model)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), foreach=False, **ADAMW)
        self.model = model
        self.engine, self.opt = _wrap(model, frac)
        self.steps = 0

    def step(self):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(self.steps))
        self.engine(x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.ref(x).square().mean().backward()
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        self.steps += 1

    def check(self):
        got = self.engine.state_dict()["model"]
        for key, want in self.ref.state_dict().items():
            torch.testing.assert_close(got[key], want, **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("budget", [0, -5, float("nan"), "12 parsecs", "-1GiB", "0MiB", "", True])
def test_hostile_budget(budget):
    model = _model()
    with pytest.raises((ValueError, TypeError), match="budget"):
        offload.wrap(model, offload.AdamW(model.parameters()), budget=budget, device="cpu")
    assert all(p.device.type == "cpu" and not torch.isnan(p).any() for p in model.parameters())


def test_hostile_budget_larger_than_the_device(monkeypatch):
    model = _model()
    with pytest.raises(offload.OffloadError, match=r"larger than the device's memory .* budget=\""):
        offload.wrap(model, offload.AdamW(model.parameters()), budget="1000TiB", device="cpu")
    # the CUDA backend asks the device (here a simulated one reporting 80 GiB)
    monkeypatch.setattr(offload.api, "make_backend",
                        lambda device, chaos=None: CUDABackend(torch.device("cpu"), api=FakeCuda()))
    with pytest.raises(offload.OffloadError, match=r"larger than the device's memory \(80.00 GiB"):
        offload.wrap(model, offload.AdamW(model.parameters()), budget="81GiB")
    offload.wrap(model, offload.AdamW(model.parameters()), budget="79GiB").close()  # and below it is fine


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.complex64, "bfloat16"])
def test_hostile_dtype(dtype):
    model = _model()
    with pytest.raises((ValueError, TypeError), match="dtype"):
        offload.wrap(model, offload.AdamW(model.parameters()), budget="1MiB", dtype=dtype, device="cpu")
    double = _model().double()
    with pytest.raises(TypeError, match=r"torch.float32.*model.float\(\)"):
        offload.wrap(double, offload.AdamW(double.parameters()), budget="1MiB", device="cpu")


def test_hostile_parameters_on_mixed_devices():
    model = _model()
    model[3].weight = nn.Parameter(torch.zeros(32, 32, device="meta"))
    with pytest.raises(ValueError, match="must be on the CPU when wrapping .*meta"):
        offload.wrap(model, offload.AdamW(model.parameters()), budget="1MiB", device="cpu")


@pytest.mark.parametrize("change", ["replace-module", "replace-parameter", "add-parameter", "add-module", "delete"])
def test_hostile_parameter_replaced_or_added_after_wrapping(change):
    pair = Pair()
    pair.step()
    model = pair.model
    saved = {}
    if change == "replace-module":
        saved["m"] = model[2]
        model[2] = nn.Linear(32, 32)
        expect = "new: \\['2.weight', '2.bias'\\]"
    elif change == "replace-parameter":
        saved["p"] = model[1].weight
        model[1].weight = nn.Parameter(torch.zeros(32, 32))
        expect = "new: \\['1.weight'\\]"
    elif change == "add-parameter":
        model.register_parameter("scale", nn.Parameter(torch.ones(())))
        expect = "new: \\['scale'\\]"
    elif change == "add-module":
        model.append(nn.Linear(32, 32))
        expect = "new: \\['6.weight', '6.bias'\\]"
    else:
        saved["m"] = model[5]
        del model[5]
        expect = "no longer in the model: \\['5.weight', '5.bias'\\]"
    with pytest.raises(offload.OffloadError, match=f"parameters changed after wrapping.*{expect}.*close"):
        pair.engine(torch.randn(2, 32))
    # undo the change: the engine goes on as if nothing had happened
    if change == "replace-module":
        model[2] = saved["m"]
    elif change == "replace-parameter":
        model[1].weight = saved["p"]
    elif change == "add-parameter":
        del model._parameters["scale"]
    elif change == "add-module":
        del model[6]
    else:
        model.append(saved["m"])
    pair.step()
    pair.check()


def test_parameter_check_walks_the_model_only_after_a_change(monkeypatch):
    """[Note: the tree stamp] in guards.py: the start-of-forward check compares each module's parameter and
    submodule dicts with those it last accepted and walks ``model.parameters()`` only when they differ; a
    model whose class overrides the walk gets no stamp (walked every time)."""
    from offload.runtime.guards import _Tree

    pair = Pair()
    pair.step()
    model = pair.model
    with monkeypatch.context() as m:
        m.setattr(nn.Sequential, "parameters", lambda *a, **k: pytest.fail("walked an unchanged model"))
        pair.step()
    saved = model[1].weight
    model[1].weight = nn.Parameter(torch.zeros(32, 32))  # a change deep in the tree is still caught
    with pytest.raises(offload.OffloadError, match="parameters changed after wrapping"):
        pair.engine(torch.randn(2, 32))
    model[1].weight = saved
    pair.step()
    pair.check()

    class Own(nn.Sequential):
        def named_parameters(self, *args, **kwargs):
            return super().named_parameters(*args, **kwargs)

    assert _Tree.of(Own(nn.Linear(2, 2))) is None
    plain = nn.Sequential(nn.Linear(2, 2))
    assert _Tree.of(plain) is not None
    plain.parameters = lambda *a, **k: iter(())  # an instance's own walk too
    assert _Tree.of(plain) is None


def test_parameter_check_finds_where_parameters_point_again_only_after_a_slot_changed():
    """``ParamGuard._moved``: where each parameter should point follows from its bucket's slot, so it is
    computed again only when a slot changed (else one compare of address lists); a ``.data`` reassigned while
    it is kept is still caught, and undone."""
    pair = Pair(frac=3.0)  # every bucket resident: the same slots at every (fast) step's forward
    for _ in range(5):
        pair.step()
    guard = pair.engine._runtime.guard
    kept = guard._wants
    assert kept is not None and None not in kept[1]  # every bucket shown on the device
    for _ in range(2):
        pair.step()
        assert guard._wants is kept
    pair.model[2].bias.data = torch.zeros(32)
    with pytest.raises(offload.OffloadError, match="had .data reassigned: 2.bias"):
        pair.engine(torch.randn(2, 32))
    for _ in range(2):
        pair.step()
    pair.check()


@pytest.mark.parametrize("how", ["data-assignment", "no-grad-copy", "before-first-step"])
def test_hostile_data_assignment(how):
    """``p.data = t`` or an in-place write after wrapping would be silently lost (the engine's fp32 master is
    the weight): it is refused, and undone, at the next forward."""
    pair = Pair(frac=3.0 if how == "no-grad-copy" else 0.6)  # (3.0: every bucket stays on the device)
    if how != "before-first-step":
        pair.step()
    p = pair.model[0].weight
    if how == "no-grad-copy":
        # Right after step() the resident buckets' new weights are still being copied in: the parameters show
        # their placeholders ([Note: parameters show landed slots] in slots.py), idle: reads give the real
        # weights, writes raise at once ([Note: parameters between forwards]). A forward lands them.
        assert type(p) is IdleParameter and torch.equal(p.detach(), pair.model.state_dict()["0.weight"])
        pair.engine(torch.randn(2, 32))
        assert type(p) is torch.nn.Parameter  # on the device (an idle parameter would refuse the write itself)
        with torch.no_grad():
            p.add_(1.0)
        expect = "written in place"
    else:
        p.data = torch.zeros(32, 32)
        expect = "had .data reassigned: 0.weight"
    with pytest.raises(offload.OffloadError, match=f"{expect}.*undone.*load_state_dict"):
        pair.engine(torch.randn(2, 32))
    for _ in range(2):
        pair.step()
    pair.check()


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("frac", [0.6, 3.0], ids=["streamed", "resident"])
def test_data_assigned_between_backward_and_step_is_refused_at_step(frac, overlap):
    """``p.data = t`` after backward, before ``step()``: refused at ``step()`` (``ParamGuard.check_at_step``),
    undone, and training goes on as plain torch without the assignment. Before (session 24), all resident,
    ``step()``'s refresh rebound the parameter to its slot: the next forward's check saw nothing, and the
    assignment was dropped silently."""
    model = _model()
    pair = Pair(model, frac)
    if overlap:
        pair.engine.close()
        pair.engine, pair.opt = _wrap(pair.model, frac, overlap_optimizer=True)
    pair.step()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(99))
    pair.engine(x).square().mean().backward()
    pair.model[0].weight.data = torch.zeros(32, 32)
    with pytest.raises(offload.OffloadError, match="had .data reassigned: 0.weight.*undone.*load_state_dict"):
        pair.opt.step()
    pair.opt.step()  # refused before anything changed: the same step again, as the user would
    pair.opt.zero_grad()
    pair.ref(x).square().mean().backward()  # the reference, without the assignment
    pair.ref_opt.step()
    pair.ref_opt.zero_grad()
    for _ in range(2):
        pair.step()
    pair.check()


def _frozen_first_layer():
    model = _model()
    model[0].requires_grad_(False)
    return model


def test_unfreezing_a_parameter_frozen_at_wrap_is_refused_where_torch_would_train_it():
    """A parameter frozen when wrapped but in the optimizer, made trainable later: plain torch trains it; the
    engine has no optimizer state for it and left it as it was, silently (session 24). Now the next forward
    refuses, naming it and the way; frozen again, training goes on as torch's with it frozen."""
    model, ref = _frozen_first_layer(), _frozen_first_layer()
    engine, opt = _wrap(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
        m[0].requires_grad_(True)
    before = ref[0].weight.detach().clone()
    ref(x).square().mean().backward()
    ref_opt.step()
    assert not torch.equal(ref[0].weight, before)  # what torch does with it
    wrapped = model.state_dict()["0.weight"].clone()
    with pytest.raises(offload.OffloadError, match=r"parameter\(s\) 0\.weight, 0\.bias were frozen .* when the model "
                                                   r"was wrapped.*engine\.close\(\)"):
        model(x)
    model[0].requires_grad_(False)
    model(x).square().mean().backward()  # frozen again: trains on
    opt.step()
    assert torch.equal(engine.state_dict()["model"]["0.weight"], wrapped)
    engine.close()


def test_add_param_group_after_wrap_is_refused():
    """Groups added once bound would never be updated (progressive unfreezing trained nothing new, silently);
    before wrap it is torch's."""
    model = _frozen_first_layer()
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], fused=False, **ADAMW)
    opt.add_param_group({"params": [], "lr": 1e-4})  # unbound: torch's
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    engine = offload.wrap(model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu")
    model[0].requires_grad_(True)
    with pytest.raises(offload.OffloadError, match="add_param_group on an offload.AdamW bound to an engine"):
        opt.add_param_group({"params": list(model[0].parameters())})
    assert len(opt.param_groups) == 2
    engine.close()


def test_hostile_torch_compile():
    """torch.compile of the wrapped module is refused clearly (a compiled graph would not replay the
    engine's parameter movement); the engine is untouched and trains on."""
    pair = Pair()
    pair.step()
    compiled = torch.compile(pair.model, backend="eager")
    with pytest.raises(offload.OffloadError, match="torch.compile of a module wrapped by offload is not supported"):
        compiled(torch.randn(2, 32))
    pair.step()
    pair.check()


def test_hostile_step_without_backward():
    pair = Pair()
    with pytest.raises(offload.OffloadError, match=r"no backward ran since the last step\(\)"):
        pair.opt.step()  # before anything
    pair.step()
    pair.engine(torch.randn(2, 32)).sum()  # a forward, but no backward
    with pytest.raises(offload.OffloadError, match="no backward ran"):
        pair.engine.step()
    with pytest.raises(offload.OffloadError, match="no backward ran"):
        pair.opt.step()  # twice in a row
    pair.step()
    pair.check()


def test_hostile_two_engines_in_one_process():
    """Two engines train independently (no global state between them), interleaved step by step; wrapping a
    model that is already wrapped, or one sharing a parameter with it, is refused."""
    a, b = Pair(_model()), Pair(_model(depth=4), frac=1.0)
    for _ in range(3):
        a.step()
        b.step()
    a.check()
    b.check()
    with pytest.raises(RuntimeError, match="already wrapped"):
        offload.wrap(a.model, offload.AdamW(a.model.parameters()), budget="1MiB", device="cpu")
    sharing = nn.Sequential(nn.Linear(32, 32), b.model[1])
    with pytest.raises(RuntimeError, match="already wrapped"):
        offload.wrap(sharing, offload.AdamW(sharing.parameters()), budget="1MiB", device="cpu")
    with pytest.raises(RuntimeError, match="already bound"):
        offload.wrap(_model(), a.opt, budget="1MiB", device="cpu")
    a.engine.close()
    b.step()  # closing one leaves the other alone
    b.check()


def test_hostile_load_state_dict_with_wrong_shapes():
    pair = Pair()
    pair.step()
    state = pair.engine.state_dict()
    bad = {"model": dict(state["model"]), "optimizer": state["optimizer"]}
    bad["model"]["0.weight"] = torch.zeros(16, 32)
    bad["model"]["3.bias"] = torch.zeros(33)
    with pytest.raises(ValueError, match=r"0.weight: \(16, 32\) where the model has \(32, 32\); 3.bias"):
        pair.engine.load_state_dict(bad)
    opt_state = copy.deepcopy(state["optimizer"])
    opt_state["state"][2]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"optimizer state does not match.*state\[2\]\['exp_avg'\] has \(7,\)"):
        pair.engine.load_state_dict({"model": state["model"], "optimizer": opt_state})
    with pytest.raises(ValueError, match="optimizer state does not match"):
        pair.opt.load_state_dict(opt_state)
    missing = {"model": {k: v for k, v in state["model"].items() if k != "2.bias"}, "optimizer": state["optimizer"]}
    with pytest.raises(KeyError, match="missing \\['2.bias'\\]"):
        pair.engine.load_state_dict(missing)
    # nothing was written by the refused loads
    pair.step()
    pair.check()
    gc.collect()
