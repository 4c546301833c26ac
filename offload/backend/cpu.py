"""The CPU backend: the same plan, with the "device" a CPU tensor and each copy stream a worker thread.

Copies can really run asynchronously on their lanes, so a missing wait in the runtime shows up as wrong
numbers in the tests, exactly as it would on a GPU. Compute runs on the calling thread, so by the time
the runtime records an event, the compute issued before it has finished: ``record`` returns a completed
event, and ``wait`` (make compute wait) blocks the calling thread.

[Note: inline copies]
A GPU's copy engine moves bytes while the host thread goes on; here a copy is a ``memcpy`` that some CPU
core must do, and handing it to a lane thread costs a wake-up, a core the compute thread then shares, and,
when compute needs the bytes, a wait for that thread (``benchmarks/overhead.py`` on the 2-core test VM, the
same code in both modes, one run each: the 200-module MLP all resident 19.1 -> 18.4 ms a step by wall clock,
21.6 -> 20.5 ms of CPU; streamed 131.9 -> 102.0 ms; results ``cpu-2026-11-26/overhead-s11-after*``). So by
default a copy whose lane is idle and whose waits are all done runs at once on the issuing thread
(:meth:`Lane.run`): a schedule the lane thread could have produced (it would have started the copy at once
too), so every wait the runtime makes stays correct, and a copy that would have to wait is still handed to
the lane, in order. ``inline_copies=False`` (``OFFLOAD_CPU_COPIES=lanes`` for ``make_backend``) sends every
copy to its lane: the test suite runs so (tests/conftest.py), where a copy that runs late is what exposes a
missing wait, and chaos delays (which always use the lanes) make it later still. Throttled copies
(``h2d_bytes_per_s``, the simulator check) always use the lanes: they model an asynchronous link.

The same holds for each bucket's AdamW on the CPU lane (``host_lane`` lanes are made ``inline`` in this mode;
the runtime issues the update with ``Lane.issue``, grads.py): on this backend compute is a host thread too, so
handing each bucket's update to the lane thread cost its wake-up, a GIL hand-off and a core shared with compute
per bucket. Measured (issue 17, 2-vCPU VM, the mlp of ``benchmarks/overhead.py`` all resident, engines with and
without it in one process; benchmarks/results/cpu-2026-11-26/overhead-profile.md, section 12): process CPU
-1.0 to -1.2 ms a step of 9.4-10.5, and the main thread's own time did not grow although it now runs the
updates (~0.6 ms): the update beside compute slowed compute by as much. An update whose waits are not done, or
one behind queued lane work (a gradient accumulation), still goes to the lane, in order. Only updates are
issued so (in backward, at ``step()`` when deferred, the first step's held ones); the other CPU-lane work
(gradient accumulation, the first step's grads copied out, data parallel's shard updates and collectives) is
submitted as before. The CUDA backend's lanes are never ``inline``: there the host thread must keep issuing
kernels while updates run.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable

import psutil
import torch

from ..testing.chaos import ChaosConfig, chaos_delay
from .base import DONE, Event, HostEvent, HostTimer, Lane

if TYPE_CHECKING:
    from ..host.arena import HostArena
    from ..host.node_copy import NodeCopy


class CPUBackend:
    """The :class:`~offload.backend.base.Backend` whose "device" is host memory and whose copy streams are
    worker threads (see the module docstring)."""

    device = torch.device("cpu")

    def __init__(self, h2d_bytes_per_s: float | None = None, d2h_bytes_per_s: float | None = None,
                 chaos: ChaosConfig | None = None, inline_copies: bool = True) -> None:
        # Host-to-device copies: parameter buckets into their device slots, ahead of use.
        self._h2d = Lane("offload-h2d", before=chaos_delay(chaos, "h2d"))
        # Device-to-host copies: gradient slots back to host grad buffers, while backward goes on.
        self._d2h = Lane("offload-d2h", before=chaos_delay(chaos, "d2h"))
        # Optional link throttling: a copy of n bytes takes at least n / bandwidth seconds (the lane sleeps
        # for the rest, off the CPU), so the CPU backend behaves like a PCIe link of that bandwidth. Used to
        # check the simulator against the runtime (benchmarks/sim_vs_runtime.py).
        self._bandwidth = (h2d_bytes_per_s, d2h_bytes_per_s)
        self._chaos = chaos  # delays the lanes above and those of host_lane (tests only: offload.testing.chaos)
        # [Note: inline copies]: a copy that could start now runs on the issuing thread (lanes with chaos
        # delays never do: Lane.run)
        self.inline_copies = inline_copies and h2d_bytes_per_s is None and d2h_bytes_per_s is None

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """What a parameter points to while its bucket is not on the device: the right shape, dtype and
        device, no memory (one NaN expanded), so a stray read poisons the result and a write fails."""
        return torch.full((), float("nan"), dtype=dtype, device=self.device).expand(shape)

    def begin_forward(self) -> None:
        """Nothing to bind: compute is the calling thread (the CUDA backend binds to the current stream)."""

    def compute(self) -> ContextManager[object]:
        """Nothing to enter: the runtime's kernels run on the calling thread, as compute does."""
        return contextlib.nullcontext()

    @staticmethod
    def bind(param: torch.Tensor, value: torch.Tensor) -> None:
        """Point ``param`` at ``value`` (its slot view, a placeholder, or its host tensor at close)."""
        param.data = value

    def pin_host(self, arena: HostArena | NodeCopy) -> None:
        """Nothing to pin: there is no device to copy to by DMA (the CUDA backend registers the arena)."""

    def unpin_host(self, arena: HostArena | NodeCopy) -> None:
        """Nothing was pinned."""

    @property
    def pinned_bytes(self) -> int:
        """0: :meth:`pin_host` page-locks nothing on this backend (copies are ``Tensor.copy_`` between host
        tensors on a worker thread, no DMA). The host arena itself is ordinary memory here."""
        return 0

    def total_bytes(self) -> int:
        """The "device" is host RAM."""
        return psutil.virtual_memory().total

    def headroom_bytes(self) -> int:
        """0: the "device" is host memory, and no library keeps workspaces in it beside the plan (the CUDA
        backend measures its own; see [Note: headroom] in backend/cuda.py)."""
        return 0

    def peak_bytes(self) -> int | None:
        """None: no allocator to ask; the runtime's own accounting is the device peak on this backend."""
        return None

    def allocated_bytes(self) -> tuple[int, int] | None:
        """None: no allocator to ask, so no transients to learn ([Note: transients] in runtime/accounting.py)."""
        return None

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> HostEvent:
        issue = self._h2d.run if self.inline_copies else self._h2d.submit
        return issue(self._copy(dst, src, self._bandwidth[0]), waits, "host-to-device copy")

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, waits: Iterable[Event] = ()) -> HostEvent:
        issue = self._d2h.run if self.inline_copies else self._d2h.submit
        return issue(self._copy(dst, src, self._bandwidth[1]), waits, "device-to-host copy")

    def copy_waits_on_host(self, waits: Iterable[Event]) -> bool:
        """Never: a copy whose waits are not done goes to its lane (``Lane.run``); the caller does not wait."""
        return False

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, bandwidth: float | None):
        if bandwidth is None:
            return lambda: dst.copy_(src)

        def throttled():
            t0 = time.perf_counter()
            dst.copy_(src)
            rest = dst.numel() * dst.element_size() / bandwidth - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return throttled

    def record(self) -> Event:
        return DONE

    def collective(self, fn: Callable[[], None], waits: Iterable[Event] = (), weights: bool = False) -> Event:
        """Run ``fn`` (a gloo collective on "device" tensors, which are host memory) on the calling thread,
        after ``waits``: gloo blocks until it is done, so the event returned is complete."""
        for event in waits:
            event.synchronize()
        fn()
        return DONE

    def wait(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self._h2d.drain()
        self._d2h.drain()

    def host_lane(self, name: str) -> Lane:
        """A new lane for the runtime's host work (the CPU AdamW), with this backend's chaos delays if any; work
        the runtime ``issue``s to it runs inline where the copies do ([Note: inline copies])."""
        return Lane(f"offload-{name}", before=chaos_delay(self._chaos, name), inline=self.inline_copies)

    def threads_alive(self) -> int:
        """The copy lanes' threads still running (each starts at its first copy)."""
        return int(self._h2d.alive) + int(self._d2h.alive)

    def timer(self) -> HostTimer:
        """The host's clock: compute runs on the calling thread."""
        return HostTimer()

    def onepass_adamw(self) -> None:
        """None: device-optimizer buckets use torch's AdamW on the CPU backend (the tested numerics path)."""
        return None

    def close(self) -> None:
        """Run the copies submitted, then stop and join the lanes' threads. Idempotent."""
        self._h2d.close()
        self._d2h.close()
