"""A simulated GPU for running the CUDA backend's logic on the CPU: streams, events, device memory and
cudart, faithful to the CUDA ordering rules the backend relies on, and at least as strict as CUDA.

The "device" is the CPU, so compute (which runs on the host here) always *happens* in host order. What a
GPU adds is that compute may run behind the host, and side streams beside it. The simulation checks
both, two ways:

* **Happens-before, for device memory** (what compute runs behind the host would break). Every stream
  carries a vector clock; ``record`` snapshots it, ``wait_event`` joins it, and a host thread that
  synchronizes an event (or sees ``query()`` true) joins it into its own clock, which the next operation
  it issues inherits (the host cannot issue before its waits returned). Memory from ``empty()`` is *device
  memory*: every access to it is recorded, by compute (a ``TorchDispatchMode`` sees every aten op of the
  thread that entered the simulation, forward and backward, and attributes it to the current stream) and
  by copies (at enqueue, their place in stream order). Two accesses to overlapping bytes from different
  streams, one of them a write, must be ordered by events, or it is a *race*: on a GPU that order is up
  to the scheduler. Allocating and freeing device memory are accesses too: the caching allocator hands out
  a block that work queued on its stream may still use (so another stream must wait for that stream after
  the allocation), and takes it back for that stream's next work (so every other stream's access must be
  ordered before that, or before the freeing host thread). This is the check that makes a compute event *not complete when recorded*: a backend
  whose ``record()`` does not capture compute (returns a completed event, records another stream) races
  with the first copy that reads what compute wrote. A compute event's ``query()`` is true only once the
  asking host thread has synchronized past it. Races are collected in ``races`` and raised as
  :class:`SimulatedRace` where that is safe (a compute op or an enqueue on the thread that made it); the
  ``simulated_gpu`` fixture fails a test that left any.
* **Values, for host memory** (what the host's own threads would break: AdamW on the CPU lane, the
  runtime). A side stream is *lazy*: what is enqueued on it runs only when something needs it (a
  compute-stream wait, an event's ``synchronize``, the stream's ``synchronize``), in order, each wait
  first running the stream it waits for. A device-to-host copy therefore writes its host buffer as late as
  CUDA would allow, and poisons it (NaN) when enqueued, since from then on its bytes are in flux: a host
  reader that does not wait for the copy's event reads NaN or stale numbers, one still reading when the
  copy is issued reads NaN. A host-to-device copy reads its host source when enqueued (the earliest a GPU
  could; only host code writes those sources, and the backend blocks on host events before it enqueues)
  and checks at completion that the source did not change meanwhile (a host writer that did not wait for
  the copy's event is a race). A copy whose device memory was freed before it ran is a race too.

Parameters and the device. ``CudaAPI.set_data`` is how the backend points a parameter at device memory
(an arena view, a placeholder) or back at host memory. On CUDA that is a *device change* and PyTorch's
``set_data`` then drops the parameter's grad accumulator if autograd holds one (a tied weight would get a
second one: two post-accumulate-grad hooks, two gradients). Here host and device tensors are both CPU
tensors, so ``set_data`` sees no change; the simulation forces the same reset, by first setting a tensor
of another dtype (which PyTorch treats the same way), whenever the tensor's side changes (device: storage
from ``empty()``; host: anything else). Simpler than a PrivateUse1 device (every aten op would need a
kernel) and exact where it matters: a reset happens iff CUDA would reset. The same registry gives a
device-mismatch check, opt-in with :meth:`FakeCuda.host_only` (tensors that must never meet device
tensors in an op, e.g. a model's buffers): an op mixing them with device-derived tensors raises the
error CUDA raises.

``cudart`` records ``cudaHostRegister``/``cudaHostUnregister`` calls and can be told to fail.

Thread-safe: the CPU lane (AdamW) synchronizes events from its own thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offload.api


class SimulatedRace(AssertionError):
    """Two accesses to the same device bytes that no event orders (see the module docstring)."""


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass made by ``_make_wrapper_subclass`` (no storage of its own; its ``__torch_dispatch__``
    runs the op on the tensors it wraps, which this simulation then sees)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and _no_storage(t)


def _no_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class FakeEvent:
    def __init__(self, sim: FakeCuda, timing: bool = False):
        self.sim = sim
        self.stream: FakeStream | None = None
        self.position = 0
        self.vc: dict[str, int] = {}  # the recording stream's vector clock at record time
        self.timing = timing
        self.at: float | None = None  # timing events: the host clock at record (compute runs in host order)

    def record(self, stream: FakeStream) -> None:
        with self.sim.lock:
            stream._inherit_host()
            self.stream = stream
            self.position = len(stream.ops)
            self.vc = dict(stream.vc)
            self.sim.log.append(("record", stream.name, self.position))
            if self.timing:
                if not stream.eager:
                    raise AssertionError("the simulation times compute only: a copy stream runs when needed")
                self.at = time.perf_counter()

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds from this event to ``end``; as CUDA, both must be timing events, recorded."""
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end.query()):  # CUDA: cudaErrorNotReady until both are complete
            raise RuntimeError("CUDA error: device not ready")
        return (end.at - self.at) * 1e3

    def query(self) -> bool:
        with self.sim.lock:
            if self.stream is None:
                return True
            host = self.sim._host_clock()
            if self.stream.eager:  # compute: complete once this host thread has synchronized past it
                return host.get(self.stream.name, 0) >= self.vc.get(self.stream.name, 0)
            if self.stream.done >= self.position:
                _join(host, self.vc)  # seen complete: the host knows it
                return True
            return False

    def synchronize(self) -> None:
        if self.stream is not None:
            self.sim.run(self.stream, self.position)
            with self.sim.lock:
                _join(self.sim._host_clock(), self.vc)


class FakeStream:
    def __init__(self, sim: FakeCuda, name: str, eager: bool):
        self.sim, self.name, self.eager = sim, name, eager
        self.ops: list = []  # ("wait", event), ("copy", callable) or ("sleep", callable); (kind, None) once run
        self.done = 0  # ops run so far
        self.vc: dict[str, int] = {name: 0}  # vector clock: ops of each stream ordered before this one's next

    def wait_event(self, event: FakeEvent) -> None:
        with self.sim.lock:
            self._inherit_host()
            _join(self.vc, event.vc)
            self.sim.log.append(("wait", self.name, event.stream.name if event.stream else None, event.position))
            self._enqueue(("wait", event))

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent(self.sim)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.sim.run(self, len(self.ops))
        with self.sim.lock:
            _join(self.sim._host_clock(), self.vc)

    def _inherit_host(self) -> None:
        """Whatever the issuing host thread has synchronized is ordered before what it issues now."""
        _join(self.vc, self.sim._host_clock())

    def _tick(self) -> int:
        self._inherit_host()
        self.vc[self.name] = self.vc.get(self.name, 0) + 1
        return self.vc[self.name]

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


class _Block:
    """One device allocation: its accesses, keyed (lo, hi, stream, write) -> (clock, what)."""

    __slots__ = ("accesses", "nbytes", "stream")

    def __init__(self, nbytes: int, stream: FakeStream):
        self.nbytes = nbytes
        self.stream = stream  # whose pool it came from: work on that stream reuses it without waiting
        self.accesses: dict[tuple, tuple[int, str]] = {}


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return lo, lo + (extent + 1) * size


class _Accesses:
    """Which arguments of an aten op it reads and which it writes, from its schema: ``Tensor(a!)`` is
    written, ``Tensor(a)`` (a view of the input) is not accessed, any other tensor argument is read."""

    _cache: dict = {}

    @classmethod
    def of(cls, func) -> list[tuple[int, str, bool]]:
        found = cls._cache.get(func)
        if found is None:
            found = []
            for i, arg in enumerate(func._schema.arguments):
                alias = arg.alias_info
                if alias is not None and not alias.is_write:
                    continue  # returns a view: no data is read
                found.append((i, arg.name, bool(alias is not None and alias.is_write)))
            cls._cache[func] = found
        return found


class _ComputeMode(TorchDispatchMode):
    """Every aten op of this thread is compute on the simulation's current stream."""

    def __init__(self, sim: FakeCuda):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if sim._internal():
            return func(*args, **kwargs)
        derived = sim._compute(func, args, kwargs)
        out = func(*args, **kwargs)
        if derived:
            sim._tag_device(out)
        return out


class FakeCuda:
    """Stands in for :class:`offload.backend.cuda.CudaAPI`; the "device" is the CPU.

    Use it as a context manager (``with sim:``; the ``simulated_gpu`` fixture does) for the happens-before
    checks of compute: without it only copies are checked."""

    def __init__(self, lazy: bool = True, host_only: tuple = ()):
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.lazy = lazy
        self.compute = FakeStream(self, "compute", eager=True)
        self._current = threading.local()  # what current_stream() returns, per host thread (as CUDA's)
        self.streams: list[FakeStream] = []
        self.log: list[tuple] = []
        self.fake_cudart = FakeCudart()
        self.copies = 0
        self.sleeps = 0
        self.total_bytes = 80 * 2**30  # what the simulated device reports as its memory
        self.races: list[str] = []
        self.memory: dict[int, _Block] = {}  # storage address -> device allocation
        self.device_changes = 0  # set_data calls that moved a parameter between host and device
        self._hosts: dict[int, dict] = {}  # host thread -> its vector clock
        self._local = threading.local()
        self._mode: _ComputeMode | None = None
        self._kinds: dict[int, str] | None = None  # storage -> "host" | "device", with host_only()
        if host_only:
            self.host_only(*host_only)

    @property
    def current(self) -> FakeStream:
        """The calling thread's current stream (switch with use_stream): per thread, as in CUDA, so a CPU lane
        issuing a collective under ``torch.cuda.stream`` does not move the main thread's compute."""
        return getattr(self._current, "stream", self.compute)

    @current.setter
    def current(self, stream: FakeStream) -> None:
        self._current.stream = stream

    # -- entering: compute is watched while the simulation is entered ----------------------------------------

    def __enter__(self) -> FakeCuda:
        self._mode = _ComputeMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        """``with torch.cuda.stream(stream)``: compute issued inside runs on ``stream``."""
        prev, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = prev

    # -- happens-before bookkeeping ------------------------------------------------------------------------

    def _host_clock(self) -> dict:
        return self._hosts.setdefault(threading.get_ident(), {})

    def _internal(self) -> bool:
        return getattr(self._local, "internal", 0) > 0

    @contextlib.contextmanager
    def _quiet(self):
        """The simulation's own tensor ops (running a copy, poisoning) are not compute."""
        self._local.internal = getattr(self._local, "internal", 0) + 1
        try:
            yield
        finally:
            self._local.internal -= 1

    def _race(self, message: str, raise_now: bool = True) -> None:
        self.races.append(message)
        if raise_now:
            raise SimulatedRace(message)

    def _access(self, t: torch.Tensor, stream: FakeStream, clock: int, write: bool, what: str) -> None:
        """Record an access to ``t``'s bytes by ``stream`` (at ``clock``); a race if an earlier one from
        another stream conflicts and is not ordered before it."""
        if t.layout != torch.strided or t.device.type != "cpu" or t.numel() == 0:
            return
        block = self.memory.get(t.untyped_storage().data_ptr())
        if block is None:
            return
        lo, hi = _byte_range(t)
        for (l, h, s, w), (c, before) in list(block.accesses.items()):
            if h <= lo or hi <= l:
                continue
            ordered = s == stream.name or stream.vc.get(s, 0) >= c
            if not ordered and (w or write):
                self._race(f"{what} on stream {stream.name} ({'write' if write else 'read'} of bytes [{lo}, {hi}) "
                           f"of a {block.nbytes}-byte device allocation) is not ordered after {before} on stream "
                           f"{s} ({'write' if w else 'read'} of [{l}, {h})): no event orders them")
            if write and ordered and lo <= l and h <= hi:
                del block.accesses[(l, h, s, w)]  # overwritten after it: later accesses need not check it
        block.accesses[(lo, hi, stream.name, write)] = (clock, what)

    def _compute(self, func, args, kwargs) -> bool:
        """Check and record the accesses of one compute op; True if its outputs are device tensors (with
        host_only() only)."""
        derived = False
        tensors = []
        for i, name, write in _Accesses.of(func):
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.Tensor):
                    tensors.append((t, write))
        with self.lock:
            if self._kinds is not None:
                derived = self._check_devices(func, tensors)
            # A wrapper subclass (offload's ExposedGrad) has no storage: its own ops are what touch memory.
            touched = [(t, w) for t, w in tensors if t.layout == torch.strided and t.device.type == "cpu"
                       and not _is_wrapper(t) and t.untyped_storage().data_ptr() in self.memory]
            if touched:
                stream = self.current
                clock = stream._tick()
                for t, write in touched:
                    self._access(t, stream, clock, write, f"{func} (compute)")
        return derived

    def _freed(self, ptr: int, block: _Block) -> None:
        """Device memory went back to the allocator, which hands it out again to work on the stream it was
        allocated on: every access from another stream must be ordered before that stream's next work (or
        before the freeing host thread). On CUDA it is ``record_stream``'s job, or the runtime's waits."""
        with self.lock:
            if self.memory.get(ptr) is block:
                del self.memory[ptr]
            known = dict(block.stream.vc)
            _join(known, self._host_clock())
            for (l, h, s, w), (c, what) in block.accesses.items():
                if s != block.stream.name and known.get(s, 0) < c:
                    self._race(f"device memory [{l}, {h}) of a {block.nbytes}-byte allocation was freed before "
                               f"{what} on stream {s} was known to be complete", raise_now=False)

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.memory

    # -- device mismatches (opt-in) ---------------------------------------------------------------------------

    def host_only(self, *tensors: torch.Tensor) -> None:
        """These tensors live on the host: an op that reads them together with device tensors (device
        memory, or what ops made from it) raises CUDA's device-mismatch error."""
        with self.lock:
            if self._kinds is None:
                self._kinds = {}
            for t in tensors:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                self._kinds[ptr] = "host"
                weakref.finalize(storage, self._kinds.pop, ptr, None)

    def _kind(self, t: torch.Tensor) -> str | None:
        ptr = t.untyped_storage().data_ptr()
        return "device" if ptr in self.memory else self._kinds.get(ptr)

    def _check_devices(self, func, tensors) -> bool:
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            return False  # a cross-device copy is what moves data between them
        kinds = {self._kind(t) for t, _ in tensors if t.layout == torch.strided and t.dim() > 0 and not _is_wrapper(t)}
        if {"host", "device"} <= kinds:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! (simulated GPU, in {func})")
        return "device" in kinds  # what an op makes from device tensors is on the device

    def _tag_device(self, out) -> None:
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
                    and not _is_wrapper(t)):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                with self.lock:
                    if ptr in self.memory or self._kinds.get(ptr) == "device":
                        continue
                    self._kinds[ptr] = "device"
                weakref.finalize(storage, self._kinds.pop, ptr, None)

    # -- the CudaAPI surface --------------------------------------------------------------------------------

    def run(self, stream: FakeStream, position: int) -> None:
        with self.lock, self._quiet():
            while stream.done < position:
                kind, what = stream.ops[stream.done]
                if kind == "wait":
                    if what.stream is not None:
                        self.run(what.stream, what.position)
                else:
                    what()
                    stream.ops[stream.done] = (kind, None)  # drop the closure (its tensors) once run
                stream.done += 1

    def new_stream(self) -> FakeStream:
        with self.lock:
            stream = FakeStream(self, f"side{len(self.streams)}", eager=not self.lazy)
            self.streams.append(stream)
            self.log.append(("new_stream", stream.name))
            return stream

    def user_stream(self) -> FakeStream:
        """A stream of the user's (``torch.cuda.Stream()``), for compute: eager, like the default one."""
        with self.lock:
            stream = FakeStream(self, f"user{len(self.streams)}", eager=True)
            self.streams.append(stream)
            return stream

    def current_stream(self) -> FakeStream:
        return self.current

    def stream(self, stream: FakeStream):
        """``with torch.cuda.stream(stream)`` as the backend uses it around a collective (issue 20): what the
        block issues (a gloo collective, run on the host at once) comes after the work queued on ``stream``,
        so a lazy stream first runs what it has queued (an all-gather after the copy of its shard)."""
        if not stream.eager:
            self.run(stream, len(stream.ops))
        return self.use_stream(stream)

    def new_event(self, blocking: bool = False, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    def empty(self, nbytes: int, stream: FakeStream | None = None) -> torch.Tensor:
        """Device memory: tracked from now until the allocator gets it back."""
        with self._quiet():
            t = torch.empty(nbytes, dtype=torch.uint8)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        stream = stream or self.current
        block = _Block(nbytes, stream)
        with self.lock:
            self.memory[ptr] = block
            # The caching allocator hands out a block that work queued on ``stream`` may still use (freed a
            # moment ago): to every other stream the memory is written by ``stream`` at this point.
            block.accesses[(0, nbytes, stream.name, True)] = (stream._tick(), "its allocation")
        weakref.finalize(storage, self._freed, ptr, block)
        return t

    def set_data(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """``param.data = value`` with CUDA's rule: a device change drops a live grad accumulator."""
        if self.is_device(param.data) != self.is_device(value):
            with self._quiet():
                other = torch.float64 if value.dtype != torch.float64 else torch.float32
                param.data = torch.empty(0, dtype=other)  # set_data drops the accumulator on a type change
            self.device_changes += 1
        param.data = value

    def copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            to_device, from_device = self.is_device(dst), self.is_device(src)
            clock = stream._tick()
            what = f"the copy {'H2D' if to_device and not from_device else 'D2H' if from_device else 'copy'} " \
                   f"#{len(self.log)}"
            self._access(dst, stream, clock, True, what)
            self._access(src, stream, clock, False, what)
            with self._quiet():
                if from_device and not to_device and dst.is_floating_point():
                    dst.fill_(float("nan"))  # in flux from now until the copy's event: see the module docstring
                snapshot = src.clone() if to_device and not from_device else None
            dst_ref = self._weak(dst) if to_device else (lambda d=dst: d)
            src_ref = self._weak(src) if from_device else (lambda s=src: s)
            src_view = src if snapshot is not None else None
            del dst, src

            def run():
                d, s = dst_ref(), src_ref()
                if d is None or s is None:
                    self._race(f"{what} ran on device memory that was freed before it", raise_now=False)
                    return
                if snapshot is not None:
                    if not torch.equal(snapshot.view(-1).view(torch.uint8), src_view.reshape(-1).view(torch.uint8)):
                        self._race(f"the host source of {what} changed while the copy was in flight: a host "
                                   "writer did not wait for the copy's event", raise_now=False)
                    s = snapshot
                with torch.no_grad():
                    d.copy_(s)
                self.copies += 1

            self.log.append(("copy", stream.name))
            stream._enqueue(("copy", run))

    @staticmethod
    def _weak(t: torch.Tensor):
        """A view of device memory that does not keep the memory alive (a pending copy does not own it)."""
        ref = weakref.ref(t.untyped_storage())
        offset, size, stride, dtype = t.storage_offset(), t.shape, t.stride(), t.dtype

        def view():
            storage = ref()
            if storage is None:
                return None
            return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
        return view

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


@pytest.fixture
def simulated_gpu(monkeypatch):
    """``use(backend_class=CUDABackend, **sim_options)``: engines wrapped from now on get a CUDA backend on a
    :class:`FakeCuda`, entered for the test (compute is watched); returns the list of backends made. The test
    fails if the simulation saw a race."""
    from offload.backend import CUDABackend

    sims: list[FakeCuda] = []
    with contextlib.ExitStack() as stack:
        def use(backend_class=CUDABackend, **options):
            def make(device, chaos):
                sim = stack.enter_context(FakeCuda(**options))
                sims.append(sim)
                kw = {} if chaos is None else {"chaos": chaos}
                return backend_class(torch.device("cpu"), api=sim, **kw)

            return use_backend(monkeypatch, make)

        yield use
    races = [r for sim in sims for r in sim.races]
    assert not races, "the simulated GPU saw races:\n" + "\n".join(races[:10])


def use_backend(monkeypatch, factory):
    """Make every engine wrapped from now on (in this test) use ``factory(device, chaos)``'s backend instead
    of ``make_backend``; returns the list of backends made, in order. ``chaos`` is None unless the engine is
    wrapped inside :func:`with_chaos`."""
    made = []

    def make(device, chaos=None):
        made.append(factory(device, chaos))
        return made[-1]

    monkeypatch.setattr(offload.api, "make_backend", make)
    return made


@contextlib.contextmanager
def with_chaos(chaos):
    """Engines wrapped inside get their backend with chaos mode on (``offload.testing.chaos``; None: off),
    from whatever stands for ``offload.api.make_backend`` now (the real one, or :func:`use_backend`'s
    stand-in): chaos is no engine option, the backend factory takes it."""
    if chaos is None:
        yield
        return
    factory = offload.api.make_backend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload.api, "make_backend", lambda device: factory(device, chaos=chaos))
        yield
