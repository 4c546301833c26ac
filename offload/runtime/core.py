"""The runtime: builds the components, registers every hook in one place, and dispatches each hook to the
components that own the state it changes. It decides nothing the plan has not decided; where there is no
plan yet (the first, traced step) or the step departs from it, the components fetch on demand.

Who owns what (one component per job, each owning its state; FSDP2's split of ``FSDPState`` dispatching
and ``FSDPParamGroup`` owning buffers and events):

* ``RuntimeContext`` (context.py, frozen): params, specs, dtype, backend, config, placeholders, and the
  shared holders (device-memory accounting, counters, the CPU lane, the lane log, the phases);
* ``Phases`` (phases.py): lifecycle (TRACING / RUNNING / CLOSED) and pass (IDLE / FORWARD / BACKWARD /
  RECOMPUTE), with checked transitions;
* ``SlotTable`` (slots.py): residency per bucket, slots, H2D/AdamW events, LRU, on-demand memory, the
  slot index, the compute boundary;
* ``PlanExecutor`` (executor.py): the plan, its arena, the plan position, the step's recorder, leaving
  and re-entering a plan, re-planning; ``EvalPlans`` (forward_only.py): forward-only plans;
* ``TracedWarmup`` (warmup.py): the first forward's per-parameter copies, then buckets and host arena;
* ``ParamAccess`` (param_access.py): forward uses, saved parameter views, the buckets in use;
* ``GradPipeline`` (grads.py): grad slots, copies, accumulation, norms, clipping, loss scale, updates;
* ``RecomputeCoordinator`` (recompute_hooks.py): activation checkpointing's runtime side, "auto";
* ``Weights`` (weights.py): parameters' fp32 values from outside a step (state_dict, load, close).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from ..config import OffloadConfig
from ..errors import OffloadError
from ..optim import AdamW
from ..planning.trace import EventKind
from . import faults, guards, idle_params
from .accounting import SavedActivation
from .context import Backend, RuntimeContext
from .departures import Where
from .executor import PlanExecutor
from .fast_path import FastPath
from .forward_only import EvalPlans
from .grad_records import BackwardDiscard
from .grads import GradPipeline
from .param_access import ParamAccess
from .phases import Lifecycle, Pass
from .module_state import EngineHook, module_hooks
from .recompute_hooks import RecomputeCoordinator
from .residency import ParamRef
from .saved_hooks import UnderUserHooks, check_enabled, engine_hook, user_hooks
from .slots import SlotTable
from .step_passes import StepPasses, pass_planned_here
from .warmup import TracedWarmup
from .weights import Weights


class ForwardDiscard(NamedTuple):
    """What :meth:`Runtime.abort_forward` let go of (for the warning of offload/runtime/faults.py)."""

    streamed: int  # buckets (or, tracing, parameters) it had brought to the device
    tracing: bool  # it was the traced first forward
    under_way: bool  # it had begun


class Runtime:
    """Hooks plus plan execution for one wrapped module. Owned by :class:`offload.Engine`."""

    def __init__(self, module: nn.Module, optimizer: AdamW, config: OffloadConfig, backend: Backend,
                 params: Sequence[nn.Parameter], groups: Sequence[int | None]) -> None:
        self.ctx = ctx = RuntimeContext.build(module, optimizer, config, backend, params, groups)
        self.slots = SlotTable(ctx)
        self.evals = EvalPlans(ctx)
        self.executor = PlanExecutor(ctx, self.slots, self.evals)
        self.warmup = TracedWarmup(ctx, self.slots)
        self.access = ParamAccess(ctx, self.slots, self.executor, self.warmup)
        self.grads = GradPipeline(ctx, self.slots, self.executor)
        self.recompute = RecomputeCoordinator(ctx, self.slots, self.executor, self.access, self._begin_backward)
        self.warmup.guard_first_step(self.executor, self.recompute, self.grads, self.abort_backward)  # issue 18
        self.slots.over_budget = self.warmup.over_budget  # issue 18: [Note: refusing the first step whole]
        self.guard = guards.ParamGuard(ctx, self.slots, self.executor, self.warmup)
        self.weights = Weights(ctx, self.slots, self.executor, self.warmup)
        self.fast = FastPath(ctx, self.slots, self.executor, self.grads, self._remove_module_hooks,
                             self._add_module_hooks)
        self.executor.before_leaving(self.grads.move_out_of_arena)
        self.executor.device_state = self.grads.device  # issue 18: optimizer state in the arena
        self.executor.after_copying_in(self.fast.settle, self.fast.lands_at_once)
        self.slots.pin_with(self.access.pinned)
        ctx.memory.on_activations = self.slots.activations_grew
        self.engine_call = False  # a forward called through Engine.__call__, which handles its faults
        self._handles: list[RemovableHandle] = []
        self._module_handles: list[RemovableHandle] = []  # hooks of the modules below the root (the fast path)
        self._module_hooks: list[tuple[nn.Module, Any, Any]] = []  # (module, pre hook, post hook), fixed at wrap
        self._contexts: list[Any] = []  # entered at the start of a forward, exited at its end
        self.passes = StepPasses(ctx)  # [Note: a backward pass inside a step] (step_passes.py)
        self.saving = 0  # module.state_dict() calls under way (idle_params.py: parameters pass through)
        self._reset_step()
        self._register_hooks()
        idle_params.adopt(self, ctx.params)  # [Note: parameters between forwards]
        self.recompute.start()

    # -- hooks: every one the runtime registers ----------------------------------------------------------

    def _register_hooks(self) -> None:
        module = self.ctx.module
        for i, m in enumerate(module.modules()):
            if i == 0:  # the root's: with its arguments, whose signature decides the fast path
                self._handles.append(m.register_forward_pre_hook(self._root_pre_hook(), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post_hook(i)))
            else:
                self._module_hooks.append((m, self._pre_hook(i), self._post_hook(i)))
        self._add_module_hooks()
        on_grad = self._grad_hook()
        for p, spec in zip(self.ctx.params, self.ctx.specs):
            if spec.group is not None:
                self._handles.append(p.register_post_accumulate_grad_hook(on_grad))
        self._handles.append(module.register_forward_hook(faults.root_watcher(self), always_call=True))
        # issue 19: module.state_dict() gives the fp32 weights, load_state_dict() after the first forward raises
        self._handles.extend(module_hooks(self))
        # Per forward (entered by _begin_forward): autocast, the use detector, the saved-tensor hooks.

    def _add_module_hooks(self) -> None:
        """Hooks of every module below the root (removed while steps run the fast path: fast_path.py).
        Put back after user hooks registered since wrap, which then run first: they may read a weight
        before this hook waits for it, which the use detector sees (a fetch, at most a departure)."""
        for m, pre, post in self._module_hooks:
            self._module_handles.append(m.register_forward_pre_hook(pre))
            self._module_handles.append(m.register_forward_hook(post))

    def _remove_module_hooks(self) -> None:
        for h in self._module_handles:
            h.remove()
        self._module_handles.clear()

    def _root_pre_hook(self) -> Any:
        busy, ckpt, on_pre = self.ctx.busy, self.recompute.ckpt, self._on_pre

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            guards.refuse_compile()
            if ckpt.recomputing is not None:
                return
            with busy:
                on_pre(0, module, args, kwargs)
        return EngineHook(hook)  # issue 19: torch.save(model) / deepcopy raise the engine's error

    def _pre_hook(self, index: int) -> Any:
        busy, ckpt, on_pre = self.ctx.busy, self.recompute.ckpt, self._on_pre

        def hook(module: nn.Module, args: Any) -> None:
            guards.refuse_compile()
            if ckpt.recomputing is not None:
                return  # backward recomputes a checkpointed call: its RECOMPUTE event stands for it
            if torch.is_inference_mode_enabled():
                with busy:
                    on_pre(index)
                return
            # What entering Busy does outside inference mode, without the calls: this runs for every module call
            busy.depth += 1
            try:
                on_pre(index)
            finally:
                busy.depth -= 1
        return EngineHook(hook)

    def _on_pre(self, index: int, module: nn.Module | None = None, args: Any = (), kwargs: Any = None) -> None:
        executor = self.executor
        if index == 0 and executor.recorder.stack:
            faults.abort_forward(self, None)  # the previous call of the root module raised
        if not executor.recorder.stack:
            if torch._C._current_autograd_node() is not None:  # issue 19: a forward inside backward
                self.recompute.user_recompute_begins(index, self._pack, self._unpack)
                return
            if module is not None:
                faults.check_backward_finished(self, None)  # before deciding: cleaning up drops the fast path
            if (module is not None and not self.passes.continues(torch.is_grad_enabled())
                    and self.fast.wants(module, args, kwargs or {})):
                self._begin_forward(index, fast=True)  # [Note: the fast path]
                executor.recorder.pre(index)
                return
            self._begin_forward(index)
        elif self.fast.on:
            executor.recorder.pre(index)  # the root called inside its own forward
            return
        executor.recorder.pre(index)
        self.access.call_begins()
        executor.advance(EventKind.PRE, index)

    def _post_hook(self, index: int) -> Any:
        busy, ckpt, on_post, recompute = self.ctx.busy, self.recompute.ckpt, self._on_post, self.recompute

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if ckpt.recomputing is not None:
                recompute.user_recompute_ends(index)  # issue 19: a user's reentrant checkpoint
                return
            if torch.is_inference_mode_enabled():
                with busy:
                    on_post(index, output)
                return
            busy.depth += 1
            try:
                on_post(index, output)
            finally:
                busy.depth -= 1
        return EngineHook(hook)

    def _on_post(self, index: int, output: Any) -> None:
        executor = self.executor
        if self.fast.on and executor.recorder.stack:  # only the root's hooks run: [Note: the fast path]
            executor.recorder.post(index)
            if not executor.recorder.stack:
                self._end_forward(output)
                self.fast.forward_ended()
            return
        executor.advance(EventKind.POST, index)
        self.access.call_ends()
        executor.recorder.post(index)
        if not executor.recorder.stack:
            self._end_forward(output)

    @engine_hook  # issue 19: [Note: a user's saved-tensor hooks] (saved_hooks.py)
    def _pack(self, t: torch.Tensor) -> ParamRef | SavedActivation:
        # One storage lookup serves both the parameter check and the activation's accounting: a storage that
        # is neither a traced copy nor an indexed slot holds no parameter (locate would return None)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        local = t.device == self.ctx.backend.device and t.layout == torch.strided
        if local and (key in self.slots.index or key in self.warmup.storage):
            ref = self.access.locate(t)
            if ref is not None:
                return ref
        rec = self.executor.recorder
        stack = rec.stack
        block_of = self.recompute.ckpt.block_of
        if stack and local and block_of:
            block = block_of.get(rec.events[stack[-1]].key)
            if block is not None:  # what this block saves: what checkpointing it would spare
                self.recompute.count_saved(block, t)
        return SavedActivation(t, self.ctx.memory, storage)

    def _unpack(self, saved: ParamRef | SavedActivation) -> torch.Tensor:
        if isinstance(saved, SavedActivation):
            return saved.tensor
        return self.unpack_saved(saved)

    def unpack_saved(self, saved: ParamRef) -> torch.Tensor:
        """The weight view ``saved`` names, for the autograd node unpacking it."""
        self._begin_backward()
        self.slots.check_saved(saved)  # [Note: stale graphs] (slots.py)
        if self.executor.recorder.unpack(saved.param, torch._C._current_autograd_node()):
            self.access.new_node()
            self.executor.advance(EventKind.UNPACK, saved.param)
        view = self.access.param_view(saved)
        if torch.is_grad_enabled():  # issue 19: backward(create_graph=True), torch.autograd.grad(create_graph=True)
            return self.access.graph_copy(view)  # the graph it builds saves this: a copy, not a slot reused later
        return view

    def _grad_hook(self) -> Callable[[nn.Parameter], None]:
        """The post-accumulate-grad hook of every trainable parameter: :meth:`_on_grad`, holding the runtime
        weakly (tensor hooks are held by the tensor's C++ side, where Python's gc cannot see them: a hook
        holding the runtime would make runtime -> params -> hook -> runtime an uncollectable cycle, and an
        engine dropped without close() must still be freed). The hook runs for every parameter of every
        backward, so its commonest case, a fast step's grad that only waits in ``p.grad`` for its bucket's last
        one (``param is fast.expect``, set only in a fast step's backward), returns before anything else."""
        ref = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            rt = ref()
            if rt is None:
                return
            fast = rt.fast
            if fast.expect is param:  # [Note: one hook's work per bucket] (fast_path.py)
                fast.took_waiting()
                return
            with torch._C.DisableTorchFunctionSubclass():  # idle parameters read as plain ones (idle_params.py)
                rt._on_grad(param)
        return hook

    def _on_grad(self, param: nn.Parameter) -> None:
        ctx = self.ctx
        p = ctx.param_index[id(param)]
        fast = self.fast
        if fast.on and fast.in_order(p):  # [Note: the fast path]: the plan's next grad, nothing to decide
            if ctx.phases.current is not Pass.BACKWARD:
                self._begin_backward()
                fast.arm()  # the grads that only wait are taken by the hook's first test from now on
            closes = fast.closes
            if closes is None:
                self.grads.gather_in_order(p, param)
            else:  # [Note: one hook's work per bucket]: wait in p.grad for the bucket's last grad
                closing = closes.get(p)
                if closing is not None and not fast.at_end:  # [Note: sent after backward] (fast_path.py)
                    self.grads.gather_bucket(*closing)
            return
        if fast.on:
            self._gather_waiting()  # before anything departs: as they would have been, had they not waited
        grad = param.grad
        nbytes = 0 if grad is None else grad.numel() * grad.element_size()
        del grad
        ctx.memory.add("grads", nbytes)  # autograd has materialised it; the grad pipeline lets it go
        if fast.on or fast.hooks_removed:  # [Note: the fast path]: out of order, or a forward no hook saw
            fast.grad(p)
            self._begin_backward()
            self.grads.gather(p, param, nbytes)
            return
        self._begin_backward()
        self.access.new_node()
        self.executor.recorder.grad(p, nbytes)
        self.executor.advance(EventKind.GRAD, p)
        self.grads.gather(p, param, nbytes)

    def _gather_waiting(self, at_end: bool = False) -> None:
        """The grads a fast step left in ``p.grad`` for their bucket's last grad, gathered now, in the order
        they came, as each would have been when it came ([Note: one hook's work per bucket]). ``at_end``: the
        end of backward, whose exposure replaces what the whole buckets leave in ``p.grad`` ([Note: grads left
        for the exposure] in plain_grads.py)."""
        complete = self.fast.complete()  # [Note: sent after backward]: whole buckets first, their grads held at once
        if complete:
            self.ctx.memory.passing(sum(c[2] for c in complete))
            self.grads.fast_send.send_all(complete, leave=at_end)  # [Note: sent as one batch] (bucket_send.py)
        params, gather = self.ctx.params, self.grads.gather_in_order
        for q in self.fast.waiting():
            gather(q, params[q])

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._remove_module_hooks()
        self.fast.hooks_removed = False
        self.recompute.ckpt.close()

    # -- passes ---------------------------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self.executor.reset_step()
        self.access.reset_step()
        self.grads.reset_step()
        memory = self.ctx.memory
        memory.activation_peak = memory.parts["activations"]
        self.recompute.reset_step()
        self.ctx.phases.enter(Pass.IDLE)

    def _begin_forward(self, root: int, fast: bool = False) -> None:
        ctx, executor = self.ctx, self.executor
        if not fast:
            check_enabled()  # issue 19: under disable_saved_tensors_hooks, refused before anything changes
        ctx.backend.begin_forward()  # CUDA: binds to (or checks) the current stream
        faults.check_backward_finished(self, None)  # cleans up after a plain loss.backward() that raised
        self.saving = 0  # a state_dict() that raised half-way
        self.guard.check()  # replaced, added or reassigned parameters: a clear error, not garbage
        grad_enabled = torch.is_grad_enabled()
        if self.passes.continues(grad_enabled):  # [Note: a forward after an inner pass] (step_passes.py)
            self.passes.forward_continues(executor)
            self.access.new_node()  # the pass's last node is over: its buckets may go, freed graph copies too
            ctx.phases.enter(Pass.FORWARD)
            self._enter_contexts(fast)
            return
        self.passes.step_begins(executor, grad_enabled)  # [Note: a backward pass inside a step]
        if ctx.phases.in_backward or executor.pos:
            # The previous forward was not followed by a (completed) backward: start over cleanly.
            executor.release_all()
        executor.choose(root, grad_enabled)  # [Note: forward-only plans]
        self._reset_step()
        # [Note: transients] (accounting.py): neither the traced first step nor a fast step (whose activations
        # the accounting does not see) teaches
        ctx.memory.window_begins(ctx.backend.allocated_bytes(), learn=not (ctx.phases.tracing or fast))
        ctx.phases.enter(Pass.FORWARD)
        self.grads.wait_for_copies()
        self.slots.mark_boundary()
        self._enter_contexts(fast)

    def _enter_contexts(self, fast: bool) -> None:
        """What a forward runs under: autocast, and off the fast path the use detector and saved-tensor hooks."""
        ctx = self.ctx
        hooks: tuple[Any, Any] = (self._pack, self._unpack)
        if not fast:  # issue 19: a user's saved-tensor hooks around the call ([Note: a user's saved-tensor hooks])
            below = user_hooks()
            if below is not None:
                composed = UnderUserHooks(self, below)
                hooks = (composed.pack, composed.unpack)
        contexts: list[Any] = []
        if ctx.dtype != torch.float32:
            # Ops autocast keeps in fp32 (softmax, norms, losses) upcast the 16-bit weights and activations;
            # matmuls read the 16-bit weights as they are. No cast cache: it would hold weight views.
            contexts.append(torch.autocast(ctx.backend.device.type, dtype=ctx.dtype, cache_enabled=False))
        if not fast:  # the fast path needs neither: every weight stays where it is ([Note: the fast path])
            contexts.append(self.access.detector())
            contexts.append(torch.autograd.graph.saved_tensors_hooks(*hooks))
        for c in contexts:
            c.__enter__()
        self._contexts = contexts[::-1]
        if fast:
            self.fast.begin()

    def _exit_contexts(self) -> None:
        for c in self._contexts:  # exit in reverse order of entry
            c.__exit__(None, None, None)
        self._contexts = []

    def _end_forward(self, output: Any) -> None:
        self._exit_contexts()
        if self.executor.grad_enabled:  # issue 19: exposed p.grad taken back when its backward begins
            self.grads.exposure.before_backward_of(output)
        self.ctx.phases.enter(Pass.IDLE)
        self.recompute.forward_ended()
        if self.ctx.phases.tracing:
            self.warmup.finish(self.executor.recorder, self.recompute, accumulate=self.grads.deferred)
        if not self.executor.grad_enabled:
            self.executor.end_no_grad_forward()

    def abort_forward(self) -> ForwardDiscard:
        """The forward raised: undo its effects so the engine stays usable; say what was let go of."""
        executor = self.executor
        found = ForwardDiscard(executor.streamed() + len(self.warmup.views), self.ctx.phases.tracing,
                               bool(executor.recorder.stack))
        with self.ctx.busy:
            self._exit_contexts()
            self.fast.drop()
            self.warmup.abort()
            executor.release_all()
            self._reset_step()
            self.passes.forward_aborted()
        return found

    def _begin_backward(self) -> None:
        phases = self.ctx.phases
        if phases.current is Pass.BACKWARD or phases.current is Pass.RECOMPUTE:
            return
        self.grads.begin()
        phases.enter(Pass.BACKWARD)
        self.ctx.memory.backward_begins(self.ctx.backend.allocated_bytes())  # [Note: transients]
        executor = self.executor
        between = self.passes.backward_begins()
        if not self.fast.on and executor.on_plan and not between and not pass_planned_here(executor):
            executor.leave(Where(reason="at a backward that began before its plan's forward had ended"))
        Variable._execution_engine.queue_callback(self._end_backward)

    @idle_params.engine_code
    def _end_backward(self) -> None:
        """Queued on the autograd engine: runs once the whole backward has finished, on the stream current
        where backward was called; the runtime's kernels in it go on the engine's compute stream all the same.
        A pass inside its step ends here at once ([Note: a backward pass inside a step] in step_passes.py)."""
        ctx, executor = self.ctx, self.executor
        if self.passes.pass_ends(executor, bool(self.grads.received), self.fast.on, bool(self.recompute.ckpt.active)):
            self.grads.backward_done()
            ctx.phases.enter(Pass.IDLE)
            return
        memory = ctx.memory
        with ctx.backend.compute(), torch.no_grad():
            executor.check_transients()  # before the first plan is built below ([Note: transients])
            self._gather_waiting(at_end=True)  # a fast step whose last grads did not come (a missing one departs below)
            self.grads.flush()
            if self.fast.on:  # no record to plan from, nothing streamed ([Note: the fast path])
                self.fast.backward_ended()
                # Copies issued from now on (step()'s refresh of the resident buckets) wait for all of this
                # backward's compute, as after a full step (release_all). Without it they were ordered after
                # the compute that read their bucket only through the host: the AdamW lane waited for the
                # grads' copy, which waited for compute. Correct, but a chain no event names, which the
                # simulated GPU rightly cannot follow (per-thread host clocks).
                self.slots.mark_boundary()
            else:
                executor.leave_unless_followed()
                self.recompute.backward_ended()
                executor.record_step(memory.activation_peak)
                self.recompute.measure(executor.recorder, memory.activation_peak)
                self.warmup.check_first_plan()  # issue 18: may refuse ([Note: refusing the first step whole])
                if self.passes.forwards == 1:  # [Note: one forward per fast step] (step_passes.py)
                    self.fast.verify()
                executor.release_all()
            self.slots.reclaim()
            self.grads.release_held()  # issue 18: the first step's overlapped updates, now that its plan fits
            self.slots.check_shared_copies()  # issue 20: [Note: the shared copy checked once per backward]
        self.grads.backward_done()
        ctx.phases.enter(Pass.IDLE)
        executor.rewind()
        self.passes.reset()

    def abort_backward(self) -> BackwardDiscard | None:
        """The backward raised (see [Note: what a fault discards] in faults.py); None if it never reached
        the engine (nothing was gathered: only what the forward streamed in is let go of)."""
        executor = self.executor
        self.passes.reset()
        with torch.no_grad():
            for q in self.fast.waiting():  # left in p.grad for their bucket's last grad: they had arrived
                self.grads.received.setdefault(self.slots.bucket_of[q], set()).add(q)
            self.fast.drop()
            if not self.ctx.phases.in_backward:
                executor.release_all()
                executor.rewind()
                return None
            discard = self.grads.abort()
            executor.release_all()
            executor.refresh(discard.updated)  # updated before the fault and resident: bring the new weights
            self.slots.note_updates(discard.updated)
            self._reset_step()
        return discard

    @property
    def in_backward(self) -> bool:
        return self.ctx.phases.in_backward

    def forward_under_way(self) -> bool:
        """A forward of the wrapped module began and has not ended."""
        return bool(self.executor.recorder.stack)

    # -- the optimizer side ---------------------------------------------------------------------------------

    @idle_params.engine_code
    def step(self) -> None:
        ctx, executor = self.ctx, self.executor
        with ctx.backend.compute():  # called outside the user's `with torch.cuda.stream(s)`, perhaps
            faults.check_backward_finished(self, "optimizer.step()")
            self.passes.step_ran()  # a step between its passes ends ([Note: a forward after an inner pass])
            # issue 19: user edits of p.grad honoured, p.grad taken back; before the check, so that a raise
            # here (overlap: p.grad dropped after the update ran) leaves the backward counted for a retry
            self.grads.exposure.before_step()
            guards.check_step_has_grads(self.grads.backward_seen)
            self.guard.check_at_step()  # a .data reassigned since the forward: refused before anything changes
            self.grads.consume_backward()
            self.slots.stepped = True  # a backward from now to the next forward runs through an older graph
            self.guard.snapshot()
            updated = self.grads.run_step()
            self.slots.note_updates(updated)  # [Note: stale graphs] (slots.py)
            if ctx.dp is not None:  # issue 20: every rank re-plans, or none ([Note: re-plans agreed])
                self.slots.check_shared_copies()  # deferred updates: [Note: the shared copy checked once per
                executor.agree(ctx.dp.agree_replan(executor.stale or executor.refit))  # backward] (node_share.py)
            executor.departures.step_ended(ctx.module)  # [Note: steps that keep departing] (departures.py)
            with torch.no_grad():
                executor.after_step(updated, self.recompute)
            ctx.lane_log.step_done(executor.recorder, ctx.memory)

    @idle_params.engine_code
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        self.grads.check_can_clip()
        faults.check_backward_finished(self, "clip_grad_norm_")
        self.grads.exposure.to_engine_form()  # issue 19: user edits of p.grad in, norms fresh
        return self.grads.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    @idle_params.engine_code
    def zero_grad(self, set_to_none: bool = True) -> None:
        faults.check_backward_finished(self, "zero_grad()")
        self.passes.step_ran()
        self.grads.zero_grad(set_to_none)

    def wait_for_updates(self) -> None:
        """Every update is done and the host holds its result (for a reader of the host arena)."""
        try:
            self.grads.device.flush_postponed()  # issue 18: first updates waiting for the device run on the host
            self.slots.check_shared_copies(early=True)  # issue 20: a read inside the backward that updated
            self.ctx.cpu.drain()
            if self.ctx.dp is not None:  # issue 20: the weights' copies back from their gather on the device
                self.ctx.dp.settle()
        finally:  # issue 18: even after a CPU-lane fault, device-homed state gets the host copy close() restores
            with self.ctx.backend.compute(), torch.no_grad():
                self.grads.device.sync_to_host()  # device-optimizer state, if the host copy is stale

    def adopt_optimizer_state(self) -> None:
        """``optimizer.load_state_dict`` wrote the host's Adam state: point the optimizer at it, and copy it
        to the device where the plan keeps it there."""
        self.weights.adopt_optimizer_state()
        with self.ctx.backend.compute(), torch.no_grad():
            self.grads.device.reload()

    def close(self) -> None:
        """Give every parameter its trained fp32 value back as an ordinary tensor, and stop the threads."""
        ctx = self.ctx
        self.remove_hooks()
        self.grads.exposure.close()  # issue 19: exposed p.grad taken back (they would point into the freed arena)
        # Every part is released even where one raises (issue 20: after a data-parallel fault the lane's
        # error, or a gather the other ranks no longer answer, must not leave threads and arenas behind);
        # the first error is raised at the end.
        errors: list[BaseException] = []
        releases = [self._finish_updates, self.weights.restore, ctx.cpu.close, ctx.backend.close, self.slots.close,
                    self.executor.close] + ([ctx.dp.release] if ctx.dp is not None else [])
        for release in releases:
            try:
                release()
            except BaseException as e:  # noqa: BLE001 - raised below, once everything is released
                errors.append(e)
        idle_params.disown(ctx.params)
        ctx.phases.become(Lifecycle.CLOSED)
        if errors:
            raise errors[0]
        if ctx.dp is not None:  # issue 20: closed cleanly, but the weights may be this rank's alone
            ctx.dp.after_close()

    def _finish_updates(self) -> None:
        try:
            self.wait_for_updates()
            self.ctx.backend.synchronize()
        except OffloadError:
            if self.ctx.dp is None or self.ctx.dp.failed is None:
                raise  # else: the data-parallel fault this rank already raised (its lane's copy of it)
