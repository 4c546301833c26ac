"""The CUDA backend: the plan's copies on two side streams, every dependency a CUDA event, the host arena
page-locked with ``cudaHostRegister``.

[Note: streams and events]
Compute runs on the *current* stream (whatever stream the caller's forward and backward run on; autograd
runs a backward op on the stream of its forward op). Two more streams exist, each created once, on first
use: one for host-to-device copies (parameter buckets into their slots) and one for device-to-host copies
(gradients to the host); a data-parallel engine that reduce-scatters grads on the device (issue 20) adds a
third, for its collectives (``collective``: after the grads' event; the shard's D2H waits for its event), and a
fourth for the updated weights' all-gathers, which the CPU lane's thread issues (``collective(weights=True)``:
after the shard's H2D; the gathered bucket's D2H waits for it). The copies and collectives that the CPU lane's
thread issues wait and record like the main thread's; what waits for them gets a ``Deferred`` host event. The
runtime names every dependency as an event:

* ``record()`` marks the compute issued so far (an event on the current stream);
* ``h2d``/``d2h`` make their stream wait for the given events, enqueue the copy and return the event that
  marks its end;
* ``wait(event)`` makes the *current stream* wait for it: the host does not block, so the CPU keeps
  issuing kernels ahead of the GPU. Only a :class:`HostEvent` (work of a CPU lane, e.g. AdamW writing a
  master the next copy reads) is waited for on the host: no CUDA stream can wait on a host thread.

Slot reuse is protected by those events, not by ``record_stream``: the arena is one tensor we own, so the
caching allocator cannot know which bytes of it a copy still reads. A planned slot is overwritten by a
prefetch only after the event of its previous occupant's last reader (a compute event at release, or the
D2H event of a gradient slot), and a gradient slot is refilled by compute only after its D2H event; those
waits come from the plan (``Buffer.after``) through the runtime. Host buffers are protected the same way:
the CPU lane waits (host side) for the event of the copy that reads or writes them.

[Note: the compute stream]
"The current stream" is the one current at the engine's first forward: the backend binds to it then
(``begin_forward``), so a user who runs the model under ``with torch.cuda.stream(s):`` gets every record,
wait and allocation on ``s``, also from ``step()`` or the end-of-backward callback called outside the
``with`` block (``compute()`` puts the runtime's own kernels there on ``s`` too). A later forward under
another stream is refused (:class:`StreamError`): the arena, the slots and the events of the plan belong
to the first one, and moving them (``record_stream``, cross-stream waits) at every switch is not worth it.

[Note: stream-ordered memory]
Memory from ``empty()`` comes from PyTorch's caching allocator on the current stream. The allocator may
hand back a block that compute freed a moment ago while kernels reading it are still queued; that is safe
for later compute (same stream, in order) but not for the H2D stream, which is not ordered after them.
So every ``empty()`` makes the H2D stream wait for the current stream (``wait_stream``), and the H2D
stream does the same when it is created. Side streams never free memory compute allocated: the runtime
waits for a copy's event on the compute stream before it drops a slot the copy writes, and keeps a slot a
D2H reads until that copy's event has completed (a ``(tensor, event)`` pair, as in FSDP2).

Every copy is between tensors of one dtype (``_copy`` refuses others): a non-blocking copy that converts
is converted *on the device* by PyTorch (``copy_kernel_cuda``: with ``non_blocking=True`` the conversion
device is the GPU, in both directions). For D2H (bf16 slot to fp32 host) that is an fp32 temporary of twice
the slot, allocated on the D2H stream, a conversion kernel there, then 4 bytes per element over PCIe; for
H2D (fp32 host to bf16 slot) an fp32 device temporary on the H2D stream, 4 bytes per element over PCIe,
then a conversion kernel. Neither temporary is in the plan, and the stats and the simulator count the
slot's 2 bytes. So the host keeps each bucket in the device dtype on both paths (the 16-bit copy that
H2D reads, the 16-bit grads D2H writes: [Note: host grads] in ``buckets.py``), and every copy is one DMA
between a device slot and the pinned arena.

[Note: pinning]
The host arena (``cpp/pinned_arena``: mmap'd, 2 MiB aligned, first-touched by parallel threads so each
page sits on its toucher's NUMA node) is registered once with ``cudaHostRegister`` at its exact size, so
copies to and from it are DMA'd asynchronously instead of staged through a driver bounce buffer; no
power-of-two rounding as ``pin_memory()``'s caching host allocator does. ``close()`` (or garbage collection
of the backend) unregisters it; the backend keeps the arena alive until then, so it is never unmapped
while registered.
If the engine is dropped without ``close()``, the finalizer first waits for the copy streams (a copy may
still read or write the arena), then unregisters.

[Note: headroom]
The plan lays out the arena, saved activations, module buffers and the largest gradient, and fills the
budget with them. A CUDA process holds more, and the allocator's peak counts it: cuBLAS keeps a workspace
per (handle, stream) -- one for the thread that runs forward, one for autograd's device thread that runs
backward, 32 MiB each on Hopper and Blackwell with recent torch (``CUBLAS_WORKSPACE_CONFIG``) --, cuBLASLt
may take its own, and the allocator rounds every block up to 512 B and does not split a large block whose
rest would be 1 MiB or less. So the backend measures, once, what matmuls on the current stream add (its
*headroom*), and the planner keeps it out of the budget:

* the workspaces are cleared first (``torch._C._cuda_clearCublasWorkspaces``, as torch's own memory-leak
  checks and CUDA graph trees do), so the figure does not depend on what ran before, and the backend's
  peak base is taken then: the workspaces made again later fall inside the engine's measured peak;
* one warm-up matmul on this thread and one in a backward (autograd's thread), each between readings of
  ``memory_allocated`` (what stays: workspaces) and the cumulative allocated bytes (what came and went: a
  per-call workspace where torch does not cache them, and the tiny warm-up tensors);
* plus the allocator's rounding of the arena, the one large block the engine allocates per plan
  (:data:`ARENA_ROUNDING_BYTES`, the caching allocator's rule with its default settings).

Not in it: tensors a user makes outside forward (inputs, targets), transients of forward and backward (a
loss's fp32 logits, activation gradients, cuDNN or attention workspaces), and the rounding of each saved
activation. The runtime learns the transients from the allocator and adds them to the headroom
([Note: transients] in offload/runtime/accounting.py). A workspace cuBLAS allocates itself (outside PyTorch's
allocator, where a torch build does not cache workspaces) is neither in the headroom nor in the peak.

[Note: peaks]
``torch.cuda.reset_peak_memory_stats`` resets a process-wide statistic, so an engine that reset it would
erase the peak another engine (or the user) is measuring. The backend never resets: its peak is
``max_memory_allocated()`` minus what was allocated when it was made. That is exact when the process had
not allocated more than that before (a fresh process, or after the caller's own reset), and otherwise an
upper bound (the earlier maximum may be the larger).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Sequence

import torch
from torch.autograd.profiler import record_function

from ..errors import EngineClosedError, InvariantError, StreamError
from ..testing.chaos import ChaosConfig, chaos_delay
from .base import Event, HostEvent, Lane
from .cuda_host import HostRegistry, release_pinned

if TYPE_CHECKING:
    from ..host.arena import HostArena
    from ..host.node_copy import NodeCopy

__all__ = ["ARENA_ROUNDING_BYTES", "CUDABackend", "CudaAPI", "StreamError"]


# The caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp, default settings): every block is a
# multiple of 512 B (kMinBlockSize), and a block taken from a larger free one is split only if more than 1 MiB
# (kSmallSize) would be left, so a large allocation may hold up to 1 MiB + 511 B more than it asked for.
_BLOCK_BYTES = 512
_UNSPLIT_BYTES = 1 << 20
ARENA_ROUNDING_BYTES = _UNSPLIT_BYTES + _BLOCK_BYTES - 1
"""What the allocator may add to the arena (one large block) beyond its planned size: part of the headroom."""


class CudaAPI:
    """The few ``torch.cuda`` calls the backend makes, in one place, so the CPU tests can stand in a
    simulated GPU (``tests/support/fake_cuda.py``) and run the backend's logic without CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_event(self, blocking: bool = False, timing: bool = False):
        """A CUDA event; ``timing``: it records a time stamp (``elapsed_time``), which plain events skip."""
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def stream(self, stream):
        """``with torch.cuda.stream(stream)``: kernels and allocations in the block go to ``stream``."""
        return torch.cuda.stream(stream)

    def empty(self, nbytes: int, stream) -> torch.Tensor:
        """Device memory from the caching allocator, in ``stream``'s pool (freed memory is reused by work
        on that stream without further synchronisation)."""
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def set_data(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """``param.data = value``. A change of device or dtype drops the parameter's grad accumulator if
        autograd holds one (``VariableHooks::set_data``); see [Note: one accumulator per parameter]."""
        param.data = value

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` (asynchronous where the host side is pinned)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def cudart(self):
        return torch.cuda.cudart()

    def sleep(self, stream, seconds: float) -> None:
        """Enqueue a kernel on ``stream`` that spins for about ``seconds`` (chaos mode only)."""
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_second())))

    def cycles_per_second(self) -> float:
        """The SM clock ``torch.cuda._sleep`` counts cycles of. The driver reports the peak clock in kHz
        (``clock_rate``); where torch does not expose it, 1.5 GHz is assumed: the delays are random anyway."""
        rate_khz = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0)
        return rate_khz * 1e3 if rate_khz else 1.5e9

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    # The caching allocator's statistics (see [Note: headroom] and [Note: peaks]). A stand-in whose
    # max_allocated() is None has no allocator to ask; the backend then calls none of the others.

    def max_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def allocation(self) -> tuple[int, int]:
        """(current, peak) allocated bytes, from one statistics call (the nested form: no flattening)."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]
        return stats["current"], stats["peak"]

    def allocated_total(self) -> int:
        """Bytes allocated since the process started (a counter that only grows, unless a user resets it)."""
        return torch.cuda.memory_stats(self.device).get("allocated_bytes.all.allocated", 0)

    def clear_blas_workspaces(self) -> None:
        """Free the cuBLAS/cuBLASLt workspaces torch keeps per (handle, stream); the next matmul on each makes
        its own again. Private in torch, used by its own memory checks; absent in some builds."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    def blas_forward(self) -> None:
        """Matmuls on this thread and the current stream: cuBLAS (mm) and, where torch routes a bias add
        through it, cuBLASLt (addmm), in each dtype the engine computes in."""
        dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if torch.cuda.is_bf16_supported() else ())
        with torch.cuda.device(self.device):
            for dtype in dtypes:
                a = torch.ones(16, 16, dtype=dtype, device=self.device)
                bias = torch.ones(16, dtype=dtype, device=self.device)
                torch.mm(a, a)
                torch.addmm(bias, a, a)
            torch.cuda.current_stream(self.device).synchronize()

    def blas_backward(self) -> None:
        """A matmul in backward, which runs on autograd's device thread (its own cuBLAS handle), on the
        stream of the forward op: the current stream."""
        # (grad mode on whatever the caller's context: wrap may run under no_grad or inference_mode)
        with torch.cuda.device(self.device), torch.inference_mode(False), torch.enable_grad():
            w = torch.ones(16, 16, device=self.device, requires_grad=True)
            (torch.ones(16, 16, device=self.device) @ w).sum().backward()
            torch.cuda.current_stream(self.device).synchronize()


class CudaTimer:
    """A :class:`~offload.backend.base.Timer` on the compute stream: each mark is a timing event recorded
    there, so the seconds between two marks are the stream's, kernels and waits included, whenever the host
    issued them. A mark costs an event record (a few microseconds of host time): the runtime marks only the
    steps it times."""

    def __init__(self, api: CudaAPI, stream: Callable[[], object]) -> None:
        self._api = api
        self._stream = stream

    def mark(self) -> object:
        event = self._api.new_event(timing=True)
        event.record(self._stream())
        return event

    def seconds(self, marks: Sequence[object]) -> list[float]:
        if not marks:
            return []
        marks[-1].synchronize()  # type: ignore[attr-defined]
        first = marks[0]
        return [first.elapsed_time(m) / 1e3 for m in marks]  # type: ignore[attr-defined]


class CUDABackend:
    """Streams, events, device memory and host pinning for one CUDA device (see [Note: streams and events])."""

    def __init__(self, device: torch.device, api: CudaAPI | None = None, chaos: ChaosConfig | None = None) -> None:
        self.device = device
        self._api = api if api is not None else CudaAPI(device)
        # Chaos mode: a random torch.cuda._sleep on the copy stream before and after every copy (offload.testing.chaos).
        self._chaos = {"h2d": chaos_delay(chaos, "h2d"), "d2h": chaos_delay(chaos, "d2h")}
        self._chaos_config = chaos  # for host_lane
        self._compute = None  # bound at the first forward: see [Note: the compute stream]
        self._h2d = None  # created on first use: see _h2d_stream
        self._d2h = None  # created on first use: see _d2h_stream
        self._coll = None  # created on first use: see _collective_stream
        self._wcoll = None  # created on first use (by the CPU lane's thread): see _weights_stream
        self._nan: dict[torch.dtype, torch.Tensor] = {}
        self._pinned = HostRegistry(self._api.cudart)
        self._copy_streams: list = []  # the streams above once made: the finalizer waits for them
        # Unregister pinned memory also if the engine is dropped without close(), after its copies ([Note:
        # pinning]); not at interpreter exit, where the process's teardown releases it and the CUDA runtime
        # may already be gone.
        self._unpin = weakref.finalize(self, release_pinned, self._copy_streams, self._pinned)
        self._unpin.atexit = False
        self._closed = False
        # Device peak: the allocator's peak above what was allocated when this backend was made ([Note:
        # peaks]); headroom: what the process holds beyond the plan ([Note: headroom]). Both None / 0 where
        # there is no allocator to ask (a simulated GPU).
        self._peak_base: int | None = None
        self._headroom = 0
        if self._api.max_allocated() is not None:
            self._peak_base, self._headroom = self._measure_headroom()

    # -- streams ------------------------------------------------------------------------------------------

    def _h2d_stream(self):
        if self._h2d is None:
            # Parameter buckets go host -> device on a stream of their own so the copy engine moves the next
            # bucket while compute runs on the current one; one stream keeps the copies in plan order.
            self._h2d = self._api.new_stream()
            self._h2d.wait_stream(self._compute_stream())  # [Note: stream-ordered memory]
            self._copy_streams.append(self._h2d)
        return self._h2d

    def _d2h_stream(self):
        if self._d2h is None:
            # Gradients go device -> host on another stream, apart from the H2D one: the two directions use
            # separate copy engines, so a gradient copy never queues behind a prefetch, nor a prefetch behind
            # it, and backward goes on while both run.
            self._d2h = self._api.new_stream()
            self._copy_streams.append(self._d2h)
        return self._d2h

    def _collective_stream(self):
        if self._coll is None:
            # Grad slots are reduce-scattered on a stream of their own (issue 20), so backward goes on while
            # NCCL runs and the grad copies of other buckets do not queue behind it. Tensors come from the
            # arena (no allocation on it): it needs no wait_stream at creation.
            self._coll = self._api.new_stream()
            self._copy_streams.append(self._coll)
        return self._coll

    def _weights_stream(self):
        if self._wcoll is None:
            # The updated weights' all-gathers (issue 20), issued by the CPU lane's thread: a stream apart from
            # the grads' (issued by the main thread), since on one stream each rank would queue the two
            # threads' collectives in its own interleaving, and NCCL would wait on a pair that never comes.
            self._wcoll = self._api.new_stream()
            self._copy_streams.append(self._wcoll)
        return self._wcoll

    def _compute_stream(self):
        return self._compute if self._compute is not None else self._api.current_stream()

    def begin_forward(self) -> None:
        """A forward starts: bind to the current stream, or refuse another (see [Note: the compute stream])."""
        current = self._api.current_stream()
        if self._compute is None:
            self._compute = current
        elif current != self._compute:
            raise StreamError(
                f"this engine's forward ran on CUDA stream {self._compute} before and now runs on {current}. "
                "The engine keeps its device memory and events on the stream of its first forward; run every "
                "forward of one engine under the same `with torch.cuda.stream(s):` (or always on the default "
                "stream), or wrap the model again for another stream")

    def compute(self) -> ContextManager[object]:
        """Run the runtime's own kernels (outside a forward) on the engine's compute stream."""
        return self._api.stream(self._compute) if self._compute is not None else contextlib.nullcontext()

    def bind(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Point ``param`` at ``value`` (device memory, a placeholder, or its host tensor at close)."""
        self._api.set_data(param, value)

    # -- memory -------------------------------------------------------------------------------------------

    def empty(self, nbytes: int) -> torch.Tensor:
        compute = self._compute_stream()
        t = self._api.empty(nbytes, compute)
        if self._h2d is not None:
            self._h2d.wait_stream(compute)  # [Note: stream-ordered memory]
        return t

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A parameter's value while its bucket is not on the device: the right shape, dtype and device,
        one NaN scalar per dtype expanded (no memory per parameter), so a stray read poisons the result and
        a write fails."""
        nan = self._nan.get(dtype)
        if nan is None:
            itemsize = torch.empty((), dtype=dtype).element_size()
            nan = self._api.empty(itemsize, self._compute_stream()).view(dtype).reshape(())
            nan.fill_(float("nan"))
            self._nan[dtype] = nan
        return nan.expand(shape)

    def pin_host(self, arena: HostArena | NodeCopy) -> None:
        """Page-lock ``arena`` (an :class:`offload.host.arena.HostArena`, or the node's shared copy of the weights:
        [Note: one host copy per node]) once, at its exact size; undone by
        :meth:`close`. Call it after the arena's pages were first-touched (see [Note: pinning])."""
        self._check_open()
        with record_function("offload::pin_host"):
            self._pinned.register(arena.data_ptr, arena.size_bytes, arena)

    def unpin_host(self, arena: HostArena | NodeCopy) -> None:
        """Undo :meth:`pin_host` for ``arena`` (issue 18: a re-plan replaced the host arena by one of another
        size). The caller synchronized: no copy reads or writes it any more."""
        self._pinned.release(arena.data_ptr)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes registered with cudaHostRegister by :meth:`pin_host` and not yet released."""
        return self._pinned.nbytes

    def total_bytes(self) -> int:
        """The device's memory, all of it (what a budget may not exceed)."""
        return self._api.total_memory()

    def peak_bytes(self) -> int | None:
        """Peak device bytes allocated through PyTorch since this backend was made, above what was allocated
        then (see [Note: peaks]): the arena, on-demand slots, activations, gradients, temporaries, and the
        cuBLAS workspaces made again after the backend cleared them ([Note: headroom])."""
        if self._peak_base is None:
            return None
        return max(0, self._api.max_allocated() - self._peak_base)

    def allocated_bytes(self) -> tuple[int, int] | None:
        """(now, peak) device bytes allocated through PyTorch above what was allocated when this backend was
        made ([Note: peaks]); the runtime learns transients from them ([Note: transients] in
        runtime/accounting.py). None where there is no allocator to ask."""
        if self._peak_base is None:
            return None
        now, peak = self._api.allocation()
        return max(0, now - self._peak_base), max(0, peak - self._peak_base)

    def headroom_bytes(self) -> int:
        """Device bytes the process holds beyond what the plan lays out, measured once when the backend was
        made (see [Note: headroom]); the planner keeps them out of the budget."""
        return self._headroom

    def _measure_headroom(self) -> tuple[int, int]:
        """(peak base, headroom): see [Note: headroom]."""
        api = self._api
        api.clear_blas_workspaces()
        base = api.allocated()
        kept = came_and_went = 0
        for phase in (api.blas_forward, api.blas_backward):
            now, total = api.allocated(), api.allocated_total()
            phase()
            stays = api.allocated() - now
            kept += stays
            came_and_went = max(came_and_went, api.allocated_total() - total - stays)
        return base, kept + came_and_went + ARENA_ROUNDING_BYTES

    # -- copies and events --------------------------------------------------------------------------------

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> Event:
        with record_function("offload::h2d"):
            return self._copy(self._h2d_stream(), dst, src, waits)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> Event:
        with record_function("offload::d2h"):
            return self._copy(self._d2h_stream(), dst, src, waits)

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event]) -> Event:
        self._check_open()
        if dst.dtype != src.dtype:
            raise InvariantError(f"a copy from {src.dtype} to {dst.dtype} would convert on the device (an "
                                 "unplanned temporary, and the wider dtype's bytes over PCIe); the engine copies one "
                                 "dtype only (see [Note: stream-ordered memory]): a bug in offload, please report it")
        for event in waits:
            self._stream_wait(stream, event)
        chaos = self._chaos["h2d" if stream is self._h2d else "d2h"]
        if chaos is not None:
            self._api.sleep(stream, chaos.draw())
        self._api.copy(stream, dst, src)
        if chaos is not None:  # after the copy, before the event that marks its end
            self._api.sleep(stream, chaos.draw())
        # Blocking: a host thread that waits for a copy (the CPU lane before AdamW reads grads or rewrites a
        # master) sleeps instead of spinning on a core the CPU AdamW could use.
        done = self._api.new_event(blocking=True)
        done.record(stream)
        return done

    def collective(self, fn: Callable[[], None], waits: Iterable[Event] = (), weights: bool = False) -> Event:
        """Issue ``fn`` (an NCCL collective on device tensors, issue 20) on the collective stream after ``waits``;
        the event marks its end (see [Note: streams and events]). ``weights``: on the weights' collective stream
        (the CPU lane's all-gathers), so that the two threads' collectives never queue behind each other."""
        self._check_open()
        with record_function("offload::collective"):
            stream = self._weights_stream() if weights else self._collective_stream()
            for event in waits:
                self._stream_wait(stream, event)
            with self._api.stream(stream):  # NCCL's stream waits for this one, and this one for NCCL's
                fn()
            done = self._api.new_event(blocking=True)
            done.record(stream)
            return done

    def record(self) -> Event:
        """An event marking all compute issued so far on the current stream."""
        event = self._api.new_event()
        event.record(self._compute_stream())
        return event

    def wait(self, event: Event) -> None:
        """Make compute (the current stream) wait for ``event``; the host blocks only for a host event."""
        with record_function("offload::wait"):
            self._stream_wait(self._compute_stream(), event)

    @staticmethod
    def copy_waits_on_host(waits: Iterable[Event]) -> bool:
        """A CPU-lane event among ``waits`` not done yet: ``_stream_wait`` blocks the calling thread on it."""
        return any(isinstance(event, HostEvent) and not event.query() for event in waits)

    @staticmethod
    def _stream_wait(stream, event: Event) -> None:
        if isinstance(event, HostEvent):
            event.synchronize()  # CPU-lane work (or DONE): no stream can wait on a host thread
        else:
            stream.wait_event(event)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has finished."""
        with record_function("offload::synchronize"):
            for stream in (self._h2d, self._d2h, self._coll, self._wcoll):
                if stream is not None:
                    stream.synchronize()

    # -- lifetime -----------------------------------------------------------------------------------------

    def host_lane(self, name: str) -> Lane:
        """A new lane for the runtime's host work (the CPU AdamW), with this backend's chaos delays if any."""
        return Lane(f"offload-{name}", before=chaos_delay(self._chaos_config, name))

    def threads_alive(self) -> int:
        return 0  # CUDA streams, no threads of our own

    def timer(self) -> CudaTimer:
        """CUDA events with time stamps on the compute stream ([Note: timing compute] in runtime/executor.py)."""
        return CudaTimer(self._api, self._compute_stream)

    def onepass_adamw(self) -> Callable[..., None] | None:
        """cupy's one-pass AdamW (``backend/cupy_adamw.py``) where cupy imports and this is a real device (not
        a simulated one); ``OFFLOAD_DEVICE_ADAMW=torch`` turns it off (torch's fused AdamW then)."""
        if os.environ.get("OFFLOAD_DEVICE_ADAMW", "auto") == "torch" or type(self._api) is not CudaAPI:
            return None
        from . import cupy_adamw

        return cupy_adamw.adamw_step_device if cupy_adamw.available() else None

    def close(self) -> None:
        """Wait for the copies, unregister pinned host memory, drop the streams. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            self._unpin()  # runs release_pinned once; a later call (or garbage collection) does nothing
            self._h2d = self._d2h = self._coll = self._wcoll = None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the CUDA backend is closed (its engine was closed): wrap the model again to "
                                    "keep training")
