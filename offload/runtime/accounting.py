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
(a user's tensors, another model: not the engine's to plan for; ``outside``). The window shows transients
two ways:

* live: at the backward's first hook (``backward_begins``), what is allocated beyond the accounting and
  ``outside`` (the loss's saved tensors, the logits' gradient): a size, wherever the plan puts its peak;
* the peak: if the allocator's peak rose in the window, the window's peak is known, and at that instant the
  accounting held at most its own peak of the window, so at least ``allocator peak - accounted window peak
  - outside`` more was held (an op's workspace gone before any hook sees it).

The larger joins ``headroom`` (``transients``: the learnt part; it only grows), so every later plan keeps it
out of the budget and the accounting holds it from then on: once the reserve is right, later windows show
no more. The first step teaches it before the first plan is built (``PlanExecutor.check_transients`` runs at
the end of the backward, before ``check_ahead``); a later, larger one makes ``step()`` plan again where the
plan no longer fits beside it. Where no plan keeps all of it out, the plan keeps what it can and says so
(``PlanExecutor._build``): training that ran before still runs.

Not covered: the peak is one per process and the engine never resets it ([Note: peaks]), so a window whose
peak did not rise says nothing, and the peak's excess is measured against the accounting's peak of its
window: a plan that moves its own peak to the instant of an instant transient goes over by the difference
(tests/runtime/test_transients.py shows one). No-grad forwards end no window.
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
        self.live = 0  # the most live at a backward's first hook beyond the accounting, in this window
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

    def window_begins(self, allocation: tuple[int, int] | None) -> None:
        """A forward begins: ``allocation`` is the allocator's (now, peak) above the backend's base (None where
        there is no allocator to ask). See [Note: transients]."""
        self.window_peak = self.current
        if allocation is None:
            return
        now, self.allocator_peak = allocation  # a rise outside forward and backward is not theirs
        self.outside = max(0, now - (self.current - self.transients))

    def backward_begins(self, allocation: tuple[int, int] | None) -> None:
        """The first hook of a backward: what is allocated now beyond this accounting and what was outside it
        when the forward began is live and nobody's (a loss's saved fp32 logits, the logits' gradient). See
        [Note: transients]."""
        if allocation is not None and self.allocator_peak is not None:
            self.live = max(self.live, allocation[0] - (self.current - self.transients) - self.outside)

    def window_ends(self, allocation: tuple[int, int] | None) -> int:
        """A backward ended: the transients this window shows (the largest of what was live at its backward's
        first hook and, if the allocator's peak rose in it, what that peak held beyond this accounting and what
        was outside it) beyond those learnt already, now kept out of every later plan's budget as part of
        ``headroom``; 0 if none. See [Note: transients]."""
        window, self.window_peak = self.window_peak, self.current
        live, self.live = self.live, 0
        if allocation is None or self.allocator_peak is None:
            return 0
        need = max(self.transients, live)
        peak, seen = allocation[1], self.allocator_peak
        self.allocator_peak = max(seen, peak)
        if peak > seen:  # else this window's own peak is not known, only that it was no higher than an earlier one
            need = max(need, self.transients + peak - window - self.outside)  # ``window`` holds the reserve
        gap = need - self.transients
        if gap <= 0:
            return 0
        self.transients += gap
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
