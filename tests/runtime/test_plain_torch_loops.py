"""A user's existing PyTorch training loop, unchanged, on a wrapped model (session 25, the loop audit): LR
schedulers, torch.amp.GradScaler, checkpoints moved between torch and offload, torch.optim.AdamW's keywords and
param groups, gradients the user makes, EMAs of the weights. Each trains as plain PyTorch, bit for bit (fp32,
``offload.AdamW(fused=False)`` against ``torch.optim.AdamW(foreach=False)``), or is refused by an ``OffloadError``
naming the supported way.

Loops run all resident (10x the weights: fast steps) and streamed (0.6x), with ``overlap_optimizer`` False and True
where the loop allows it: all four for the loops whose numbers depend on when hyperparameters, grads and state are
read, two (``TWO``: resident-deferred, streamed-overlapped) for the rest. The model is the loop audit's small MLP:
six 64-wide tanh blocks and a head, so a case takes a fraction of a second.

What failed before session 25 (each checked by running its tests with the fix reverted; mutations R75-R80 in
tests/MUTATIONS.md): ``p.grad.data = t`` (``torch.nn.utils.vector_to_parameters`` on grads) was dropped silently; a
penalty computed from ``p.grad`` after ``backward(create_graph=True)`` got no gradient, silently; a param group's
``amsgrad``, ``maximize``, ``capturable`` or ``differentiable`` (set by hand or brought by a torch checkpoint) was
ignored silently, as was a parameter taken out of a group's ``params`` and a state_dict loaded without some
parameters' state (the engine kept its own); torch.optim.AdamW's keywords (``amsgrad=False``, ``foreach=False``,
...) raised a ``TypeError``; ``engine.step()`` skipped the optimizer's step hooks and made schedulers warn."""

import copy
import io
import math

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadError
from tests.support.compare import assert_bitwise
from tests.support.loops import PLAIN_ADAMW

W = 64
BUDGETS = {"resident": 10.0, "streamed": 0.6}
LOOPS = [pytest.param(b, ov, id=f"{name}-{'overlapped' if ov else 'deferred'}")
         for name, b in BUDGETS.items() for ov in (False, True)]
DEFERRED = [pytest.param(b, id=name) for name, b in BUDGETS.items()]
# two of LOOPS that between them cover both budgets and both update modes: for loops whose numbers cannot depend
# on the mode in a way the others here do not already check
TWO = [loop for loop in LOOPS if loop.id in ("resident-deferred", "streamed-overlapped")]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(6)], nn.Linear(W, 1))


def _x(i: int) -> torch.Tensor:
    return torch.randn(8, W, generator=torch.Generator().manual_seed(i))


def _loss(model, i: int) -> torch.Tensor:
    return model(_x(i)).pow(2).mean()


def _wrap(model, budget: float, overlap: bool = False, groups=None, **opt_kw):
    """``model`` wrapped on the CPU backend with ``offload.AdamW(fused=False)`` at ``budget`` times its fp32 weights."""
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters() if groups is None else groups(model), fused=False,
                        **(PLAIN_ADAMW | opt_kw))
    engine = offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                          overlap_optimizer=overlap)
    return engine, opt


def _torch(groups=None, **opt_kw):
    ref = _net()
    return ref, torch.optim.AdamW(ref.parameters() if groups is None else groups(ref), foreach=False,
                                  **(PLAIN_ADAMW | opt_kw))


def _same_weights(engine, ref, what: str = "") -> None:
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), what)


def _side_by_side(step, budget, overlap, steps=5, setup=None, groups=None, **opt_kw):
    """``step(i, model, opt, ctx)`` run on the wrapped model and on plain torch (``ctx["engine"]``: the engine, or
    None); the values it returns and the final weights must be equal."""
    model = _net()
    engine, opt = _wrap(model, budget, overlap, groups, **opt_kw)
    ref, ref_opt = _torch(groups, **opt_kw)
    try:
        results = []
        for m, o in ((model, opt), (ref, ref_opt)):
            ctx: dict = {"engine": engine if m is model else None}
            if setup is not None:
                setup(m, o, ctx)
            results.append([step(i, m, o, ctx) for i in range(steps)])
        assert results[0] == results[1]
        _same_weights(engine, ref)
    finally:
        engine.close()


def _plain_step(i, m, o) -> float:
    loss = _loss(m, i)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.item()


def _train_on_like_torch(engine, model, opt, ref, ref_opt, got: list, want: list) -> None:
    """Steps 2 and 3 on both after a refusal: the losses so far and after, and the weights, are torch's."""
    for i in (2, 3):
        got.append(_plain_step(i, model, opt))
        want.append(_plain_step(i, ref, ref_opt))
    assert got == want
    _same_weights(engine, ref)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


# -- LR schedulers -----------------------------------------------------------------------------------------------

S = torch.optim.lr_scheduler
SCHEDULERS = {
    "OneCycleLR-momentum": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=10, cycle_momentum=True),  # writes betas
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2),
    "LambdaLR-warmup": lambda o: S.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3)),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, 2), S.ExponentialLR(o, 0.9)], milestones=[2]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 3), S.ExponentialLR(o, 0.9)]),
    "CyclicLR": lambda o: S.CyclicLR(o, 1e-4, 1e-2, step_size_up=2, cycle_momentum=False),
    "PolynomialLR": lambda o: S.PolynomialLR(o, 5, 2.0),
}


# OneCycleLR (it writes betas every step) in every mode; the others in two, which between them cover both budgets
# and both update modes (their lr is read at the same points as OneCycleLR's)
# (the other kinds only under -m slow: the file's default run stays near 40 s on 2 idle cores)
SCHEDULER_LOOPS = [pytest.param(kind, *loop.values, id=f"{kind}-{loop.id}",
                                marks=() if kind == "OneCycleLR-momentum" else pytest.mark.slow)
                   for kind in SCHEDULERS for loop in (LOOPS if kind == "OneCycleLR-momentum" else TWO)]


@pytest.mark.parametrize("kind, budget, overlap", SCHEDULER_LOOPS)
def test_lr_schedulers_train_like_torch(kind, budget, overlap):
    def setup(m, o, ctx):
        ctx["sched"] = SCHEDULERS[kind](o)

    def step(i, m, o, ctx):
        loss = _plain_step(i, m, o)
        ctx["sched"].step()
        return loss, ctx["sched"].get_last_lr(), [tuple(g["betas"]) for g in o.param_groups]

    _side_by_side(step, budget, overlap, setup=setup)


@pytest.mark.parametrize("budget, overlap", TWO)
def test_reduce_lr_on_plateau_trains_like_torch(budget, overlap):
    def setup(m, o, ctx):
        ctx["sched"] = S.ReduceLROnPlateau(o, patience=0, factor=0.5)

    def step(i, m, o, ctx):
        loss = _plain_step(i, m, o)
        ctx["sched"].step(loss if i % 2 else 10.0)
        return loss, ctx["sched"].get_last_lr()

    _side_by_side(step, budget, overlap, setup=setup)


@pytest.mark.parametrize("budget, overlap", LOOPS)
def test_a_scheduler_made_before_wrap_and_its_state_resumed_train_like_torch(budget, overlap):
    """OneCycleLR built on the optimizer before ``wrap``; its state_dict checkpointed beside the engine's and
    loaded into a fresh engine's new scheduler: the continued run is the uninterrupted torch run (betas too)."""
    ref, ref_opt = _torch()
    ref_sched = S.OneCycleLR(ref_opt, max_lr=1e-2, total_steps=10)
    want = []
    for i in range(6):
        want.append(_plain_step(i, ref, ref_opt))
        ref_sched.step()
    got = []
    model = _net()
    opt = offload.AdamW(model.parameters(), fused=False, **PLAIN_ADAMW)
    sched = S.OneCycleLR(opt, max_lr=1e-2, total_steps=10)  # before wrap
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    engine = offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                          overlap_optimizer=overlap)
    for i in range(3):
        got.append(_plain_step(i, model, opt))
        sched.step()
    ckpt = _roundtrip({"engine": engine.state_dict(), "sched": sched.state_dict()})
    engine.close()
    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    sched = S.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    engine.load_state_dict(ckpt["engine"])
    sched.load_state_dict(ckpt["sched"])
    try:
        for i in range(3, 6):
            got.append(_plain_step(i, model, opt))
            sched.step()
        assert got == want
        assert sched.get_last_lr() == ref_sched.get_last_lr()
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        _same_weights(engine, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("budget, overlap", TWO)
def test_engine_step_is_the_optimizers_step_for_its_hooks_and_schedulers(budget, overlap):
    """``engine.step()`` runs the optimizer's step pre- and post-hooks and counts as the optimizer's step for a
    scheduler, as ``opt.step()`` does. Before session 25 the hooks did not run and the scheduler warned "Detected
    call of `lr_scheduler.step()` before `optimizer.step()`" (an error here: warnings are errors in the tests)."""
    calls = []

    def setup(m, o, ctx):
        o.register_step_pre_hook(lambda *_: calls.append("pre"))
        o.register_step_post_hook(lambda *_: calls.append("post"))
        ctx["sched"] = S.StepLR(o, 2, 0.5)

    def step(i, m, o, ctx):
        loss = _loss(m, i)
        engine = ctx["engine"]
        if engine is not None:
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        else:
            loss.backward()
            o.step()
            o.zero_grad()
        ctx["sched"].step()
        return loss.item(), ctx["sched"].get_last_lr()

    _side_by_side(step, budget, overlap, setup=setup)
    assert calls == ["pre", "post"] * 10


# -- torch.amp.GradScaler ------------------------------------------------------------------------------------------

def _scaler_step(clip: bool):
    def setup(m, o, ctx):
        ctx["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=ctx.get("enabled", True))

    def step(i, m, o, ctx):
        scaler = ctx["scaler"]
        loss = _loss(m, i)
        scaler.scale(loss).backward()
        scaler.unscale_(o)
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item() if clip else None
        scaler.step(o)
        scaler.update()
        o.zero_grad()
        return loss.item(), norm, scaler.get_scale()
    return setup, step


@pytest.mark.parametrize("budget", DEFERRED)
@pytest.mark.parametrize("clip", [False, True], ids=["unscale", "unscale-clip"])
def test_grad_scaler_on_top_of_the_engine_trains_like_torch(clip, budget):
    """The AMP recipe (scale, backward, unscale_, clip_grad_norm_, step, update) in fp32 with
    overlap_optimizer=False: p.grad is the scaled sum until unscale_ divides it, as in torch."""
    setup, step = _scaler_step(clip)
    _side_by_side(step, budget, False, setup=setup)


@pytest.mark.parametrize("budget", DEFERRED)
def test_grad_scaler_changes_nothing_with_bf16_compute(budget):
    """With bf16 compute (deferred), the scaler's powers of two scale and unscale exactly: the engine trains as
    without it, bit for bit (the engine has no float16 scaling of its own here)."""
    _, step = _scaler_step(True)
    runs = []
    for enabled in (False, True):
        model = _net()
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        opt = offload.AdamW(model.parameters(), fused=False, **PLAIN_ADAMW)
        engine = offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                              dtype=torch.bfloat16, overlap_optimizer=False)
        ctx = {"scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, enabled=enabled)}
        try:
            runs.append(([step(i, model, opt, ctx)[:2] for i in range(4)], engine.state_dict()["model"]))
        finally:
            engine.close()
    assert runs[0][0] == runs[1][0]
    assert_bitwise(runs[1][1], runs[0][1])


@pytest.mark.parametrize("budget", DEFERRED)
def test_grad_scaler_with_overlapped_updates_is_refused(budget):
    """Overlapped updates ran on the scaled grads during backward: unscale_ (or scaler.step) raises, naming
    overlap_optimizer=False, never returns as if it had unscaled them."""
    model = _net()
    engine, opt = _wrap(model, budget, overlap=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    try:
        scaler.scale(_loss(model, 0)).backward()
        with pytest.raises(OffloadError, match="overlap_optimizer=False"):
            scaler.unscale_(opt)
    finally:
        engine.close()


# -- checkpoints moved between torch and offload --------------------------------------------------------------------

def _torch_run(steps):
    ref, ref_opt = _torch()
    return [_plain_step(i, ref, ref_opt) for i in range(steps)], ref, ref_opt


@pytest.mark.parametrize("path, budget, overlap", [
    pytest.param(path, *loop.values, id=f"{path}-{loop.id}")
    for path in ("offload-to-fresh-engine", "torch-to-offload", "torch-to-engine.load_state_dict", "offload-to-torch")
    for loop in (LOOPS if path in ("offload-to-fresh-engine", "torch-to-offload") else TWO)])
def test_a_checkpoint_continues_like_the_uninterrupted_torch_run(path, budget, overlap):
    """Three steps, ``torch.save({"model": model.state_dict(), "opt": opt.state_dict()})``, then three more in
    another loop: offload into a fresh engine, a plain torch AdamW checkpoint into offload (a user migrating), or
    offload's checkpoint into a plain torch loop."""
    want, ref, _ = _torch_run(6)
    if path.startswith("torch"):
        first, first_model, first_opt = _torch_run(3)
        ckpt = _roundtrip({"model": first_model.state_dict(), "opt": first_opt.state_dict()})
    else:
        model = _net()
        engine, opt = _wrap(model, budget, overlap)
        first = [_plain_step(i, model, opt) for i in range(3)]
        ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        engine.close()
    if path == "offload-to-torch":
        model, opt = _torch()
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        assert first + [_plain_step(i, model, opt) for i in range(3, 6)] == want
        assert_bitwise(model.state_dict(), ref.state_dict())
        return
    model = _net()
    if path != "torch-to-engine.load_state_dict":
        model.load_state_dict(ckpt["model"])  # before the first forward: plain torch's
    engine, opt = _wrap(model, budget, overlap)
    try:
        if path == "torch-to-engine.load_state_dict":
            engine.load_state_dict({"model": ckpt["model"], "optimizer": ckpt["opt"]})
        else:
            opt.load_state_dict(ckpt["opt"])
        assert first + [_plain_step(i, model, opt) for i in range(3, 6)] == want
        _same_weights(engine, ref)
    finally:
        engine.close()


# -- torch.optim.AdamW's keywords and param groups ------------------------------------------------------------------

def test_torch_adamw_keywords_with_torch_arithmetic_are_taken():
    """Each keyword torch.optim.AdamW accepts: the values that compute what offload.AdamW computes are taken
    (before session 25 every one raised a TypeError); training with them is below."""
    model = _net()
    offload.AdamW(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 0.0, False, maximize=False, foreach=True,
                  capturable=False, differentiable=False, fused=False)
    offload.AdamW(model.parameters(), foreach=False)
    with pytest.raises(TypeError, match="lr must be a float"):  # torch's tensor lr is for capturable CUDA graphs
        offload.AdamW(model.parameters(), lr=torch.tensor(1e-3))


@pytest.mark.parametrize("budget, overlap", TWO)
def test_torch_keywords_and_weight_decay_zero_train_like_torch(budget, overlap):
    _side_by_side(lambda i, m, o, ctx: _plain_step(i, m, o), budget, overlap, weight_decay=0.0, eps=1e-6,
                  amsgrad=False, maximize=False, capturable=False, differentiable=False)


REFUSED = {"amsgrad": True, "maximize": True, "capturable": True, "differentiable": True}


@pytest.mark.parametrize("key", list(REFUSED))
def test_torch_options_offload_does_not_implement_are_refused_at_construction(key):
    with pytest.raises(OffloadError, match=f"{key}=True, which offload.AdamW does not implement"):
        offload.AdamW(_net().parameters(), **{key: REFUSED[key]})


@pytest.mark.parametrize("key, budget, overlap", [pytest.param("amsgrad", *loop.values, id=f"amsgrad-{loop.id}")
                                                  for loop in LOOPS]
                         + [pytest.param("maximize", *loop.values, id=f"maximize-{loop.id}") for loop in TWO])
def test_a_torch_option_set_on_a_group_later_is_refused_and_training_goes_on(key, budget, overlap):
    """``opt.param_groups[0][key] = True`` mid-run: torch would switch to AMSGrad / maximizing; offload raises
    (at the backward with overlapped updates, at step() otherwise) before any update, and once the group is
    set back the run goes on as torch's with that step left out. Before session 25: ignored, silently."""
    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    ref, ref_opt = _torch()
    try:
        got = [_plain_step(0, model, opt)]
        want = [_plain_step(0, ref, ref_opt)]
        opt.param_groups[0][key] = True
        loss = _loss(model, 1)
        with pytest.raises(OffloadError, match=f"optimizer.param_groups\\[0\\] has {key}=True"):
            loss.backward()
            opt.step()
        del loss  # its graph holds saved activations (device memory) until it goes, as in torch
        opt.param_groups[0][key] = False
        opt.zero_grad()
        _train_on_like_torch(engine, model, opt, ref, ref_opt, got, want)
    finally:
        engine.close()


@pytest.mark.parametrize("budget", DEFERRED)
def test_a_torch_amsgrad_or_adam_l2_checkpoint_is_refused_before_anything_changes(budget):
    """A plain torch AdamW(amsgrad=True) checkpoint, or torch.optim.Adam's with L2 weight decay, loaded into
    offload.AdamW: refused (before session 25 it trained on as plain AdamW, silently); the optimizer is unchanged.
    Adam without weight decay is AdamW's arithmetic and loads."""
    ams, ams_opt = _torch(amsgrad=True)
    _plain_step(0, ams, ams_opt)
    l2 = _net()
    l2_opt = torch.optim.Adam(l2.parameters(), weight_decay=0.1, foreach=False)
    _plain_step(0, l2, l2_opt)
    plain = _net()
    plain_opt = torch.optim.Adam(plain.parameters(), weight_decay=0.0, foreach=False)
    _plain_step(0, plain, plain_opt)
    model = _net()
    engine, opt = _wrap(model, budget)
    try:
        _plain_step(0, model, opt)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(OffloadError, match="amsgrad=True"):
            opt.load_state_dict(ams_opt.state_dict())
        with pytest.raises(OffloadError, match="amsgrad=True"):
            engine.load_state_dict({"model": ams.state_dict(), "optimizer": ams_opt.state_dict()})
        with pytest.raises(OffloadError, match="decoupled_weight_decay=False"):
            opt.load_state_dict(l2_opt.state_dict())
        assert_bitwise(opt.state_dict()["state"][0], before["state"][0])
        assert opt.param_groups[0]["lr"] == before["param_groups"][0]["lr"]
        opt.load_state_dict(plain_opt.state_dict())
    finally:
        engine.close()


@pytest.mark.parametrize("budget, overlap", TWO)
def test_the_way_named_for_maximize_gives_torchs_maximize(budget, overlap):
    """The refusal of maximize=True names negating the objective: that trains as torch's maximize=True, bit for
    bit."""
    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    ref, ref_opt = _torch(maximize=True)
    try:
        for i in range(5):
            (-_loss(model, i)).backward()
            opt.step()
            opt.zero_grad()
            _loss(ref, i).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _same_weights(engine, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("budget, overlap", TWO)
@pytest.mark.parametrize("how", ["reassigned", "remove"])
def test_a_param_groups_params_changed_after_wrap_is_refused(how, budget, overlap):
    """A parameter taken out of its group: torch stops updating it; the engine (its buckets laid out at wrap) went
    on updating it, silently, before session 25. Now the next backward raises, naming requires_grad=False; with
    the list put back, training goes on as torch's."""
    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    ref, ref_opt = _torch()
    try:
        got, want = [_plain_step(0, model, opt)], [_plain_step(0, ref, ref_opt)]
        params = opt.param_groups[0]["params"]
        if how == "reassigned":
            opt.param_groups[0]["params"] = [p for p in params if p is not model[0][0].weight]
        else:
            params.remove(model[0][0].weight)
        loss = _loss(model, 1)
        with pytest.raises(OffloadError, match="requires_grad=False"):
            loss.backward()
            opt.step()
        del loss
        if how == "reassigned":
            opt.param_groups[0]["params"] = params
        else:
            params.insert(0, model[0][0].weight)
        opt.zero_grad()
        _train_on_like_torch(engine, model, opt, ref, ref_opt, got, want)
    finally:
        engine.close()


@pytest.mark.parametrize("budget, overlap", TWO)
@pytest.mark.parametrize("which", ["all", "one"])
def test_adamw_state_reset_by_loading_a_state_dict_without_it_trains_like_torch(which, budget, overlap):
    """``sd = opt.state_dict(); sd["state"] = {}`` (or without one parameter's entry), then
    ``opt.load_state_dict(sd)``: torch starts those parameters' AdamW afresh (m, v zeros, step 0). Before session
    25 the engine kept its arena's state, silently. ``opt.state.clear()`` (torch: the same reset) raises, naming
    this way."""
    def step(i, m, o, ctx):
        if i == 2:
            if ctx["engine"] is not None:
                with pytest.raises(OffloadError, match="load a state_dict without state"):
                    o.state.clear()
            sd = o.state_dict()
            if which == "all":
                sd["state"] = {}
            else:
                del sd["state"][1]
            o.load_state_dict(sd)
        return _plain_step(i, m, o)

    _side_by_side(step, budget, overlap)


def _nanogpt_groups(model):
    """nanoGPT's / HF's: weight decay on matrices, none on biases; the head at another lr."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("6.")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}, {"params": [model[6].weight], "lr": 1e-3}]


@pytest.mark.parametrize("budget, overlap", LOOPS)
def test_param_groups_with_their_own_lr_and_weight_decay_train_like_torch(budget, overlap):
    def step(i, m, o, ctx):
        if i == 3:  # one group's lr and betas changed mid-run
            o.param_groups[2]["lr"] = 2e-2
            o.param_groups[1]["betas"] = (0.8, 0.99)
        return _plain_step(i, m, o)

    _side_by_side(step, budget, overlap, groups=_nanogpt_groups)


# -- gradients the user makes ---------------------------------------------------------------------------------------

def _vector_grads(i, m, o, ctx):
    """A user's flat-gradient code: parameters_to_vector over p.grad, vector_to_parameters back (it assigns
    ``p.grad.data``)."""
    loss = _loss(m, i)
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    flat = torch.nn.utils.parameters_to_vector(grads) * 0.5
    torch.nn.utils.vector_to_parameters(flat, grads)
    o.step()
    o.zero_grad()
    return loss.item(), flat.norm().item()


def _grad_data_assigned(i, m, o, ctx):
    loss = _loss(m, i)
    loss.backward()
    for p in m.parameters():
        p.grad.data = p.grad.detach() * 0.5
    o.step()
    o.zero_grad()
    return loss.item()


def _grad_noise(i, m, o, ctx):
    """DP-SGD style: noise added to every gradient before the step."""
    loss = _loss(m, i)
    loss.backward()
    gen = torch.Generator().manual_seed(100 + i)
    for p in m.parameters():
        p.grad.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    o.step()
    o.zero_grad()
    return loss.item()


@pytest.mark.parametrize("budget", DEFERRED)
@pytest.mark.parametrize("step", [_vector_grads, _grad_data_assigned, _grad_noise],
                         ids=["vector_to_parameters", "grad.data=t", "grad-noise"])
def test_gradients_the_user_rewrites_train_like_torch(step, budget):
    _side_by_side(step, budget, False)


@pytest.mark.parametrize("budget", DEFERRED)
def test_grad_data_assigned_another_shape_or_dtype_is_refused(budget):
    model = _net()
    engine, _ = _wrap(model, budget)
    try:
        _loss(model, 0).backward()
        with pytest.raises(OffloadError, match="p.grad.data = t with t \\(3,\\)"):
            model[0][0].weight.grad.data = torch.zeros(3)
        with pytest.raises(OffloadError, match="torch.float64"):  # torch's step would then fail on the dtype
            model[0][0].weight.grad.data = torch.zeros(W, W, dtype=torch.float64)
    finally:
        engine.close()


@pytest.mark.parametrize("budget, overlap", TWO)
def test_a_nan_loss_trains_on_as_torch(budget, overlap):
    """fp32 has no overflow skip (that is float16's loss scaling): a NaN loss makes NaN weights, as in torch."""
    def step(i, m, o, ctx):
        loss = _loss(m, i) * (float("nan") if i == 3 else 1.0)
        loss.backward()
        o.step()
        o.zero_grad()
        return str(loss.item())

    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    ref, ref_opt = _torch()
    try:
        assert [step(i, model, opt, None) for i in range(5)] == [step(i, ref, ref_opt, None) for i in range(5)]
        got, want = engine.state_dict()["model"], ref.state_dict()
        assert all(torch.equal(got[k].isnan(), want[k].isnan()) for k in want)
        assert all(math.isnan(float(v.sum())) for v in got.values())
    finally:
        engine.close()


@pytest.mark.parametrize("budget", DEFERRED)
@pytest.mark.parametrize("call", ["autograd.grad", "backward-inputs", "hessian-vector"])
def test_gradients_wrt_parameters_outside_backward_are_refused(call, budget):
    """``torch.autograd.grad(loss, params)`` (meta-learning style) and ``loss.backward(inputs=params)``: the
    engine gathers gradients through its own hooks on a whole backward, so these raise before any gradient is
    made; the engine goes on."""
    model = _net()
    engine, opt = _wrap(model, budget)
    try:
        loss = _loss(model, 0)
        with pytest.raises(OffloadError, match=r"Call loss.backward\(\) and read or replace p.grad"):
            if call == "autograd.grad":
                torch.autograd.grad(loss, list(model.parameters()))
            elif call == "backward-inputs":
                loss.backward(inputs=[model[6].weight])
            else:  # the gradient's graph is built; the second derivative over the parameters is refused
                params = list(model.parameters())
                grads = torch.autograd.grad(loss, params, create_graph=True)
                torch.autograd.grad(sum(g.sum() for g in grads), params)
        del loss  # its graph's saved activations
        _plain_step(1, model, opt)
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("budget, overlap", TWO)
def test_backward_with_create_graph_then_step_trains_like_torch(budget, overlap):
    def step(i, m, o, ctx):
        loss = _loss(m, i)
        loss.backward(create_graph=True)
        o.step()
        o.zero_grad()
        return loss.item()

    _side_by_side(step, budget, overlap)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("budget", DEFERRED)
def test_a_penalty_on_p_grad_after_backward_with_create_graph_is_refused(budget):
    """``loss.backward(create_graph=True)``, then a penalty computed from ``p.grad`` added to a loss: torch
    differentiates the penalty through p.grad's graph; the engine's p.grad (the host sum) has none, so the term
    would get no gradient. Before session 25 it trained on without it, silently; now any use of p.grad with grad
    mode on after such a backward raises. Under no_grad (clipping, logging) it reads as usual."""
    model = _net()
    engine, opt = _wrap(model, budget)
    try:
        loss = _loss(model, 0)
        loss.backward(create_graph=True)
        with pytest.raises(OffloadError, match="backward\\(create_graph=True\\) used with grad mode on"):
            sum(p.grad.pow(2).sum() for p in model.parameters())
        with torch.no_grad():
            assert torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        del loss
        opt.step()
        opt.zero_grad()
        _plain_step(1, model, opt)
    finally:
        engine.close()


# -- averages of the weights --------------------------------------------------------------------------------------

def _ema_setup(m, o, ctx):
    with torch.no_grad():
        ctx["ema"] = [p.detach().clone() for p in m.parameters()]


def _ema_by_hand(i, m, o, ctx):
    loss = _plain_step(i, m, o)
    for e, p in zip(ctx["ema"], m.parameters()):
        e.lerp_(p.detach(), 0.01)
    return loss, [e.clone() for e in ctx["ema"]]


def _ema_foreach(i, m, o, ctx):
    loss = _plain_step(i, m, o)
    with torch.no_grad():
        torch._foreach_lerp_(ctx["ema"], list(m.parameters()), 0.01)
    return loss, [e.clone() for e in ctx["ema"]]


@pytest.mark.parametrize("step, budget, overlap", [pytest.param(_ema_by_hand, *loop.values, id=f"lerp-{loop.id}")
                                                   for loop in LOOPS]
                         + [pytest.param(_ema_foreach, *loop.values, id=f"foreach_lerp-{loop.id}") for loop in TWO])
def test_an_ema_kept_by_hand_is_torchs(step, budget, overlap):
    def compare(i, m, o, ctx):
        loss, ema = step(i, m, o, ctx)
        return loss, [e.tolist() for e in ema]

    _side_by_side(compare, budget, overlap, setup=_ema_setup)


@pytest.mark.parametrize("budget, overlap", LOOPS)
def test_averaged_model_is_refused_and_the_way_it_names_is_torchs_ema(budget, overlap):
    """``AveragedModel(model)`` deep-copies the wrapped model: refused, naming a new model loaded with
    ``model.state_dict()``. That way (AveragedModel over such a copy, ``update_parameters(model)`` each step)
    gives torch's EMA bit for bit."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = _net()
    engine, opt = _wrap(model, budget, overlap)
    ref, ref_opt = _torch()
    try:
        with pytest.raises(OffloadError, match="new.load_state_dict"):
            AveragedModel(model)
        copy_ = _net()
        copy_.load_state_dict(model.state_dict())
        ema = AveragedModel(copy_, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for i in range(5):
            assert _plain_step(i, model, opt) == _plain_step(i, ref, ref_opt)
            ema.update_parameters(model)
            ref_ema.update_parameters(ref)
        assert_bitwise(ema.state_dict(), ref_ema.state_dict())
        _same_weights(engine, ref)
    finally:
        engine.close()
