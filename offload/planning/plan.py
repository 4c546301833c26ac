"""The plan model: what the scheduler decides, as frozen data the runtime executes (:class:`Plan`, its
:class:`Buffer` s and per-event :class:`EventActions`), and :func:`validate_plan`, the invariants the runtime
relies on.

[Note: event positions] A buffer lives on the half-open interval [start, end) of event indices. At event
``i`` the runtime (1) releases the buffers whose ``end == i`` (recording "compute done with it"),
(2) issues the copies of buffers whose ``start == i`` (each waits for the release of the earlier
buffers that share its memory: ``Buffer.after``), then (3) waits for the buckets event ``i`` needs.
Because of (1) before (2), two buffers with touching intervals may share memory.

[Note: waits on earlier buffers] ``Buffer.after`` lists, for each byte of a buffer's memory, the buffer
that last released that byte before it: its memory's last occupants, not every earlier one (that list
grows with the square of the buffers: 10^7 entries for 10,000 streamed buckets). That is enough: an
occupant ``j`` was itself written only after the occupants before it were released (its own ``after``)
and released only after compute was done with it, so once ``j``'s release event has completed, so have
theirs. It relies on every buffer that ended before this one having run in this step, which holds
while the runtime is on the plan (it issues and releases buffers in event order, and leaves the plan,
fetching on demand, at the first departure).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import InvariantError
from .buckets import Bucket, locate
from .placement import Placement, state_nbytes
from .simulate import SimResult
from .trace import Trace

ARENA_ALIGN = 256  # bytes; every bucket view starts on a 256-byte boundary (what cudaMalloc gives)


class BufferKind(enum.Enum):
    PARAM = "param"
    """A bucket's parameters on the device."""
    GRAD = "grad"
    """A bucket's gradient slot: grads are gathered here, then copied to the host in one transfer."""
    STATE = "state"
    """A device-optimizer bucket's fp32 optimizer state for the whole step (master where the weights are
    16-bit, then m, then v; ``placement.state_nbytes``): updated there, never copied (issue 18)."""


@dataclass(frozen=True)
class Buffer:
    bucket: int
    kind: BufferKind
    start: int
    end: int
    size: int
    offset: int
    after: tuple[int, ...]  # last earlier occupants of its memory: writing it waits for their release
    # (see [Note: waits on earlier buffers])


@dataclass(frozen=True)
class EventActions:
    release: tuple[int, ...] = ()  # buffer ids whose last use is over
    prefetch: tuple[int, ...] = ()  # buffer ids whose host-to-device copy is issued here
    need: tuple[int, ...] = ()  # buckets that must have arrived before this event's compute


@dataclass(frozen=True)
class Plan:
    buckets: tuple[Bucket, ...]
    trace: Trace
    resident: tuple[int, ...]  # buckets kept on the device across steps
    buffers: tuple[Buffer, ...]
    actions: tuple[EventActions, ...]  # one per trace event
    grad_buffer: tuple[int | None, ...]  # per bucket: its grad slot buffer id this step
    resident_buffer: tuple[int | None, ...]  # per bucket: its whole-step buffer id if resident
    arena_bytes: int
    lower_bound_bytes: int
    budget_bytes: int
    fixed_bytes: int  # module buffers and other engine memory outside the arena
    itemsize: int  # bytes per element of the compute dtype on the device
    strategy: str
    simulated: SimResult | None = None  # the cost model's prediction for this plan (greedy plans)
    hw_name: str = ""  # the hardware model that prediction used
    # what the backend's runtime holds beyond the plan (cuBLAS workspaces, allocator rounding; 0 on the CPU
    # backend): kept out of the budget ([Note: headroom] in backend/cuda.py)
    headroom_bytes: int = 0
    # per bucket: where it lives and where its optimizer runs (issue 18). Only ``build_plan(...,
    # device_optimizer=True)`` makes DEVICE_OPTIMIZER buckets; a plan from before this field (empty) reads as
    # resident/streamed by ``resident``
    placement: tuple[Placement, ...] = ()
    state_buffer: tuple[int | None, ...] = ()  # per bucket: its STATE buffer id (device-optimizer buckets)
    # the cost model's update mode: True where updates are deferred to step() (``overlap_optimizer=False``),
    # so device-optimizer buckets' grads make a round trip through the host ([Note: the deferred round trip]
    # in simulate.py)
    deferred: bool = False
    # the cost model's refresh: True where ``simulated`` pipelines resident buckets' refreshes as the runtime
    # does with overlapped updates ([Note: the refresh pipelined, modelled] in simulate.py;
    # ``build_plan(..., refresh_pipelined=True)``), False where it refreshes them after the drain
    refresh_pipelined: bool = False

    def placement_of(self, b: int) -> Placement:
        if self.placement:
            return self.placement[b]
        return Placement.RESIDENT if b in self.resident else Placement.STREAMED

    @property
    def device_optimizer(self) -> tuple[int, ...]:
        """Buckets whose optimizer state lives and is updated on the device."""
        return tuple(b for b, p in enumerate(self.placement) if p is Placement.DEVICE_OPTIMIZER)

    @property
    def activation_bytes(self) -> int:
        return self.trace.activation_peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Planned device peak: arena + activations + fixed + the largest grad autograd materialises + the
        backend's headroom."""
        return (self.arena_bytes + self.trace.activation_peak_bytes + self.fixed_bytes + self.trace.max_grad_bytes
                + self.headroom_bytes)

    @property
    def capacity_bytes(self) -> int:
        """What the budget leaves for the arena: budget - activations - fixed - largest grad - headroom."""
        return (self.budget_bytes - self.trace.activation_peak_bytes - self.fixed_bytes - self.trace.max_grad_bytes
                - self.headroom_bytes)

    def summary(self) -> dict:
        resident = set(self.resident)
        streamed = [b for b in range(len(self.buckets)) if b not in resident]
        fetches = sum(1 for x in self.buffers if x.kind is BufferKind.PARAM and x.bucket not in resident)
        return {
            "num_buckets": len(self.buckets),
            "resident_buckets": len(self.resident),
            "streamed_buckets": len(streamed),
            "fetches_per_step": fetches,
            "largest_bucket_bytes": max((b.nbytes(self.itemsize) for b in self.buckets), default=0),
            "arena_bytes": self.arena_bytes,
            "arena_lower_bound_bytes": self.lower_bound_bytes,
            "activation_bytes": self.activation_bytes,
            "planned_peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "strategy": self.strategy,
            "events": len(self.trace.events),
            "predicted_step_s": self.simulated.step_s if self.simulated is not None else None,
            "hw": self.hw_name,
        }


def align(n: int) -> int:
    """``n`` bytes rounded up to :data:`ARENA_ALIGN`."""
    return (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN


def validate_plan(plan: Plan) -> None:
    """Check the invariants the runtime relies on; raise :class:`~offload.errors.InvariantError` naming the
    first violation (a bug in the planner)."""
    n = len(plan.trace.events)
    bucket_of = locate(plan.buckets)[0]
    live: list[list[int]] = [[] for _ in range(n)]
    for k, x in enumerate(plan.buffers):
        _check(0 <= x.start < x.end <= n, f"buffer {k} has a bad interval [{x.start}, {x.end})")
        _check(x.offset % ARENA_ALIGN == 0 and x.offset + x.size <= plan.arena_bytes, f"buffer {k} outside arena")
        for i in range(x.start, x.end):
            live[i].append(k)
    for i in range(n):
        on_device = {plan.buffers[k].bucket for k in live[i] if plan.buffers[k].kind is BufferKind.PARAM}
        for p in plan.trace.uses[i]:
            _check(bucket_of[p] in on_device, f"event {i} needs bucket {bucket_of[p]}, which is not on the device")
        spans = sorted((plan.buffers[k].offset, plan.buffers[k].offset + plan.buffers[k].size) for k in live[i])
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            _check(a1 <= b0, f"two live buffers overlap in memory at event {i}")
    for k, x in enumerate(plan.buffers):
        for j in x.after:
            y = plan.buffers[j]
            _check(y.end <= x.start, f"buffer {k} waits on buffer {j}, which is still live")
    _check(plan.peak_bytes <= plan.budget_bytes,
           f"planned peak {plan.peak_bytes} exceeds the budget {plan.budget_bytes}")
    _validate_placement(plan)


def _validate_placement(plan: Plan) -> None:
    """Each bucket's placement agrees with its buffers: a streamed bucket is not resident; a resident one has
    its whole-step buffer; a device-optimizer bucket also has grads (its update needs them) and a STATE
    buffer of its state's size for the whole step, and no other bucket has one."""
    nb, n = len(plan.buckets), len(plan.trace.events)
    if not plan.placement:
        if plan.state_buffer or any(x.kind is BufferKind.STATE for x in plan.buffers):
            raise InvariantError("a plan without placements has optimizer state buffers")
        return
    if len(plan.placement) != nb or len(plan.state_buffer) != nb:
        raise InvariantError(f"placement/state_buffer need one entry per bucket ({nb})")
    resident = set(plan.resident)
    states = {x.bucket: k for k, x in enumerate(plan.buffers) if x.kind is BufferKind.STATE}
    for b, where in enumerate(plan.placement):
        if (where is Placement.STREAMED) == (b in resident):
            raise InvariantError(f"bucket {b} is {where.value} but {'' if b in resident else 'not '}resident")
        if where is not Placement.STREAMED and plan.resident_buffer[b] is None:
            size = plan.buckets[b].nbytes(plan.itemsize)
            if size:
                raise InvariantError(f"resident bucket {b} has no whole-step buffer")
        want = state_nbytes(plan.buckets[b], plan.itemsize) if where is Placement.DEVICE_OPTIMIZER else 0
        k = plan.state_buffer[b]
        if k != states.get(b) or (want > 0) != (k is not None):
            raise InvariantError(f"bucket {b} ({where.value}) has state buffer {k}, expected "
                                 f"{'one' if want else 'none'}")
        if k is not None:
            x = plan.buffers[k]
            if (x.start, x.end, x.size) != (0, n, want):
                raise InvariantError(f"bucket {b}'s state buffer is [{x.start}, {x.end}) of {x.size} B, not the "
                                     f"whole step of {want} B")
        if where is Placement.DEVICE_OPTIMIZER and plan.grad_buffer[b] is None:
            raise InvariantError(f"bucket {b} keeps its optimizer on the device but gets no grads")


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(f"invalid plan: {what}")
