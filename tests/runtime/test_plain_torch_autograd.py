"""Plain PyTorch autograd patterns and parameter reads on a wrapped model (issue 19, the gaps left after
tests/runtime/test_plain_torch.py): each works as in plain PyTorch or raises an ``OffloadError`` naming the
supported way, never trains silently wrong.

* a user's own ``torch.utils.checkpoint.checkpoint`` inside the model: ``use_reentrant=True`` trains as plain
  torch (before: silently wrong, 3.9e-3 max weight difference from plain torch after 4 steps of the model
  below, all resident; streamed, it raised an error about reassigned ``.data``); ``use_reentrant=False`` is
  refused when its recompute begins, naming ``activation_checkpointing`` (before: torch's CheckpointError);
* a second backward through one forward's graph after ``optimizer.step()`` (before: its gradients were dropped
  silently and the next step applied nothing; plain torch raises a version-counter error there);
* a gradient penalty (``create_graph=True``) through blocks the engine checkpoints (before: silently wrong,
  streamed);
* ``copy.deepcopy`` of a wrapped module (before: a copy with NaN weights that still ran this engine's hooks);
* reading parameters outside forward gives NaN placeholders, never a plausible number; ``model.state_dict()``
  gives the real weights.
The gradient penalty with streamed buckets is in test_plain_torch.py (its existing test, now streamed too).
"""

import copy
import io
import pickle

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import offload
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise
from tests.support.fake_cuda import with_chaos
from tests.support.loops import PLAIN_ADAMW, finish_step, wrap_on_cpu
from tests.support.warnings_filters import DEPARTING

ADAMW = PLAIN_ADAMW
WIDTH = 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(torch.nn.Module):
    """Residual blocks; ``reentrant`` None runs them plainly, True/False through the user's own
    ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=...)``."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)  # so the checkpointed blocks' inputs require grad
        self.blocks = torch.nn.ModuleList([Block() for _ in range(6)])
        self.head = torch.nn.Linear(WIDTH, 1)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _net(reentrant=None) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net(reentrant)


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))


_wrap = wrap_on_cpu


def _step(model, opt, step):
    return finish_step(model(_x(step)).pow(2).mean(), opt)


BUDGETS = {"streamed": 0.6, "resident": 4.0}


# -- a user's own torch.utils.checkpoint ----------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_users_own_reentrant_checkpoint_is_plain_torch_bit_for_bit(budget, overlap):
    """``checkpoint(block, x, use_reentrant=True)`` in the model's forward: the recompute inside backward runs as a
    recompute of the engine's ([Note: a user's reentrant checkpoint] in recompute_hooks.py), planned from the
    second step on, within the budget, and every loss and weight is plain torch's (which runs the same
    checkpoint). Before, it began a new step inside the backward: 3.9e-3 off after 4 steps, silently."""
    model, ref = _net(reentrant=True), _net(reentrant=True)
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    for step in range(5):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "user's reentrant checkpoint")
    stats = engine.memory_stats()
    assert stats["counters"]["plan_departures"] == 0 and stats["device_peak_bytes"] <= stats["budget_bytes"]
    assert (stats["plan"]["streamed_buckets"] > 0) == (budget == "streamed")
    engine.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_users_own_non_reentrant_checkpoint_raises_naming_activation_checkpointing(budget):
    """``use_reentrant=False``: its recompute runs under checkpoint's own saved-tensor hooks (and may stop early),
    which the engine cannot follow: refused when it begins, naming the engine's option and use_reentrant=True
    (before: torch's CheckpointError). The failed step changed nothing, and training without the user's
    checkpoint then equals plain torch bit for bit."""
    model, ref = _net(reentrant=False), _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    with pytest.raises(offload.OffloadError, match=r"module 'blocks\.5'.*ran inside a backward.*use_reentrant=False"
                                                   r".*activation_checkpointing=\[\"blocks\.0\".*use_reentrant=True"):
        _step(model, opt, 0)
    with pytest.warns(offload.OffloadWarning, match="backward"):  # the fault is noticed at the next call
        opt.zero_grad()
    model.reentrant = None  # what the message says: no torch.utils.checkpoint in the model
    for step in range(3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after the refused step")
    engine.close()


def test_the_engines_checkpointing_of_the_same_blocks_is_torch_checkpoint_bit_for_bit():
    """What the error names: ``activation_checkpointing=[...]`` gives torch's non-reentrant checkpoint's
    numbers, streamed."""
    model, ref = _net(), _net(reentrant=False)
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=False,
                        activation_checkpointing=[f"blocks.{i}" for i in range(6)])
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    for step in range(4):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "engine checkpointing")
    assert engine.memory_stats()["activation_checkpointing"]["checkpointed"] == [f"blocks.{i}" for i in range(6)]
    engine.close()


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_gradient_penalty_through_the_engines_checkpointing_is_plain_torch_bit_for_bit(budget):
    """``torch.autograd.grad(..., create_graph=True)`` then backward, with every block checkpointed by the engine:
    the graph create_graph builds saves the weight views the recomputed blocks' nodes unpack, so those are handed
    out as copies too (streamed, they pointed into slots that later held other weights: 1.3e-2 off plain torch
    after 4 steps, silently)."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False,
                        activation_checkpointing=[f"blocks.{i}" for i in range(6)])
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            x = _x(step).requires_grad_(True)
            out = m(x).pow(2).mean()
            g, = torch.autograd.grad(out, x, create_graph=True)
            (out + (g.norm() - 1) ** 2).backward()
            o.step()
            o.zero_grad()
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "gradient penalty, checkpointed")
    engine.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_weight_copies_for_create_graph_are_counted_until_their_graph_frees_them(budget):
    """The weight copies a ``create_graph=True`` backward's graph holds are device memory: counted in
    ``memory_stats()`` (``device_parts["graph_copies"]``, the device peak) from the unpack that makes them until
    the second backward frees them (before: not counted at all). Here every Linear's input grad reads its
    weight: one copy of each weight matrix, exactly."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    _step(model, opt, 0)

    def copies():
        return engine.memory_stats()["device_parts"]["graph_copies"]

    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    x = _x(1).requires_grad_(True)
    out = model(x).pow(2).mean()
    assert copies() == 0
    g, = torch.autograd.grad(out, x, create_graph=True)
    assert copies() == weights
    assert engine.memory_stats()["device_peak_bytes"] >= weights
    (out + (g.norm() - 1) ** 2).backward()
    assert copies() == 0  # the second backward freed its graph
    opt.step()
    opt.zero_grad()
    _step(model, opt, 2)
    assert copies() == 0
    engine.close()


# -- a second backward through one forward's graph ----------------------------------------------------------

STALE = r"graph of a forward that ran before its weights changed \(optimizer\.step\(\).*forward again before each"


def _between(how: str, model, opt) -> None:
    """What runs between step() and the backward through the older graph."""
    if how == "eval forward":  # e.g. a validation batch
        with torch.no_grad():
            model(_x(7))
    elif how == "training step":  # a loss kept from an earlier step
        _step(model, opt, 7)


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("how", ["nothing", "eval forward", "training step"])
def test_a_backward_through_a_graph_from_before_step_raises_as_torch_does(how, budget, overlap):
    """[Note: stale graphs] (slots.py): torch raises (the step changed weights the graph saved); offload, with an
    eval forward or a training step between, read the new weights and gathered the grads silently; with nothing
    between it raised one of two unrelated errors, whichever check a race reached first (a flaky test). Now
    refused as torch refuses it, every time; after it the engine trains on equal to plain torch bit for bit."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    losses = []
    for m, o in ((model, opt), (ref, ref_opt)):
        loss = m(_x(0)).pow(2).mean()
        loss.backward(retain_graph=True)
        o.step()
        o.zero_grad()
        _between(how, m, o)
        losses.append(loss)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses[1].backward()  # plain torch
    with pytest.raises(offload.OffloadError, match=STALE):
        losses[0].backward()
    del losses
    with pytest.warns(offload.OffloadWarning, match="backward"):  # the fault is noticed at the next call
        opt.zero_grad()
    ref_opt.zero_grad()
    for step in range(1, 3):
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), f"after the refused backward ({how})")
    engine.close()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_backward_after_a_state_dict_was_loaded_into_its_graphs_weights_raises_as_torch_does(budget):
    """load_state_dict between a forward and its backward changes the weights the graph saved: torch refuses the
    backward (the copy bumped the weights' versions), and so does the engine ([Note: stale graphs])."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    _step(model, opt, 0)  # planned from here on
    saved = engine.state_dict()
    loss, ref_loss = model(_x(1)).pow(2).mean(), ref(_x(1)).pow(2).mean()
    engine.load_state_dict(saved)
    ref.load_state_dict(ref.state_dict())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref_loss.backward()
    with pytest.raises(offload.OffloadError, match=STALE):
        loss.backward()
    del loss
    with pytest.warns(offload.OffloadWarning, match="backward"):
        _step(model, opt, 2)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_a_second_backward_of_a_retained_graph_without_step_names_the_fix(overlap):
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"], overlap_optimizer=overlap)
    loss = model(_x(0)).pow(2).mean()
    loss.backward(retain_graph=True)
    with pytest.raises(offload.OffloadError, match="backward"):
        loss.backward()
    engine.close()


# -- parameter values outside forward -------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["model", "submodule"])
def test_deepcopy_of_a_wrapped_module_raises_naming_state_dict(what):
    """``ema = copy.deepcopy(model)`` would copy NaN placeholders and this engine's hooks: refused, naming
    ``model.state_dict()``; the copy made from it as the message says, and one after ``close()``, hold the
    trained weights."""
    model = _net()
    engine, opt = _wrap(model, BUDGETS["streamed"])
    _step(model, opt, 0)
    target = model if what == "model" else model.blocks[2]
    with pytest.raises(offload.OffloadError, match=r"copy\.deepcopy.*load_state_dict\(model\.state_dict\(\)\)"):
        copy.deepcopy(target)
    fresh = _net() if what == "model" else Block()
    fresh.load_state_dict(target.state_dict())  # the supported way
    trained = engine.state_dict()["model"]
    prefix = "" if what == "model" else "blocks.2."
    assert_bitwise(fresh.state_dict(), {k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)},
                   "copied through state_dict")
    _step(model, opt, 1)  # the refused copy changed nothing
    engine.close()
    closed = copy.deepcopy(target)  # after close the module is plain again
    assert all(torch.isfinite(p).all() for p in closed.parameters())


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("what", ["model", "submodule"])
def test_pickling_a_wrapped_module_raises_naming_engine_save(what, how):
    """``torch.save(model)`` (pickling the module) gives the engine's error naming ``engine.save`` and
    ``model.state_dict()``, before and after the first step, and changes nothing (before: pickle's "Can't pickle
    local object 'Runtime._post_hook.<locals>.hook'"). After ``close()`` the module pickles as a plain one."""
    model, ref = _net(), _net()
    engine, opt = _wrap(model, BUDGETS["streamed"])
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    target = model if what == "model" else model.blocks[2]

    def save():
        if how == "torch.save":
            torch.save(target, io.BytesIO())
        else:
            pickle.dumps(target)

    for step in range(3):
        with pytest.raises(offload.OffloadError, match=r"torch\.save\(model\).*engine\.save\(path\) or "
                                                       r"torch\.save\(model\.state_dict\(\), path\)"):
            save()
        assert _step(model, opt, step) == _step(ref, ref_opt, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after refused pickling")
    engine.close()
    save()


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_reading_parameters_outside_forward_gives_real_values_never_stale(budget):
    """Outside forward a parameter shows its bucket's slot only once the bucket landed there; otherwise it is
    idle ([Note: parameters between forwards] in idle_params.py) and reads a copy of its current weights. Either
    way it reads its real value (fp32 here, equal to ``model.state_dict()``), never another bucket's bytes or the
    weights before the step. Chaos delays every copy by up to 20 ms, so a read right after ``step()`` meets
    copies in flight: before [Note: parameters show landed slots] (slots.py) the resident buckets read their
    pre-step weights there, and before the idle parameters the streamed ones read NaN."""
    model = _net()
    with with_chaos(ChaosConfig(seed=1, max_delay_ms=20)):
        engine, opt = _wrap(model, BUDGETS[budget], overlap_optimizer=False)
    params = dict(model.named_parameters())
    seen = {"idle": 0, "landed": 0}

    def check():
        sd = model.state_dict()  # the real fp32 weights (waits for nothing the parameters show)
        named = dict(model.named_parameters())  # read afresh: the same objects, the same values
        for name, p in params.items():
            assert named[name] is p
            seen["idle" if type(p) is not torch.nn.Parameter else "landed"] += 1
            value = p.detach().clone()
            assert torch.equal(p.data, value) and torch.equal(value, sd[name]), name

    for step in range(3):
        _step(model, opt, step)
        check()  # right after step(): copies in flight
        model(_x(100 + step)).sum()  # a forward (no backward) lands what it uses
        check()
    assert seen["idle"] and (seen["landed"] or budget == "streamed")
    engine.close()
