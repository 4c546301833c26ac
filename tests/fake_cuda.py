"""A simulated GPU for running the CUDA backend's logic on the CPU: streams, events and cudart, faithful to
the CUDA ordering rules the backend relies on, and adversarial about timing.

* Compute is the host itself (CPU tensors, run at once), so the compute stream is *eager*: an event
  recorded on it is complete at once, and ``wait_event`` on it runs the awaited stream up to that event
  right away (the compute issued next must see the copy).
* A side stream is *lazy*: what is enqueued on it (copies, waits) runs only when something needs it -- a
  compute-stream wait, an event's ``synchronize``, the stream's ``synchronize`` -- in order, each wait first
  running the stream it waits for. A copy therefore happens as late as CUDA would allow, and reads its
  source and writes its destination then: a missing wait shows up as stale, zero or NaN numbers, a copy
  reading memory that was reused before it ran reads the new bytes, and an event recorded before its copy
  lets a reader in too early. That is the order a real GPU may pick when compute runs ahead.
* ``cudart`` records ``cudaHostRegister``/``cudaHostUnregister`` calls and can be told to fail.

Thread-safe: the CPU lane (AdamW) synchronizes events from its own thread.
"""

from __future__ import annotations

import threading

import torch


class FakeEvent:
    def __init__(self, sim: "FakeCuda"):
        self.sim = sim
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: "FakeStream") -> None:
        with self.sim.lock:
            self.stream = stream
            self.position = len(stream.ops)
            self.sim.log.append(("record", stream.name, self.position))

    def query(self) -> bool:
        with self.sim.lock:
            return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        if self.stream is not None:
            self.sim.run(self.stream, self.position)


class FakeStream:
    def __init__(self, sim: "FakeCuda", name: str, eager: bool):
        self.sim, self.name, self.eager = sim, name, eager
        self.ops: list[tuple[str, object]] = []  # ("wait", event) or ("copy", callable)
        self.done = 0  # ops run so far

    def wait_event(self, event: FakeEvent) -> None:
        with self.sim.lock:
            self.sim.log.append(("wait", self.name, event.stream.name if event.stream else None, event.position))
            self._enqueue(("wait", event))

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.sim)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.sim.run(self, len(self.ops))

    def _enqueue(self, op) -> None:
        self.ops.append(op)
        if self.eager:
            self.sim.run(self, len(self.ops))


class FakeCudart:
    """``torch.cuda.cudart()`` as far as pinning goes: records calls, returns 0 (cudaSuccess) or ``fail_with``."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}
        self.fail_with = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        if self.fail_with:
            return self.fail_with
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        if ptr not in self.registered:
            return 712  # cudaErrorHostMemoryNotRegistered
        del self.registered[ptr]
        return 0


class FakeCuda:
    """Stands in for :class:`offload.backend.cuda.CudaAPI`; the "device" is the CPU."""

    def __init__(self, lazy: bool = True):
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.lazy = lazy
        self.compute = FakeStream(self, "compute", eager=True)
        self.streams: list[FakeStream] = []
        self.log: list[tuple] = []
        self.fake_cudart = FakeCudart()
        self.copies = 0
        self.sleeps = 0
        self.total_bytes = 80 * 2**30  # what the simulated device reports as its memory

    def run(self, stream: FakeStream, position: int) -> None:
        with self.lock:
            while stream.done < position:
                kind, what = stream.ops[stream.done]
                if kind == "wait":
                    if what.stream is not None:
                        self.run(what.stream, what.position)
                else:
                    what()
                stream.done += 1

    # -- the CudaAPI surface --------------------------------------------------------------------------------

    def new_stream(self) -> FakeStream:
        with self.lock:
            stream = FakeStream(self, f"side{len(self.streams)}", eager=not self.lazy)
            self.streams.append(stream)
            self.log.append(("new_stream", stream.name))
            return stream

    def current_stream(self) -> FakeStream:
        return self.compute

    def new_event(self, blocking: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        def run():
            with torch.no_grad():
                dst.copy_(src)
            self.copies += 1

        with self.lock:
            self.log.append(("copy", stream.name))
            stream._enqueue(("copy", run))

    def cudart(self) -> FakeCudart:
        return self.fake_cudart

    def sleep(self, stream: FakeStream, seconds: float) -> None:
        """``torch.cuda._sleep`` on ``stream``: an op in its order that takes no part in the data flow (this
        simulation already runs side streams as late as CUDA allows, so a delay cannot make them later)."""
        with self.lock:
            self.log.append(("sleep", stream.name, seconds))
            self.sleeps += 1
            stream._enqueue(("sleep", lambda: None))

    def total_memory(self) -> int:
        return self.total_bytes

    def reset_peak(self) -> int:
        return 0

    def max_allocated(self) -> None:
        return None  # nothing to measure: the engine falls back to its own accounting

    def pending(self) -> int:
        """Operations enqueued on side streams that have not run yet."""
        with self.lock:
            return sum(len(s.ops) - s.done for s in self.streams)
