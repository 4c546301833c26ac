"""Device memory the engine is responsible for, by part, and saved activations counted while they live.

[Note: transients]
The plan lays out what the engine holds (arena, saved activations, buffers, the largest gradient) and keeps
the backend's measured headroom out of the budget ([Note: headroom] in backend/cuda.py). A forward and
backward also allocate what nothing saves: a loss's fp32 copy of the logits and its log-softmax, the
gradients of activations flowing through backward, an attention kernel's workspace. On the H200 (run 5,
benchmarks/results/2026-11-27-h200) the allocator's peak stood 0.25-0.82 GB over the plan's, and
gpt3-2.7b at 8 GiB ran out of memory in the loss once a plan filled the budget.

So on a backend with an allocator to ask (``Backend.allocated_bytes``: CUDA), each forward to the end of its
backward is a *window*, and the bytes allocated beyond this accounting when it begins are the process's own
(a user's tensors, another model: not the engine's to plan for; ``outside``). What matters is how far the
process went above the accounting's own peak of the window (the plan bounds that peak by the budget), and a
window shows it two ways:

* the peak: if the allocator's peak rose in the window, the window's peak is known: ``allocator peak -
  outside - accounted peak of the window`` (an op's workspace, gone before any hook sees it);
* live: at the backward's first hook (``backward_begins``), ``allocated now - outside - accounted peak of
  the window`` (the loss's saved tensors and the logits' gradient, where the accounting peaks too), which
  counts where the peak did not rise (the allocator keeps one peak per process, and the engine never resets
  it: [Note: peaks]).

Both are measured against the window's peak, never against the accounting at that instant: the process's
allocations bound them, so nothing can be learnt that the process did not hold above what the plan counts.
The larger joins ``headroom`` (``transients``: the learnt part, which the accounting holds from then on; it
only grows): every later plan keeps it out of the budget, and once it is right later windows show no more.
The traced first step teaches nothing (its accounting is the warm-up's, not a plan's): at its end the largest
storage saved for backward stands in (a loss's fp32 logits are about the size of its saved log-softmax), so
the first plan does not fill the budget to the byte. The first planned step measures (``PlanExecutor.
check_transients`` runs at the end of its backward): its figure replaces the stand-in, up or down, and
``step()`` plans again (counted in ``transient_replans`` unless the compute timing re-plans at that step too);
later it only grows, and ``step()`` plans again where the plan no longer fits beside it. Where no plan keeps
all of it out, the plan keeps what it can and says so (``PlanBuilder.build``): training that ran before
still runs.

Measured on the H200 (benchmarks/results/2026-11-27-h200): in run 6, gpt3-2.7b at 8 GiB, which ran out of memory
in run 5, trained (0.945 s a step, peak 7.91 GiB). Runs 6 (a first version) and 7 (the one before this fix)
reserved 3.0 and 2.84 GB for gpt2-xl (whose allocator peak stood 0.41 GB over the accounting's in run 5), which
then streamed 147 and 379 of its 386 buckets: 0.80 and 0.78 s a step against 0.53. The cause: a fast step's
accounting leaves its activations out ([Note: the fast path] in fast_path.py) while the allocator holds them, so
its window took them (3.05 GB) for transients. A fast step's window teaches nothing now (its root call is that of
a full step on the same plan, whose window measured): in run 8 gpt2-xl learnt 0.41 GB, kept every bucket resident
(0.550 s a step), and gpt3-2.7b at 8 GiB trained within the budget (0.924 s a step, the device optimizer 0.721 s;
peak 7.97 GiB).

Not covered: the first planned step runs before its transients are measured (beside the stand-in only, it
may go over); a window whose
peak did not rise shows only what is live at its backward's first hook; the excess is measured against the
window's peak, so a plan that moves its own peak to the instant of a transient goes over by the difference;
what the traced step allocates and keeps (a cuBLAS workspace for a user's stream) counts as outside from then
on; no-grad forwards end no window; a fast step's transients beyond those of the full step it repeats.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch


class DeviceMemory:
    """Device bytes the engine is responsible for, by part, with the peak of their sum.

    On the CPU backend this is the device memory (there is no allocator to ask); it counts the arena,
    on-demand slots, module buffers, saved activations and gradients in flight, and the backend's
    ``headroom`` (what the process holds beyond them on CUDA: cuBLAS workspaces, allocator rounding; see
    [Note: headroom] in backend/cuda.py), held from the start.
    """

    SAMPLES = 1 << 14  # device-byte samples kept (per step)

    def __init__(self, headroom: int = 0) -> None:
        # graph_copies: weight copies a create_graph=True backward's graph holds (ParamAccess.graph_copy)
        # gather: data parallel's buffers for the weights' all-gathers on the device (issue 20: [Note: weights
        # gathered on the device] in device_collectives.py)
        self.parts: dict[str, int] = {"arena": 0, "slots": 0, "buffers": 0, "activations": 0, "grads": 0,
                                      "graph_copies": 0, "headroom": 0, "gather": 0}
        self.current = 0
        self.peak = 0
        # The accounted peak since the last look at the allocator's ([Note: transients]), and what the
        # allocator's peak was then; transients: the part of ``headroom`` learnt from those looks.
        self.window_peak = 0
        self.allocator_peak: int | None = None
        self.outside = 0  # bytes allocated outside this accounting when the window began (a user's tensors)
        self.transients = 0
        self.live = 0  # the most allocated (less ``outside``) at a backward's first hook, in this window
        self.learning = True  # this window teaches (not the traced first step's)
        # ``transients`` is the traced step's stand-in (True), measured (False), or nothing yet (None)
        self.provisional: bool | None = None
        self.activation_peak = 0  # of the current step
        # Largest storage saved for backward (or that a checkpointed block would save) since wrap: off plan,
        # the room kept free for the next one to land in (see SlotTable.cache_limit).
        self.largest_saved = 0
        self._held: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        # Called after saved activations grew: off plan, the runtime evicts cached buckets to stay in budget.
        self.on_activations: Callable[[], None] | None = None
        # (time.perf_counter(), current) after every change since the last step() (offload/tools/timeline.py's
        # LaneLog.step_done takes them for Engine.export_timeline's counter: take_samples)
        self.samples: deque[tuple[float, int]] = deque(maxlen=self.SAMPLES)
        self.add("headroom", headroom)

    @property
    def fixed(self) -> int:
        """Bytes held for the whole run outside the plan's arena, which every plan counts as fixed: the
        module's buffers and data parallel's gather buffers."""
        return self.parts["buffers"] + self.parts["gather"]

    def take_samples(self) -> deque[tuple[float, int]]:
        """The samples since the previous call; sampling goes on into a new deque."""
        samples, self.samples = self.samples, deque(maxlen=self.SAMPLES)
        return samples

    def add(self, part: str, n: int) -> None:
        self.parts[part] += n
        current = self.current = self.current + n
        if current > self.window_peak:
            self.window_peak = current
            if current > self.peak:
                self.peak = current
        self.samples.append((time.perf_counter(), current))

    def passing(self, n: int) -> None:
        """``n`` bytes held for an instant and let go (a fast step's gradient, copied into its slot as soon as
        autograd made it): the peak as ``add(part, n)`` then ``add(part, -n)`` would leave it, without the two
        timeline samples or part updates that cancel out ([Note: the fast path] in fast_path.py)."""
        if self.current + n > self.window_peak:
            self.window_peak = self.current + n
            if self.window_peak > self.peak:
                self.peak = self.window_peak

    def window_begins(self, allocation: tuple[int, int] | None, learn: bool = True) -> None:
        """A forward begins: ``allocation`` is the allocator's (now, peak) above the backend's base (None where
        there is no allocator to ask); ``learn``: False for the traced first step (see [Note: transients])."""
        self.window_peak = self.current
        self.learning = learn
        if allocation is None:
            return
        now, self.allocator_peak = allocation  # a rise outside forward and backward is not theirs
        self.outside = max(0, now - (self.current - self.transients))

    def backward_begins(self, allocation: tuple[int, int] | None) -> None:
        """The first hook of a backward: what is allocated now, less what was outside the accounting when the
        forward began (a loss's saved fp32 logits and the logits' gradient are in it). See [Note: transients]."""
        if allocation is not None and self.allocator_peak is not None and self.learning:
            self.live = max(self.live, allocation[0] - self.outside)

    def window_ends(self, allocation: tuple[int, int] | None) -> int:
        """A backward ended: how far the process went above the accounting's peak of the window (at its
        backward's first hook, and at the allocator's peak if that rose in the window), beyond the transients
        learnt already, now kept out of every later plan's budget as part of ``headroom``: the change of
        ``transients`` (0 if none; below 0 where the first measured window replaces the traced step's stand-in
        by less). See [Note: transients]."""
        window, self.window_peak = self.window_peak, self.current
        live, self.live = self.live, 0
        if allocation is None or self.allocator_peak is None:
            return 0
        peak, seen = allocation[1], self.allocator_peak
        self.allocator_peak = max(seen, peak)
        if not self.learning:  # the traced step: its largest saved storage stands in until a plan's window
            if self.provisional is None:
                self.provisional = True
                return self._set_transients(self.largest_saved)
            return 0
        # ``window`` holds the reserve learnt already (``transients``): what the process held beyond the rest
        reserve = self.transients
        excess = live - window + reserve if live else 0
        if peak > seen:  # else this window's own peak is not known, only that it was no higher than an earlier one
            excess = max(excess, peak - self.outside - window + reserve)
        if self.provisional:  # the first measured window replaces the stand-in, up or down
            self.provisional = False
            return self._set_transients(max(0, excess))
        return self._set_transients(excess) if excess > reserve else 0

    def _set_transients(self, nbytes: int) -> int:
        gap, self.transients = nbytes - self.transients, nbytes
        self.add("headroom", gap)
        return gap

    def hold(self, key: int, nbytes: int) -> bool:
        """Count storage ``key`` as activations (once, however often it is held); True if it is new."""
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [1, nbytes]
            self.saw_saved(nbytes)
            self.add("activations", nbytes)
            self.activation_peak = max(self.activation_peak, self.parts["activations"])
            if self.on_activations is not None:
                self.on_activations()
            return True
        entry[0] += 1
        return False

    def saw_saved(self, nbytes: int) -> None:
        """A storage of ``nbytes`` is (or, were its block not checkpointed, would be) saved for backward."""
        self.largest_saved = max(self.largest_saved, nbytes)

    def drop(self, key: int) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self.add("activations", -entry[1])


class SavedActivation:
    """A saved activation; counts its storage's bytes as device memory until autograd drops it."""

    __slots__ = ("tensor", "key", "memory", "__weakref__")

    def __init__(self, tensor: torch.Tensor, memory: DeviceMemory, storage: torch.UntypedStorage | None = None):
        # Detached (same storage and version counter): an op that saves its own output (tanh, sigmoid, exp)
        # would otherwise close a cycle output -> grad_fn -> this -> output through C++, which Python's gc
        # cannot see, so a graph dropped without backward (a fault, a forward with grad and no backward)
        # would keep its activations for good. Autograd rebuilds the grad_fn edge itself when unpacking.
        self.tensor = tensor.detach()
        self.memory = memory
        if storage is None:  # the pack hook passes the tensor's untyped storage when it has it already
            storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        memory.hold(self.key, storage.nbytes())

    def __del__(self) -> None:
        self.memory.drop(self.key)
