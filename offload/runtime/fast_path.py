"""The fast path: a training step that provably needs none of the per-call machinery runs without it.

[Note: the fast path] (issue 17, "The hot path") Per module call the full path runs a forward pre- and
post-hook, the use detector (a ``TorchFunctionMode``) on every tensor op and the saved-tensor pack/unpack
hooks; their mechanisms alone cost ~20 us per call on our CPU (benchmarks/results/cpu-2026-11-26/
overhead-profile.md, 1a). On a plan where every bucket is resident for the whole step and nothing is
checkpointed they decide nothing: every weight is on the device, in a slot nothing else writes during the
step (but the bucket's own device update, after its last grad: [Note: device updates on a fast step]), so
saved weight views stay valid as they are. A step runs the fast path when its root call

* is a training forward (grad enabled, not inference mode) of the root module, with no other forward open;
* follows ``train_plan``, and that plan keeps every bucket's weights resident (with the host optimizer, or
  the device's: [Note: device updates on a fast step]), checkpoints nothing, and gave every trainable
  parameter a grad in the step it was planned from (``allows``);
* has the *signature* (shapes, dtypes, devices of the tensors in its arguments, the other arguments' values,
  the root's training flag, the caller's autocast) of a full step that followed this same plan to its end
  (``verify``; up to ``_MAX_VERIFIED`` signatures per plan: a full step with larger activations would have
  made the plan stale, so each one verified fits the plan).

Such a step runs with the hooks of every module below the root removed (they are put back, by the Runtime,
for the first step that is not fast), no use detector and no saved-tensor hooks. What they did is done so:

* waits: a bucket whose copy is in flight (the new weights after ``step()``) is waited for at the root, and,
  while the hooks are removed, already when the copy is issued (``settle``): a submodule called directly
  (no hook sees it) reads landed weights. On a GPU that wait is a stream wait, but the first layers' compute
  no longer overlaps the upload of the last ones;
* grads: a bucket is complete when every trainable parameter of it has its grad (the step's ``touched`` is
  every trainable parameter, see ``begin``); one whose parameters did not all get a grad (a data-dependent
  branch skipped a module) is sent at the end of backward (``GradPipeline.flush``), with the grads that came,
  as plain torch gives the others none. No grad can be missed: no bucket goes before all of its grads came;
* per grad: a grad that comes in the plan's order (``in_order``) stays in ``p.grad`` until its bucket's last
  grad in that order came; then the bucket is gathered at once (``GradPipeline.gather_bucket``: [Note: one
  hook's work per bucket]). Where holding a bucket's grads at once would not fit the budget, each in-order
  grad is gathered as it comes by ``GradPipeline.gather_in_order``: one ``copy_`` into its cached slot view
  and the completion test, as ``gather`` does. Either way their bytes count in the accounted peak
  (``DeviceMemory.passing``) instead of being added and taken off again with a timeline sample each. A
  bucket's first grad (per grad), and every grad out of order, go through ``gather`` as on the full path;
* departures: the fast forward cannot see module calls, so a different path is noticed where it matters, in
  backward: grads arrive in the plan's order (its GRAD events) or the step departs (``grad``). A departure
  moves grads gathered in plan buffers out of the arena and gathers the rest on demand (the plan's buffer
  lifetimes no longer hold), keeps every resident weight in place (saved views point there), counts a
  departure and drops the verification: the next step runs the full path, which departs and re-plans as it
  always did. A fast step's record (no uses, no saved-weight reads) is never planned from: nothing in it
  marks the plan stale, and ``PlanExecutor.record_step`` is not called;
* what the fast path cannot see: a forward with the verified signature whose module calls differ but whose
  grads come in the planned order (a data-dependent loop count) keeps its resident weights correct (a device
  bucket read after its update in place is refused: [Note: a departed step's updates wait]) but its
  activations are not measured; it is noticed only if its grads differ. Nor does it count activations at
  all: on the CPU backend (no allocator to ask) ``memory_stats()``'s accounted current bytes and parts leave
  a fast step's activations out (the peak keeps what full steps measured), a fast step's window learns no
  transients (on CUDA it took its activations for some: [Note: transients] in accounting.py), and
  ``export_timeline`` shows a fast step's root call only.

[Note: one hook's work per bucket] (issue 17, the hot path) Per grad, the full work (a ``copy_`` into the slot,
``p.grad = None``, the completion test) cost ~8 us of Python per parameter on our CPU. On a fast step every
grad comes in the plan's order or the step departs, so the plan says which grad completes each bucket
(``closes``): the hook of any other grad only checks the order and returns, its grad waiting in ``p.grad`` as
plain torch leaves it; the completing grad's hook copies the whole bucket with one ``torch._foreach_copy_``
(the same bytes as one ``copy_`` each) and sends it. The order check is the hook's first test, one identity
compare: once the step's backward began (``arm``, from the runtime's grad path), ``expect`` is the parameter
whose grad is the plan's next one if that grad only waits, and None otherwise (it closes a bucket, the step
departed or the backward ended: ``_disarm``); a hook whose parameter ``is`` it moves the position on
(``took_waiting``) and returns, every other grad takes the runtime's path as before. A slot the bucket's grads
fill whole (no padding between parameters) is not cleared before that copy, which writes each of its
elements (``GradPipeline.gather_bucket``). What this changes, and why it is safe:

* memory: a bucket's grads are held together until its last one (the plan counted one grad at a time), so
  ``allows`` takes it only where the plan's peak, less its largest grad, plus the largest bucket's grads fits
  the budget; elsewhere grads go one by one as before. The accounted peak counts the bucket's bytes at once;
* departures: any grad out of order, and the end of backward, first gather the grads still waiting
  (``waiting``), in the order they came, exactly as they would have been gathered had they not waited; then
  the departure proceeds as before. A backward that raises counts them as arrived (they are dropped with the
  rest: ``Runtime.abort_backward``);
* what a user's hook sees: between its arrival and its bucket's last grad a parameter shows its grad in
  ``p.grad`` (as plain torch would), where it showed None before.

[Note: sent after backward] (issue 17, the hot path) Where the CPU lane runs its work on the thread that issues it
(the CPU backend's inline mode, the users' default there: [Note: inline copies] in backend/cpu.py), sending a bucket
at its last grad overlaps nothing: the copies and the AdamW run on autograd's thread between its nodes, and only
evict backward's working set from the caches. So there (``allows``: ``at_end``; with overlapped updates and no data
parallel, and only where all of the grads held at once fit the budget beside the plan's peak) every grad of a fast
step waits in ``p.grad``, the closing ones too, and the runtime sends the complete buckets at the end of backward
(``complete``, from ``Runtime._gather_waiting``), in the order their last grads came, each by the same routine
([Note: one routine per fast bucket] in bucket_send.py): the same copies and updates in the same order, after the
same waits, later; on the CPU backend all of them in one CPU-lane item ([Note: sent as one batch] there). A departure sends the complete ones first, as the end of backward does, then the rest grad by
grad as before. What changes: the accounted peak holds all of the grads at once (``DeviceMemory.passing``), and a
user's grad hook sees every earlier grad still in ``p.grad``, as plain torch shows it. Measured on the 200-module
MLP of ``benchmarks/overhead.py`` (AMD EPYC VM): ~0.2 ms of CPU a step less (overhead-profile.md, section 14); the
same work moved after backward in plain torch (a copy of each bucket's grads and an AdamW-like pass, by hooks or
after) costs 0.37 ms less there. On CUDA, and with the CPU backend's lanes on threads, nothing changes: the lane is
a thread, and each bucket still goes at its last grad, overlapped with backward.

[Note: device updates on a fast step] (issue 18's placement on the fast path) A plan whose buckets all keep their
weights in their slot for the whole step runs fast whether a bucket's optimizer is on the host
(``Placement.RESIDENT``) or on the device (``DEVICE_OPTIMIZER``). Before, only the former did: on an H200 (run 8)
gpt2-xl at 8 GiB with ``device_optimizer=True`` had one device bucket and 385 resident ones, and took the full
path every step (0.690 s a step against 0.550 s without the device tier, 4 of 5 of whose steps were fast). A device
bucket's grads go by the general chain (``FastSend.route`` declines a bucket the device owns): ``gather_bucket``,
``_grad_slot`` (its waits), ``finish``, ``DeviceOptimizer.update`` at the bucket's last grad; deferred, through the
host sums to ``update_summed`` in ``step()``, where the float16 overflow skip and the clip factor apply: the same
calls, waits and numbers as the full path's. What the full path's hooks did that a fast step does without:

* saved weight views: the update writes the bucket's weights in place during backward. The full path's unpack
  rebuilds a saved view from the bucket's slot as it is then, so it would read the new weights too: neither
  path's hooks protect a read after the update, the plan does. Autograd reads a weight only in the nodes that
  give it a grad, all before its accumulator fires (tied weights, a module called twice: one accumulator, after
  every use); a bucket some node reads after its last grad (a detached use) is run with the host optimizer by
  ``DeviceOptimizer.activate`` on both paths ([Note: read after the update] in device_optim.py). A fast step
  follows a plan a full step of the same root call verified, and one whose grads come in another order departs;
  a read its plan did not have (a data-dependent branch) raises, since the update bumps the version counters
  ([Note: a departed step's updates wait] in device_optim.py);
* ``create_graph``: the full path's unpack hands a graph-building backward a copy of the weight view
  (``ParamAccess.graph_copy``), a fast step the view itself. The graph it builds reads it in nodes that give the
  weight a grad, before its update (a gradient penalty, ``backward(create_graph=True)``: torch's numbers, tested).
  A graph kept past the step reads the new weights, as on a host-optimizer fast step after ``step()``'s refresh;
* where the update runs: at its bucket's last grad, as on the full path, never at the end of backward ([Note: sent
  after backward]: ``_at_end`` is off for such plans): a 16-bit bucket's update widens its grads piecewise in the
  room the plan keeps for the largest grad ([Note: widening 16-bit grads]), which grads held to the end of backward
  would take;
* a departure keeps the arena (``leave_keeping_weights``), so the device still owns its buckets: the rest of the
  step's device buckets are updated on the device from on-demand slots (a full step's departure hands the state
  to the host and updates them on the CPU); the same numbers, tested. A re-plan's new placement runs the full path
  until a full step verifies it; the state moves between tiers as before (``activate``/``deactivate``).

Not measured on a GPU: what a fast step saves for gpt2-xl's device-optimizer plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import torch

from ..errors import InvariantError
from ..planning.placement import Placement
from ..planning.trace import EventKind
from .phases import Lifecycle, Pass
from .residency import Residency

if TYPE_CHECKING:
    from ..planning.plan import Plan
    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .grads import GradPipeline
    from .slots import SlotTable

Signature = tuple[Hashable, ...]
_MAX_VERIFIED = 8  # root-call signatures kept per plan (a short last batch, a few sequence lengths)
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _Unknown(Exception):
    """An argument the signature cannot describe: the step takes the full path."""


def call_signature(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   device_type: str) -> Signature | None:
    """What decides a forward's path and activation sizes, as far as the root call shows it (with the
    caller's autocast, which changes activations' dtypes); None for an argument it cannot describe (then
    the full path runs)."""
    autocast = torch.is_autocast_enabled(device_type)
    try:
        return (module.training, autocast, torch.get_autocast_dtype(device_type) if autocast else None,
                _describe(args), _describe(kwargs))
    except _Unknown:
        return None


def _describe(a: Any, depth: int = 0) -> Hashable:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.device, a.requires_grad, a.layout)
    if isinstance(a, _SCALARS):
        return (type(a), a)
    if depth < 4 and isinstance(a, (tuple, list)):
        return (type(a), tuple(_describe(x, depth + 1) for x in a))
    if depth < 4 and isinstance(a, dict):
        return (dict, tuple((k, _describe(v, depth + 1)) for k, v in a.items()))
    raise _Unknown


# placements whose weights stay in their slot for the whole step ([Note: device updates on a fast step])
_WHOLE_STEP = (Placement.RESIDENT, Placement.DEVICE_OPTIMIZER)
Closing = tuple[int, tuple[int, ...], int]  # a bucket, its parameters in the plan's grad order, their grads' bytes


class _Allowed:
    """What ``FastPath.allows`` found for one plan (computed once per plan)."""

    __slots__ = ("plan", "ok", "grad_keys", "closes", "at_end", "waiters")

    def __init__(self, plan: Plan, ok: bool, grad_keys: tuple[int, ...], closes: dict[int, Closing] | None,
                 at_end: bool, params: Sequence[torch.nn.Parameter]) -> None:
        self.plan, self.ok, self.grad_keys, self.closes, self.at_end = plan, ok, grad_keys, closes, at_end
        # per position in grad_keys: the parameter whose grad only waits there (None: it closes a bucket, or
        # every grad is gathered as it comes); one None past the end ([Note: one hook's work per bucket]).
        # ``at_end``: every grad waits, its bucket sent at the end of backward ([Note: sent after backward])
        self.waiters: tuple[torch.nn.Parameter | None, ...] = (
            tuple(None if closes is None or (k in closes and not at_end) else params[k] for k in grad_keys) + (None,))


class FastPath:
    """Decides which steps run the fast path and keeps track of one such step (see [Note: the fast path])."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor, grads: GradPipeline,
                 remove_hooks: Callable[[], None], restore_hooks: Callable[[], None]) -> None:
        self.ctx = ctx
        self.slots = slots
        self.executor = executor
        self.grads = grads
        self._remove_hooks = remove_hooks  # the Runtime's: hooks of modules below the root off / back on
        self._restore_hooks = restore_hooks
        self.hooks_removed = False
        # root calls (signatures) with which a full step followed ``verified_plan`` to its end
        self.verified_plan: Plan | None = None
        self.verified: set[Signature] = set()
        self.candidate: Signature | None = None  # this full step's root call, verified if it follows its plan
        self.on = False  # this step (root forward .. end of its backward) runs the fast path
        self.forward_open = False  # a fast forward ended and its backward has not
        self._allowed: _Allowed | None = None
        self._trainable: dict[int, None] = {i: None for i, s in enumerate(ctx.specs) if s.group is not None}
        self._grad_keys: tuple[int, ...] = ()
        self._pos = 0  # next GRAD event of the plan
        # this step's last grad of each bucket -> what to gather then; None: each grad gathered as it comes
        self.closes: dict[int, Closing] | None = None
        self.at_end = False  # this step's buckets are sent after its backward ([Note: sent after backward])
        self.departed = False
        # The parameter whose grad is the plan's next one and only waits in p.grad: set (``arm``) once a fast
        # step's backward began, kept in step with the position, None otherwise. The grad hook compares its
        # parameter with it before anything else ([Note: one hook's work per bucket])
        self.expect: torch.nn.Parameter | None = None
        self._armed = False
        self._waiters: tuple[torch.nn.Parameter | None, ...] = (None,)

    # -- which steps ---------------------------------------------------------------------------------------

    def allows(self, plan: Plan) -> _Allowed:
        """Whether ``plan`` can run fast at all (cached per plan): every bucket's weights resident for the whole
        step (with the host optimizer, or the device's: [Note: device updates on a fast step]), no recompute,
        every trainable parameter touched and given a grad by the step it was planned from."""
        hit = self._allowed
        if hit is not None and hit.plan is plan:
            return hit
        trace = plan.trace
        grads = tuple(e.key for e in trace.events[trace.num_forward:] if e.kind is EventKind.GRAD)
        ok = (self.ctx.config.activation_checkpointing is None
              and len(plan.resident) == len(plan.buckets)
              and all(plan.placement_of(b) in _WHOLE_STEP for b in range(len(plan.buckets)))
              and all(e.kind is not EventKind.RECOMPUTE for e in trace.events)
              and len(set(grads)) == len(grads) and set(grads) == set(self._trainable)
              and set(self._trainable) <= set(trace.touched))
        closes = self._closings(plan, grads) if ok else None
        self._allowed = _Allowed(plan, ok, grads, closes, self._at_end(plan, closes), self.ctx.params)
        return self._allowed

    def _at_end(self, plan: Plan, closes: dict[int, Closing] | None) -> bool:
        """Whether a fast step's buckets are sent after backward ([Note: sent after backward]): where the CPU
        lane runs its work on the thread that issues it (nothing would overlap backward), the buckets go by the
        one routine (overlapped updates, no data parallel: bucket_send.py), all of the grads held at once
        fit the budget beside the plan's peak, and no bucket's optimizer is on the device."""
        if (closes is None or not self.ctx.cpu.inline or self.grads.deferred or self.ctx.dp is not None
                or plan.device_optimizer):  # [Note: device updates on a fast step]: at their last grad
            return False
        held = sum(c[2] for c in closes.values())
        return plan.peak_bytes - plan.trace.max_grad_bytes + held <= plan.budget_bytes

    def _closings(self, plan: Plan, grads: tuple[int, ...]) -> dict[int, Closing] | None:
        """Per bucket's last grad in the plan's order: the bucket, its grads in that order and their bytes
        ([Note: one hook's work per bucket]); None where holding a whole bucket's grads at once would not fit
        the budget beside the plan's peak (which counts one grad at a time): then each grad goes on its own."""
        bucket_of, specs, itemsize = self.slots.bucket_of, self.ctx.specs, self.ctx.itemsize
        order: dict[int, list[int]] = {}
        for p in grads:
            order.setdefault(bucket_of[p], []).append(p)
        out = {ps[-1]: (b, tuple(ps), sum(specs[p].numel for p in ps) * itemsize) for b, ps in order.items()}
        held = max((c[2] for c in out.values()), default=0)
        if plan.peak_bytes - plan.trace.max_grad_bytes + held > plan.budget_bytes:
            return None
        return out

    def wants(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """The root module's forward begins (no forward open): run it fast? If not, the hooks are back on
        before any submodule runs, and a training call's signature is kept to be verified."""
        self.candidate = None
        self.on = False
        fast = False
        if (self.ctx.phases.lifecycle is Lifecycle.RUNNING and torch.is_grad_enabled()
                and not torch.is_inference_mode_enabled()):
            sig = call_signature(module, args, kwargs, self.ctx.backend.device.type)
            self.candidate = sig
            plan = self.executor.train_plan
            fast = (sig is not None and plan is not None and plan is self.verified_plan and sig in self.verified
                    and not self.forward_open and not self.ctx.phases.in_backward and self.allows(plan).ok)
        self.forward_open = False
        if fast:
            if not self.hooks_removed:
                self._remove_hooks()
                self.hooks_removed = True
        else:
            self.restore()
        return fast

    def verify(self) -> None:
        """The end of a full step's backward: it followed ``train_plan`` to its end, and that plan was not
        found stale: steps with the same root call may run fast."""
        executor = self.executor
        plan = executor.train_plan
        sig, self.candidate = self.candidate, None
        if (sig is not None and plan is not None and executor.plan is plan and executor.followed()
                and not executor.stale and self.allows(plan).ok):
            if plan is not self.verified_plan:
                self.verified_plan, self.verified = plan, set()
            if len(self.verified) < _MAX_VERIFIED:
                self.verified.add(sig)

    def restore(self) -> None:
        """Hooks below the root back on (the next step takes the full path unless it is verified)."""
        if self.hooks_removed:
            self._restore_hooks()
            self.hooks_removed = False

    def drop(self) -> None:
        """In doubt (a departure, a fault, other weights): no step runs fast before a full one verifies."""
        self.verified_plan, self.verified = None, set()
        self.on = False
        self.forward_open = False
        self._disarm()
        self.restore()

    # -- one fast step --------------------------------------------------------------------------------------

    def begin(self) -> None:
        """The fast forward begins (after ``Runtime._begin_forward``): its touched set is every trainable
        parameter (what the grad pipeline waits for per bucket), and it waits for copies in flight."""
        executor = self.executor
        plan = executor.plan
        if plan is None or plan is not executor.train_plan or not executor.on_plan:
            raise InvariantError("a fast step began off its plan")
        self.on = True
        self.departed = False
        self._pos = 0
        self._disarm()
        allowed = self.allows(plan)
        self._grad_keys = allowed.grad_keys
        self.closes = allowed.closes
        self.at_end = allowed.at_end
        self._waiters = allowed.waiters
        executor.recorder.touched = self._trainable
        self.ctx.stats["fast_steps"] += 1
        self.settle()

    def forward_ended(self) -> None:
        self.forward_open = True

    def in_order(self, p: int) -> bool:
        """Parameter ``p``'s grad is the plan's next one in a step that has not departed (counted as
        :meth:`grad` counts it); False leaves the position as it is, for :meth:`grad` to decide."""
        pos = self._pos
        keys = self._grad_keys
        if not self.departed and pos < len(keys) and keys[pos] == p:
            self._pos = pos + 1
            if self._armed:
                self.expect = self._waiters[pos + 1]
            return True
        return False

    def arm(self) -> None:
        """A fast step's backward began (the runtime's ``_begin_backward`` ran): from now on a grad that is the
        plan's next one and closes no bucket is taken by the grad hook's first test, ``param is
        fast.expect``, then :meth:`took_waiting` (see [Note: one hook's work per bucket])."""
        if self.on and not self.departed and self.closes is not None:
            self._armed = True
            self.expect = self._waiters[self._pos]

    def took_waiting(self) -> None:
        """The grad of :attr:`expect` came: it waits in ``p.grad`` for its bucket's last grad, and its hook has
        nothing else to do. Counted as :meth:`in_order` counts it (~1 us less per such grad than that test in
        the hook: no index lookup, no method call before the identity test, no set lookup)."""
        pos = self._pos + 1
        self._pos = pos
        self.expect = self._waiters[pos]

    def _disarm(self) -> None:
        self._armed = False
        self.expect = None

    def waiting(self) -> list[int]:
        """The grads that came in the plan's order and wait in ``p.grad`` for their bucket's last one, in the
        order they came ([Note: one hook's work per bucket]); the caller gathers them. None after a departure:
        those that waited were gathered before it, and no grad waits after it."""
        closes, pos = self.closes, self._pos
        if closes is None or not self.on or self.departed or pos == 0:
            return []
        received, bucket_of = self.grads.received, self.slots.bucket_of
        got = [p for p in self._grad_keys[:pos] if p not in received.get(bucket_of[p], ())]
        return got

    def complete(self) -> list[Closing]:
        """[Note: sent after backward]: the buckets whose grads all came in the plan's order and wait in
        ``p.grad``, in the order their last grads came; the caller sends them (before :meth:`waiting`'s rest)."""
        closes, pos = self.closes, self._pos
        if not self.at_end or closes is None or not self.on or self.departed:
            return []
        finished = self.grads.finished
        return [c for c in map(closes.get, self._grad_keys[:pos]) if c is not None and c[0] not in finished]

    def grad(self, p: int) -> None:
        """Parameter ``p``'s grad arrives (before it is gathered): in the plan's order, or the step departs."""
        if not self.on:
            self._unseen_forward()
        pos = self._pos
        keys = self._grad_keys
        if pos < len(keys) and keys[pos] == p:
            self._pos = pos + 1
        elif not self.departed:
            self._depart()

    def _unseen_forward(self) -> None:
        """A backward whose forward no hook saw (a submodule called directly while the hooks are removed):
        its grads are gathered as a departed fast step's."""
        if self.ctx.phases.current is not Pass.IDLE:
            raise InvariantError("a grad arrived outside backward")
        self.grads.reset_step()  # the previous backward's received / finished buckets are not this one's
        self.executor.recorder.touched = self._trainable
        self.on = True
        self.departed = False
        self._pos = 0
        self._depart()

    def _depart(self) -> None:
        self.departed = True
        self._disarm()
        self.executor.leave_keeping_weights()

    def backward_ended(self) -> None:
        """The end of a fast step's backward: a missing grad is a departure too (their buckets were flushed)."""
        if not self.departed and self._pos != len(self._grad_keys):
            self.departed = True
            self.ctx.stats["plan_departures"] += 1
        self.on = False
        self.forward_open = False
        self._disarm()
        if self.departed:
            self.drop()

    def lands_at_once(self) -> bool:
        """Whether :meth:`settle` lands every copy in flight as soon as it is issued."""
        return self.hooks_removed or self.on

    def settle(self) -> None:
        """Copies into slots were issued: while the hooks are removed (or in a fast step) compute waits for
        them now, as nothing else would make it wait before a weight is read."""
        if not self.lands_at_once():
            return
        slots = self.slots
        try:
            for b, state in enumerate(slots.state):
                if state is Residency.IN_FLIGHT:
                    self.executor.need(b)
        except BaseException:
            # [Note: a refresh that did not land] Copies issued while this lands them at once kept their parameters
            # bound to the slot (``SlotTable.copy_in``'s ``keep_bound``: nothing could read them before the wait).
            # A wait that raised (the bucket's AdamW failed: the copy waited for it) breaks that: the buckets still
            # in flight show their placeholders, as [Note: parameters show landed slots] in slots.py has it. Left
            # bound, the next forward's ParamGuard found them pointing at their slot, not where the slot table
            # says they point, and raised a false "parameters ... changed outside the engine" (".data
            # reassigned") instead of the failure itself; a read between showed the slot's old bytes
            for b, state in enumerate(slots.state):
                if state is Residency.IN_FLIGHT:
                    slots.unbind(b)
            raise
