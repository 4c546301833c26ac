"""What every backend shares: events that carry errors, and lanes (ordered worker threads)."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable, Iterable, Protocol

import torch

from ..errors import OffloadError


class Event(Protocol):
    """A point in some stream of work. ``synchronize`` blocks the calling thread until it is done
    and re-raises the failure of the work it marks."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class HostEvent:
    """An :class:`Event` set by a lane (or born complete). Failures travel with it."""

    __slots__ = ("_flag", "_error", "_what", "started", "finished")

    def __init__(self, done: bool = False, what: str = "") -> None:
        self._flag = threading.Event()
        self._error: BaseException | None = None
        self._what = what
        # time.perf_counter() when its lane began and ended the work (None: not run by a lane), for
        # Engine.export_timeline; two clock reads per item, nothing measurable beside a copy or an update.
        self.started: float | None = None
        self.finished: float | None = None
        if done:
            self._flag.set()

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()
        if self._error is not None:
            raise OffloadError(f"offload: {self._what or 'background work'} failed: {self._error!r}") \
                from self._error


DONE = HostEvent(done=True)


class Lane:
    """One worker thread that runs submitted work in order, each item after the events it waits on.

    It is the CPU backend's stand-in for a CUDA stream, and the CPU lane that runs AdamW in any backend.
    A failed item fails its event (and the events of later items that wait on it); the lane goes on.

    The thread holds no reference to the lane, so a lane that is dropped without :meth:`close` (an engine
    garbage-collected) is finalized like any object: its finalizer tells the thread to stop and joins it.
    """

    def __init__(self, name: str, before: Callable[[], None] | None = None) -> None:
        self.name = name
        self._before = before  # called before and after each item (chaos delays, offload.testing.chaos)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last: HostEvent = DONE
        self._finalizer: weakref.finalize | None = None

    def submit(self, fn: Callable[[], object], waits: Iterable[Event] = (), what: str = "") -> HostEvent:
        if self._closed:
            raise OffloadError(f"lane {self.name} is closed")
        if self._thread is None:  # created lazily: an engine that never streams starts no thread
            self._thread = threading.Thread(target=_run_lane, args=(self._queue, self._before), name=self.name,
                                            daemon=True)
            self._thread.start()
            self._finalizer = weakref.finalize(self, _stop_lane, self._queue, self._thread)
        ev = HostEvent(what=what or self.name)
        self._queue.put((fn, tuple(waits), ev))
        self._last = ev
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


def _run_lane(work: queue.SimpleQueue, before: Callable[[], None] | None) -> None:
    """The lane's thread: runs items until it gets None."""
    while True:
        item = work.get()
        if item is None:
            return
        fn, waits, ev = item
        del item
        try:
            for w in waits:
                w.synchronize()
            if before:
                before()
            ev.started = time.perf_counter()
            with torch.no_grad():
                fn()
            ev.finished = time.perf_counter()
            if before:
                before()
            ev.set()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the event
            ev.set(e)
        # Drop the finished item's closure now, not when the next item arrives: it may hold a whole engine.
        del fn, waits, ev


def _stop_lane(work: queue.SimpleQueue, thread: threading.Thread) -> None:
    work.put(None)
    if thread is not threading.current_thread():  # a finalizer may run on the lane's own thread (gc there)
        thread.join()
