"""Device memory the engine is responsible for, by part, and saved activations counted while they live."""

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
        if current > self.peak:
            self.peak = current
        self.samples.append((time.perf_counter(), current))

    def passing(self, n: int) -> None:
        """``n`` bytes held for an instant and let go (a fast step's gradient, copied into its slot as soon as
        autograd made it): the peak as ``add(part, n)`` then ``add(part, -n)`` would leave it, without the two
        timeline samples or part updates that cancel out ([Note: the fast path] in fast_path.py)."""
        if self.current + n > self.peak:
            self.peak = self.current + n

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
