"""What every backend shares: the :class:`Backend` protocol the runtime calls, events that carry errors, and
lanes (ordered worker threads)."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Protocol, Sequence, runtime_checkable

import torch

from ..errors import EngineClosedError, InvariantError, OffloadError

if TYPE_CHECKING:
    from ..host.arena import HostArena
    from ..host.node_copy import NodeCopy


class Event(Protocol):
    """A point in some stream of work. ``synchronize`` blocks the calling thread until it is done
    and re-raises the failure of the work it marks."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Timer(Protocol):
    """A clock on compute's own timeline ([Note: timing compute] in offload/runtime/executor.py): ``mark()``
    notes where compute has got to, ``seconds(marks)`` says, for each mark, how many seconds after the
    first one compute reached it, blocking until the last of ``marks`` is reached: that one must be the
    latest made."""

    def mark(self) -> object: ...

    def seconds(self, marks: Sequence[object]) -> list[float]: ...


class HostTimer:
    """The host's clock: on the CPU backend compute runs on the calling thread, so where the host is, compute is."""

    mark = staticmethod(time.perf_counter)

    @staticmethod
    def seconds(marks: Sequence[object]) -> list[float]:
        first = marks[0] if marks else 0.0
        return [m - first for m in marks]  # type: ignore[operator]


@runtime_checkable
class Backend(Protocol):
    """What the runtime and the API call on a backend: the only code that touches streams, events, pinning
    and device memory (``CPUBackend``: the device is host memory and each copy stream a worker thread;
    ``CUDABackend``: one CUDA device). ``tests/backend/test_protocol.py`` checks that both conform.

    Copies and events follow the plan's order: a copy is issued after the events it ``waits`` on, and the
    :class:`Event` it returns marks its end; compute waits for an event with :meth:`wait`.
    """

    device: torch.device

    def begin_forward(self) -> None:
        """A forward starts (the CUDA backend binds to, or checks, the current stream)."""
        ...

    def compute(self) -> ContextManager[object]:
        """A context that runs the runtime's own kernels (outside a forward) where compute runs."""
        ...

    def bind(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Point ``param`` at ``value`` (its slot view, a placeholder, or its host tensor at close)."""
        ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` uninitialised bytes of device memory (uint8)."""
        ...

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A parameter's value while its bucket is not on the device: no memory, reads give NaN."""
        ...

    def pin_host(self, arena: HostArena | NodeCopy) -> None:
        """Make ``arena`` copyable by DMA (page-lock it) until :meth:`close`, where the device needs it."""
        ...

    def unpin_host(self, arena: HostArena | NodeCopy) -> None:
        """Undo :meth:`pin_host` for ``arena`` before it is freed (no copy may use it any more)."""
        ...

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this backend holds page-locked now."""
        ...

    def total_bytes(self) -> int:
        """The device's memory, all of it (what a budget may not exceed)."""
        ...

    def headroom_bytes(self) -> int:
        """Device bytes the process holds beyond what the plan lays out (kept out of the budget)."""
        ...

    def peak_bytes(self) -> int | None:
        """Peak device bytes allocated since the backend was made; None where no allocator can say."""
        ...

    def allocated_bytes(self) -> tuple[int, int] | None:
        """(now, peak): device bytes allocated since the backend was made, and their peak; None where no
        allocator can say ([Note: transients] in offload/runtime/accounting.py)."""
        ...

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> Event:
        """Copy host ``src`` into device ``dst`` after ``waits``; the event marks the copy's end."""
        ...

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> Event:
        """Copy device ``src`` into host ``dst`` after ``waits``; the event marks the copy's end."""
        ...

    def copy_waits_on_host(self, waits: Iterable[Event]) -> bool:
        """Whether a copy issued now after ``waits`` would first block the calling thread: a wait for host work
        not done yet (a CPU-lane event) that no stream can wait for. The timed step leaves such a wait out of
        compute ([Note: timing compute] in runtime/executor.py)."""
        ...

    def record(self) -> Event:
        """An event marking all compute issued so far."""
        ...

    def collective(self, fn: Callable[[], None], waits: Iterable[Event] = (), weights: bool = False) -> Event:
        """Issue ``fn`` (a collective on device tensors: a grad slot's reduce-scatter, issue 20) after ``waits``
        where the backend runs collectives; the event marks its end. The caller keeps its tensors alive (and
        unused by others) until then. ``weights``: the updated weights' all-gathers, which the CPU lane's thread
        issues: on a stream of their own on CUDA, never queued behind (or ahead of) the main thread's."""
        ...

    def wait(self, event: Event) -> None:
        """Make compute wait for ``event``."""
        ...

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has finished."""
        ...

    def host_lane(self, name: str) -> Lane:
        """A new lane (thread ``offload-<name>``) for host work the runtime orders like a stream, e.g. the CPU
        AdamW; made here so that chaos delays (``offload.testing.chaos``) reach it as they reach the copies.
        The caller owns it and closes it."""
        ...

    def threads_alive(self) -> int:
        """Worker threads of this backend still running (0 once closed)."""
        ...

    def timer(self) -> Timer:
        """A clock on the compute timeline: the host's on the CPU backend, CUDA events on the compute stream
        on CUDA (where kernels run behind the host, so host time says little about them)."""
        ...

    def onepass_adamw(self) -> Callable[..., None] | None:
        """The device's one-pass AdamW for device-optimizer buckets (``cupy_adamw.adamw_step_device``'s
        signature), or None where there is none (torch's fused AdamW is used then)."""
        ...

    def close(self) -> None:
        """Finish the copies and release what the backend holds (streams, threads, pinned memory). Idempotent."""
        ...


class HostEvent:
    """An :class:`Event` set by a lane (or born complete). Failures travel with it."""

    __slots__ = ("_lock", "_done", "_error", "_what", "started", "finished")

    def __init__(self, done: bool = False, what: str = "") -> None:
        # Held from birth until set(): a waiter passes through it once released. A lock, not a threading.Event
        # (a Condition and a lock): ~0.3 us instead of ~5 us, for the ~30 made per training step (issue 17).
        self._lock = threading.Lock()
        self._done = done
        if not done:
            self._lock.acquire()
        self._error: BaseException | None = None
        self._what = what
        # time.perf_counter() when its lane began and ended the work (None: not run by a lane), for
        # Engine.export_timeline; two clock reads per item, nothing measurable beside a copy or an update.
        self.started: float | None = None
        self.finished: float | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error  # before _done and the release: a waiter that gets through sees it
        if not self._done:
            self._done = True
            self._lock.release()

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        if not self._done:
            with self._lock:  # released by set()
                pass
        if self._error is not None:
            raise OffloadError(f"offload: {self._what or 'background work'} failed: {self._error!r}") \
                from self._error


DONE = HostEvent(done=True)


class Deferred(HostEvent):
    """A :class:`HostEvent` for device work that a lane item issues: done once ``host`` (that item's event) is
    done and then the device event the item put in ``device`` (a one-element list) is; its failure is
    ``host``'s. So the lane goes on to its next item while the device works, and whoever waits for the work
    (the host, as for any host event) waits for both. Issue 20: [Note: weights gathered on the device]."""

    __slots__ = ("host", "device")

    def __init__(self, host: HostEvent, device: list) -> None:  # noqa: D107 - no lock: it is never set()
        self.host, self.device = host, device
        self.started = self.finished = None

    def set(self, error: BaseException | None = None) -> None:
        raise InvariantError("a Deferred event is done when its lane item and device work are: never set()")

    def synchronize(self) -> None:
        self.host.synchronize()  # raises the item's failure; once it ran, it has put its device event
        self.device[0].synchronize()

    def query(self) -> bool:
        return self.host.query() and bool(self.device) and self.device[0].query()


class Lane:
    """One worker thread that runs submitted work in order, each item after the events it waits on.

    It is the CPU backend's stand-in for a CUDA stream, and the CPU lane that runs AdamW in any backend.
    A failed item fails its event (and the events of later items that wait on it); the lane goes on.

    The thread holds no reference to the lane, so a lane that is dropped without :meth:`close` (an engine
    garbage-collected) is finalized like any object: its finalizer tells the thread to stop and joins it.
    """

    def __init__(self, name: str, before: Callable[[], None] | None = None, inline: bool = False) -> None:
        self.name = name
        self._before = before  # called before and after each item (chaos delays, offload.testing.chaos)
        # :meth:`issue` runs work at once on the calling thread where the lane could start it now (the CPU
        # backend's host lanes: [Note: inline copies] in backend/cpu.py)
        self.inline = inline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last: HostEvent = DONE
        self._finalizer: weakref.finalize | None = None
        # Held while an item is queued and while :meth:`run` decides and runs one inline: two threads issuing
        # to one lane keep its order (the runtime issues from one thread; this costs ~0.1 us per item).
        self._issue = threading.Lock()
        self.ran_inline = 0  # items :meth:`run` ran on the calling thread

    def submit(self, fn: Callable[[], object], waits: Iterable[Event] = (), what: str = "") -> HostEvent:
        self._check_open()
        with self._issue:
            return self._submit(fn, waits, what)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"lane {self.name} is closed (its engine was closed): wrap the model again to "
                                    "keep training")

    def _submit(self, fn: Callable[[], object], waits: Iterable[Event], what: str) -> HostEvent:
        if self._thread is None:  # created lazily: an engine that never streams starts no thread
            self._thread = threading.Thread(target=_run_lane, args=(self._queue, self._before), name=self.name,
                                            daemon=True)
            self._thread.start()
            self._finalizer = weakref.finalize(self, _stop_lane, self._queue, self._thread)
        ev = HostEvent(what=what or self.name)
        self._queue.put((fn, tuple(waits), ev))
        self._last = ev
        return ev

    def run(self, fn: Callable[[], object], waits: Iterable[Event] = (), what: str = "") -> HostEvent:
        """Run ``fn`` at once on the calling thread where the lane could have run it now: nothing submitted
        is still queued or running and every wait is done (one of the schedules a lane allows, so whatever
        waits correctly for lane work waits correctly for this); else :meth:`submit` it. No thread hand-off:
        the CPU backend's copies, ``[Note: inline copies]`` in backend/cpu.py. A failure travels with the
        returned event, as from the lane. A lane with chaos delays (``before``) always submits."""
        self._check_open()
        waits = tuple(waits)
        with self._issue:
            if self._before is not None or not self._last.query() or not all(w.query() for w in waits):
                return self._submit(fn, waits, what)
            return self._run_now(fn, waits, what)

    def issue(self, fn: Callable[[], object], waits: Iterable[Event] = (), what: str = "") -> HostEvent:
        """:meth:`run` on a lane made ``inline``, else :meth:`submit`: for work that may run on the calling
        thread only where the backend says so (the CPU backend's AdamW: [Note: inline copies] in backend/cpu.py)."""
        if self.inline:
            return self.run(fn, waits, what)
        return self.submit(fn, waits, what)

    def _run_now(self, fn: Callable[[], object], waits: tuple[Event, ...], what: str) -> HostEvent:
        ev = HostEvent(what=what or self.name)
        self._last = ev  # drain() raises its failure, as it would the lane's last item's
        self.ran_inline += 1
        _run_item(fn, waits, ev, None)  # its waits are done: a failure one carries fails it, as on the thread
        return ev

    def drain(self) -> None:
        """Block until everything submitted so far has run; raise the first failure among them."""
        self._last.synchronize()

    def close(self) -> None:
        """Run what was submitted, then stop and join the thread. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_lane once; later calls (and garbage collection) do nothing

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


# [Note: the cost of a lane item]
# Every grad-ring piece is one item of the CPU lane (runtime/grads.py), so what an item costs besides its AdamW
# is paid for each piece: ~1500 times a step for gpt3-2.7b, 128-205 us an item in the H200 traces
# (benchmarks/results/2026-11-27-h200/analysis.md, finding 1). On a GPU host the lane's thread shares the GIL
# with autograd's thread (the grad hooks' Python) and the main thread: every call that releases the GIL (a
# blocking wait; torch's ``Event.synchronize``, which releases it around ``cudaEventSynchronize``; the C++
# AdamW) must take it back, and with those threads running Python that take waits for them. So an item makes
# no such call that its order does not need:
# * a device event among its waits that ``query()`` finds complete is not synchronized (torch's
#   ``Event.query`` keeps the GIL; complete is what ``synchronize`` would wait for). The simulated GPU
#   (tests/support/fake_cuda.py) treats a true ``query()`` as a synchronize: the asking thread joins the
#   event's clock, so the race checker sees the same order. A :class:`HostEvent` is always synchronized: that
#   is cheap once it is set, and raises the failure of the work it marks;
# * a bucket's H2D is waited for by the update of its first piece only ([Note: one H2D wait per bucket's
#   update] in runtime/grads.py);
# * grad mode is off on the lane's thread for its life, not entered per item (``torch.no_grad()``: ~5 us).
# Left: the C++ AdamW's own release of the GIL (cpp/bindings.cpp), the hand-off when the lane is idle (a
# blocking ``SimpleQueue.get``), ``HostState.update``'s Python. ``benchmarks/lane_items.py`` measures it: with
# events emulating CUDA's for the lane, on the 2-vCPU VM while backward ran, an item's waits went from 155 to
# 6 us (benchmarks/results/cpu-2026-11-27/lane_items.md; not measured on a GPU).


def _run_lane(work: queue.SimpleQueue, before: Callable[[], None] | None) -> None:
    """The lane's thread: runs items until it gets None. Grad mode is thread-local and off here for the thread's
    life: no lane item records autograd history, and each then skips entering ``no_grad`` ([Note: the cost of a
    lane item])."""
    torch.set_grad_enabled(False)
    while True:
        item = work.get()
        if item is None:
            return
        fn, waits, ev = item
        del item
        _run_item(fn, waits, ev, before)
        # Drop the finished item's closure now, not when the next item arrives: it may hold a whole engine.
        del fn, waits, ev


def _run_item(fn: Callable[[], object], waits: Iterable[Event], ev: HostEvent,
              before: Callable[[], None] | None) -> None:
    """One lane item, on the lane's thread or inline (:meth:`Lane.run`): after its waits, ``fn`` without grad
    mode, timed for the timeline; its failure (or a wait's) set on ``ev``."""
    try:
        for w in waits:
            # A device event already complete is not synchronized ([Note: the cost of a lane item]); a host
            # event always is (cheap once set): its synchronize() raises the failure of the work it marks.
            if isinstance(w, HostEvent) or not w.query():
                w.synchronize()
        if before:
            before()
        ev.started = time.perf_counter()
        if torch.is_grad_enabled():  # entering no_grad costs ~5 us: only where grad mode is on
            with torch.no_grad():
                fn()
        else:
            fn()
        ev.finished = time.perf_counter()
        if before:
            before()
        ev.set()
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the event
        ev.set(e)


def _stop_lane(work: queue.SimpleQueue, thread: threading.Thread) -> None:
    work.put(None)
    if thread is not threading.current_thread():  # a finalizer may run on the lane's own thread (gc there)
        thread.join()
