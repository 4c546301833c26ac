"""What each spawned rank of tests/distributed runs (helpers, not tests), and the spawning itself.

Ranks are separate processes (forked from ``multiprocessing``'s forkserver: [Note: ranks forked from a warm
server]) joined over gloo with ``init_method=file://``; each
writes what it saw to ``<out>/rank<r>.pt``. Every wait has a timeout, so a bug cannot hang the suite.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib
import multiprocessing as mp
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch import nn

IN, HIDDEN, OUT = 12, 40, 6
GLOBAL_BATCH = 8  # split evenly over the ranks


@dataclass(frozen=True)
class Case:
    world: int
    dtype: torch.dtype = torch.float32
    fused: bool = False
    overlap: bool = True  # overlap_optimizer
    steps: int = 3
    micro: int = 1  # micro-batches per step (accumulation: overlap must be False)
    clip: float | None = None
    lr: float = 1e-2
    fail_rank: int | None = None  # this rank raises in its second step's backward, midway (below the last layers)
    hang_rank: int | None = None  # this rank sleeps 30 s midway through its second step's backward, then exits
    # (extra={"die": True}: exits there at once)
    branch_rank: int | None = None  # in its second step no grads reach this rank's layers below the last
    inf_rank: int | None = None  # this rank's first loss is multiplied by 1e30: its float16 grads overflow
    timeout_s: float = 30.0  # the process group's: a collective waits at most this long
    save: str | None = None  # a checkpoint path written after the last step (every rank calls save)
    load: str | None = None  # a checkpoint loaded at wrap; after one no-grad forward, the state_dict is recorded
    start_step: int = 0  # the first step's batches (a resumed run goes on with the next ones)
    chaos: bool = False  # random delays on every lane (offload.testing.chaos), seeded per rank
    device: str = "cpu"  # "cuda": every rank an engine on cuda:0, the device groups gloo ([Note: data parallel on
    # one GPU] in test_cuda_ranks.py)
    extra: dict = field(default_factory=dict)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step (every rank takes its contiguous slice)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n: (rank + 1) * n]


def _in_backward(fault):
    """An identity autograd function whose backward runs ``fault()`` (the rank's injected fault)."""
    class _Fault(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            fault()

    return _Fault.apply


def _raise():
    raise RuntimeError("injected fault in backward")


def _hang():
    import time
    time.sleep(30)
    os._exit(3)  # a rank that hung, then died


def _die():
    os._exit(3)  # a rank that died (no error of its own reaches the others)


_FAIL_IN_BACKWARD, _HANG_IN_BACKWARD, _DIE_IN_BACKWARD = _in_backward(_raise), _in_backward(_hang), _in_backward(_die)


class _ReadInBackward(torch.autograd.Function):
    """``F.linear(h, w)`` with ``w`` a detached weight (it gets no grad): its backward reads ``w`` again, after
    the grads of ``w``'s own layer are complete, and keeps what it read in ``seen`` (tests/MUTATIONS.md, N6)."""

    @staticmethod
    def forward(ctx, h, w, seen):
        ctx.save_for_backward(w)
        ctx.seen = seen
        return nn.functional.linear(h, w)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        ctx.seen.append(w.detach().clone())
        return g.mm(w), None, None


def read_late(model: nn.Module, seen: list) -> torch.utils.hooks.RemovableHandle:
    """After the first layer, ``F.linear(h, model[2].weight.detach())`` (``extra={"late_read_step": k}``): in
    backward the middle layer's weight is read after its own grads, so after its overlapped update was issued."""
    return model[1].register_forward_hook(lambda m, i, o: _ReadInBackward.apply(o, model[2].weight.detach(), seen))


def rank_main(rank: int, case: Case, init_file: str, out: str) -> None:
    import torch.distributed as dist

    import offload
    result: dict = {"rank": rank}
    stack = contextlib.ExitStack()
    started = time.monotonic()
    # torch (2.13) keeps the default group alive past destroy_process_group() once torch.distributed._shard is
    # imported after init_process_group (torch._dynamo imports it, and a torch.optim optimizer imports
    # torch._dynamo when made); a gloo thread of that group can then free a Python-owned tensor while the
    # interpreter exits, and the process aborts ("terminate called without an active exception"). Imported first:
    importlib.import_module("torch._dynamo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=case.world,
                                timeout=datetime.timedelta(seconds=case.timeout_s))
        if "join_window_s" in case.extra:
            from offload.runtime.collective_reads import CollectiveReads
            CollectiveReads.JOIN_WINDOW_S = case.extra["join_window_s"]  # this spawned process only
        if "roll_call_s" in case.extra:
            from offload.runtime.node_share import RollCall
            RollCall.ROLL_CALL_S = case.extra["roll_call_s"]  # this spawned process only
        collectives = _count_collectives()
        if case.device == "cuda":
            _one_gpu()
        sim = _simulated_gpu(stack) if case.extra.get("simulated_gpu") else None
        model = make_model()
        opt = offload.AdamW(model.parameters(), lr=case.lr, weight_decay=0.1, fused=case.fused)
        from offload.config import parse_bytes
        from offload.testing.chaos import ChaosConfig
        from tests.support.fake_cuda import with_chaos
        options = {}
        if "calibrate" in case.extra:  # [Note: timing compute], any difference planned again (this process only)
            from offload.runtime import executor
            executor.RETIME_BEYOND = case.extra["calibrate"]
            options["calibrate_compute"] = True
        if "grad_reduce" in case.extra:  # issue 20: [Note: grads reduced on the device]
            options["grad_reduce"] = case.extra["grad_reduce"]
        if "share_host_copy" in case.extra:  # issue 20: [Note: one host copy per node]
            options["share_host_copy"] = case.extra["share_host_copy"]
        caught = stack.enter_context(warnings.catch_warnings(record=True)) if case.extra.get("record_warnings") else None
        if caught is not None:
            warnings.simplefilter("always")
        if case.extra.get("no_shm_room"):  # [Note: one host copy per node]: rank 0 finds no room for the copy
            stack.enter_context(mock.patch("offload.runtime.node_share.no_room_for", lambda n: "no room (a test)"))
        if "hosts" in case.extra:  # [Note: resident weights gathered in their slots]: ranks on this many "hosts"
            key = rank * case.extra["hosts"] // case.world  # (consecutive ranks share one, as torchrun's)
            for where in ("offload.runtime.device_collectives.host_key", "offload.runtime.node_share.host_key"):
                stack.enter_context(mock.patch(where, lambda: key))
        if rank == case.extra.get("slow_update_rank"):  # this rank's AdamW of every shard lags behind the others'
            from offload.host.shard import ShardedHostState

            update = ShardedHostState.update

            def slow(self, *args, **kwargs):
                time.sleep(0.05)
                return update(self, *args, **kwargs)
            stack.enter_context(mock.patch.object(ShardedHostState, "update", slow))
        with with_chaos(ChaosConfig(seed=rank, max_delay_ms=2.0) if case.chaos else None):
            budget = case.extra.get("rank_budget", {}).get(rank, case.extra.get("budget", "64MiB"))
            if case.device != "cpu":  # the plan's bytes plus what the CUDA backend keeps out of the plan
                from tests.support.budgets import with_headroom
                budget = with_headroom(parse_bytes(budget), case.device)
            result["budget_bytes"] = parse_bytes(budget)
            engine = offload.wrap(model, opt, budget=budget, dtype=case.dtype, device=case.device,
                                  bucket_bytes="4KiB", overlap_optimizer=case.overlap, **options)
        lane = engine._runtime.ctx.cpu  # the lane of the updates and the collectives
        if case.overlap:  # updates run during backward: no_sync() cannot hold their collectives back
            try:
                with engine.no_sync():
                    pass
            except offload.OffloadError as e:
                result["no_sync_error"] = str(e)
        if case.load is not None:
            engine.load(case.load)
            with torch.no_grad():
                engine(rank_slice(batch(0, 0)[0], rank, case.world))  # the host state is built: shards taken
            result["loaded"] = engine.state_dict()
        losses = []
        for step in range(case.start_step, case.start_step + case.steps):
            for micro in range(case.micro):
                x, y = (rank_slice(t, rank, case.world).to(case.device) for t in batch(step, micro))
                hook = None
                if step == 1 and rank in (case.fail_rank, case.hang_rank):
                    fn = (_FAIL_IN_BACKWARD if rank == case.fail_rank
                          else _DIE_IN_BACKWARD if case.extra.get("die") else _HANG_IN_BACKWARD)
                    hook = model[1].register_forward_hook(lambda m, i, o: fn(o))
                if step == 1 and rank == case.branch_rank:  # no grads reach the layers below the last
                    hook = model[3].register_forward_hook(lambda m, i, o: o.detach())
                if step == 1 and rank == case.extra.get("replan_rank"):  # one more module call: a departure
                    hook = model[3].register_forward_hook(lambda m, i, o: model[1](o))
                if step == case.extra.get("late_read_step"):  # every rank: a read the plan did not foresee
                    hook = read_late(model, result.setdefault("late_reads", []))
                # no_sync: every micro-batch but the last inside it ("all": the last too; step() then reduces)
                local = bool(case.extra.get("no_sync")) and (micro < case.micro - 1 or case.extra["no_sync"] == "all")
                # rank 0 through the model's no_sync (DDP's spelling), the others through the engine's
                with (model.no_sync() if rank == 0 else engine.no_sync()) if local else contextlib.nullcontext():
                    before = len(collectives)
                    h = engine(x)
                    if hook is not None:
                        hook.remove()
                    loss = nn.functional.mse_loss(h.float(), y) / case.micro
                    if case.inf_rank == rank and step == 0:
                        loss = loss * 1e30
                    engine.backward(loss)
                    if local and step == 0 and micro == 0:
                        _inside_no_sync(model, result)
                    if case.extra.get("no_sync"):
                        lane.drain()  # anything the backward queued on the lane has run (and been counted)
                        result.setdefault("collectives", []).append((step, micro, bool(local), collectives[before:]))
                losses.append(loss.item())
            if case.extra.get("eval_before_step"):  # a forward after backward, before step(): the same input on
                with torch.no_grad():  # every rank, so every rank must see the same (updated) weights
                    seen = engine(rank_slice(batch(step, 0)[0], 0, case.world))
                result.setdefault("eval_before_step", []).append(seen.float().clone())
            if case.clip is not None and case.extra.get("torch_clip"):  # plain torch on p.grad (the average)
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip, foreach=False)
                result.setdefault("norms", []).append(float(total))
                result.setdefault("grad_norms", []).append([float(p.grad.norm()) for p in model.parameters()])
            elif case.clip is not None:
                result.setdefault("norms", []).append(float(engine.clip_grad_norm_(case.clip)))
            engine.step()
            engine.zero_grad()
            if step == 0 and case.extra.get("load_between_steps"):  # tests/MUTATIONS.md N3: weights written
                halved = {k: v * 0.5 for k, v in model.state_dict().items()}  # outside a step, rank 1 slowly
                with (_slow_writes() if rank == 1 else contextlib.nullcontext()):
                    engine.load_state_dict({"model": halved, "optimizer": opt.state_dict()})
                with torch.no_grad():  # the same input on every rank: every rank must see every rank's writes
                    result["after_load"] = engine(rank_slice(batch(step, 0)[0], 0, case.world)).float().clone()
            if step == 0 and rank != 0 and case.extra.get("others_sleep_s"):  # rank 0 is in a read meanwhile
                time.sleep(case.extra["others_sleep_s"])
            if step == 0 and rank == 0 and case.extra.get("rank0_state_dict"):  # the usual rank-0-only save
                t0 = time.monotonic()
                try:
                    model.state_dict()
                finally:
                    result["state_dict_s"] = time.monotonic() - t0
        stats = engine.memory_stats()
        result["counters"] = stats["counters"]
        result["chaos_draws"] = lane._before.draws if lane._before is not None else 0
        result["host_bytes"] = stats["host_pinned_bytes"]
        result["host_shared_bytes"] = stats["host_shared_bytes"]
        if caught is not None:
            result["warnings"] = [str(w.message) for w in caught]
        result["device_peak_bytes"] = stats["device_peak_bytes"]
        result["backend"] = type(engine._runtime.ctx.backend).__name__
        result["collective_devices"] = sorted(collectives.devices)
        result["grad_slot_numel"] = [b.grad_numel for b in engine._runtime.slots.buckets]
        plan = engine._runtime.executor.train_plan
        result["resident"] = sorted(plan.resident) if plan is not None else []
        result["optimizer"] = stats["optimizer"]
        result["buckets"] = [(b.numel, b.trainable_numel) for b in engine._runtime.slots.hosted().buckets]
        if case.save is not None:
            engine.save(case.save)
        result["losses"] = losses
        if case.extra.get("every_rank_state_dict"):
            result["model_state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        result["weights"] = {k: v.detach().cpu().clone() for k, v in engine.state_dict()["model"].items()}
        engine.close()
        result["after_close"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if case.extra.get("destroy_group"):  # the group goes with the user's engine still held (close() let go)
            dist.destroy_process_group()
            result["gloo_threads_after_destroy"] = _gloo_threads()
        if sim is not None:
            result["races"], result["sim_log"] = list(sim.races), [x[0] for x in sim.log]
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts on it
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_after_s"] = time.monotonic() - started
        result["traceback"] = traceback.format_exc()
        if case.extra.get("close_after_error") and "engine" in locals():
            _close_after_error(engine, model, result)
    finally:
        stack.close()
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed group may not tear down cleanly
                pass


def _gloo_threads() -> list[str]:
    """The names of this process's threads that gloo's process groups run (their loops and workers)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


def _one_gpu() -> None:
    """[Note: data parallel on one GPU] (test_cuda_ranks.py), in this spawned rank: the device groups are gloo
    (NCCL refuses two ranks on one GPU); fp32 means fp32 (as tests/conftest.py's ``device`` fixture sets); and
    what the process keeps for good on first use (the CUDA context, cuBLAS workspaces on this thread and on
    autograd's device thread) is made before the engine measures its device peak (conftest's ``_warm_cuda``)."""
    from offload.runtime.device_collectives import DeviceGroup
    if not torch.cuda.is_available():
        raise RuntimeError("Case(device=\"cuda\") without CUDA: the test should have been skipped")
    DeviceGroup.CUDA_BACKEND = "gloo"  # this spawned process only
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, False
    torch.backends.cudnn.deterministic = True
    if torch.backends.cuda.matmul.allow_tf32:
        raise RuntimeError("TF32 matmuls are on: fp32 would not be fp32")
    layer = torch.nn.Linear(8, 8, device="cuda")
    layer(torch.randn(4, 8, device="cuda", requires_grad=True)).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def _simulated_gpu(stack: contextlib.ExitStack):
    """Engines wrapped from now on (this spawned process) get the CUDA backend on the simulated GPU
    (tests/support/fake_cuda.py), entered: compute is watched; returns it (its ``races`` are recorded)."""
    import pytest

    import offload
    from offload.backend import CUDABackend
    from tests.support.fake_cuda import FakeCuda
    sim = stack.enter_context(FakeCuda())
    patch = stack.enter_context(pytest.MonkeyPatch.context())
    patch.setattr(offload.api, "make_backend", lambda device, chaos=None: CUDABackend(torch.device("cpu"), api=sim,
                                                                                      chaos=chaos))
    return sim


class _Calls(list):
    """The collectives' names in call order; ``devices``: each (name, the device type of its tensors) seen."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[tuple[str, str]] = set()


def _count_collectives() -> _Calls:
    """Wrap every collective offload can issue (the process group's calls, in this spawned process only):
    the returned list gets each one's name as it is called, on whichever thread."""
    import torch.distributed as dist

    from offload.runtime import device_collectives, distributed, node_share
    calls = _Calls()

    def counted(name: str, fn):
        def call(*args, **kwargs):
            calls.append(name)
            calls.devices.update((name, a.device.type) for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)
        return call

    for module in (distributed, device_collectives, node_share):
        for name in ("_reduce_scatter", "_all_gather"):
            if hasattr(module, name):
                setattr(module, name, counted(name, getattr(module, name)))
    for name in ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "reduce_scatter",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "send", "recv"):
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))
    return calls


def _inside_no_sync(model: nn.Module, result: dict) -> None:
    """The first backward inside no_sync: p.grad is this rank's own sum; torch's clip_grad_norm_ raises
    (before it scales anything), p.grad.norm() too."""
    import offload
    result["local_grads"] = [p.grad.clone() for p in model.parameters()]
    for name, fn in (("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)),
                     ("norm", lambda: model[0].weight.grad.norm())):
        try:
            fn()
        except offload.OffloadError as e:
            result[f"{name}_in_no_sync_error"] = str(e)
    result["local_grads_after_clip"] = [p.grad.clone() for p in model.parameters()]


def _close_after_error(engine, model: nn.Module, result: dict) -> None:
    """After a fault: close() must stop every thread the engine started and free its arena, raising (if at
    all) only after that. Records the threads alive before and after, and close's error."""
    import threading
    result["threads_before_close"] = sorted(t.name for t in threading.enumerate())
    try:
        engine.close()
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        result["close_error"] = f"{type(e).__name__}: {e}"
    result["threads_after_close"] = sorted(t.name for t in threading.enumerate() if t.is_alive())
    result["host_after_close"] = engine._runtime.slots.host is None
    result["params_after_close"] = {k: (tuple(v.shape), v.dtype, bool(torch.isfinite(v).all()))
                                    for k, v in model.state_dict().items()}


def _slow_writes():
    """This rank's writes of the host state lag (20 ms each): another rank that does not wait for them reads
    the node's shared copy before they land."""
    from offload.host.shard import ShardedHostState

    write = ShardedHostState.write_master

    def slow(self, *args, **kwargs):
        time.sleep(0.02)
        return write(self, *args, **kwargs)
    return mock.patch.object(ShardedHostState, "write_master", slow)


# [Note: ranks forked from a warm server] A rank used to be spawned: a fresh interpreter importing torch,
# torch._dynamo (rank_main's crash workaround, which a torch.optim optimizer imports anyway), offload and this
# module, ~4.5 s of CPU a rank before it did anything, two to four ranks a test, some thirty tests in the default run.
# Ranks now fork from multiprocessing's forkserver, started once per test process with those modules imported
# (nothing else: no engine, no thread, no CUDA context; each rank still starts from a clean copy of that state,
# and the test process's own state, its thread pools or CUDA, never reaches a rank). What a rank sees is as before:
# the environment the server started with (tests/conftest.py's, set at import; no distributed test changes it
# later) and its arguments, pickled.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "offload", "tests.distributed.workers"]
_CONTEXT: list = []


def _rank_context():
    """The multiprocessing context ranks start from: [Note: ranks forked from a warm server]."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run_ranks(case: Case, tmp: Path, timeout_s: float = 120.0) -> list[dict]:
    """Spawn ``case.world`` ranks; return each rank's result. A rank still running after ``timeout_s`` is
    killed and reported as hung (never a hang of the test itself)."""
    ctx = _rank_context()
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    init = tmp / "init"
    procs = [ctx.Process(target=rank_main, args=(r, case, str(init), str(out)), daemon=True)
             for r in range(case.world)]
    for p in procs:
        p.start()
    import time
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            results.append({"rank": r, "hung": True})
            continue
        path = out / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else {"rank": r, "exitcode": p.exitcode})
    return results


def reference(case: Case, emulate_ranks: bool, start: dict | None = None) -> dict:
    """Plain PyTorch + ``torch.optim.AdamW(foreach=False)`` in one process, fp32. ``emulate_ranks``: each
    rank's grads computed apart on its slice (micro-batches summed first, as the engine's host sum), the
    ranks' sums added in rank order and scaled by ``1 / world``: what the engine's reduce-scatter computes,
    bit for bit where gloo adds in the same order (two ranks: a + b either way). Otherwise the grads of the
    concatenated batch, as one process training on the whole global batch. ``start``: a checkpoint written
    by ``Engine.save`` to resume from (its weights, m, v and step counts), at ``case.start_step``.
    ``extra["late_read_step"]``: the ranks' late read (``read_late``) at that step too (torch's backward reads the
    weight before the step's update); what it read, in ``"late_reads"``.
    ``case.device`` "cuda": the grads are computed (and summed, and scaled) on a CUDA twin of the model that gets
    the weights before each step, AdamW runs on the CPU: the engine's split of the work, so fp32 stays bit for
    bit (IEEE adds and multiplies round alike on both; matmuls are compared on the same GPU)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.1, foreach=False)
    params = list(model.parameters())
    twin = model if case.device == "cpu" else copy.deepcopy(model).to(case.device)
    twins = list(twin.parameters())
    if start is not None:
        model.load_state_dict(start["model"])
        for i, p in enumerate(params):  # by hand: offload.AdamW's param groups carry fewer keys than torch's
            opt.state[p] = {k: v.clone() for k, v in start["optimizer"]["state"][i].items()}
    norms: list[float] = []
    late_reads: list[torch.Tensor] = []  # what the late read's backward read (``read_late``), per rank

    def grads_of(step: int, rank: int | None) -> list[torch.Tensor]:
        total: list[torch.Tensor] | None = None
        for micro in range(case.micro):
            x, y = batch(step, micro)
            if rank is not None:
                x, y = rank_slice(x, rank, case.world), rank_slice(y, rank, case.world)
            twin.zero_grad(set_to_none=True)
            late = read_late(twin, late_reads) if step == case.extra.get("late_read_step") else None
            (nn.functional.mse_loss(twin(x.to(case.device)), y.to(case.device)) / case.micro).backward()
            if late is not None:
                late.remove()
            g = [p.grad.clone() for p in twins]
            total = g if total is None else [t + gi for t, gi in zip(total, g)]
        assert total is not None
        return total

    for step in range(case.start_step, case.start_step + case.steps):
        if twin is not model:
            with torch.no_grad():
                for t, p in zip(twins, params):
                    t.copy_(p)
        if emulate_ranks:
            sums = [grads_of(step, r) for r in range(case.world)]
            total = sums[0]
            for s in sums[1:]:
                total = [t + si for t, si in zip(total, s)]
            grads = [t * (1.0 / case.world) for t in total]
        else:
            grads = grads_of(step, None)
        for p, g in zip(params, grads):
            p.grad = g.cpu()
        if case.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, case.clip, foreach=False)))
        opt.step()
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "optimizer": state, "late_reads": [t.cpu() for t in late_reads]}


def report_model(batch: int, seq: int) -> tuple[nn.Module, torch.Tensor]:
    """``offload report --model tests.distributed.workers:report_model``: the ranks' model and a rank's batch."""
    return make_model(), torch.zeros(batch, IN)
