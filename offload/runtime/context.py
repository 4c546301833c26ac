"""What every component of the runtime shares, fixed when the engine is wrapped: the parameters and
their specs, the compute dtype, the backend, the config, and the few shared holders (device-memory
accounting, counters, the CPU lane, the phases). Components own everything else they keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..backend.base import Backend, Lane
from ..config import OffloadConfig
from ..errors import OffloadError
from ..optim import AdamW
from ..planning.buckets import ParamSpec, resolve_bucket_bytes
from ..planning.hw import HardwareModel
from ..planning.schedule import DEFAULT_HW
from ..tools.timeline import LaneLog
from .accounting import DeviceMemory
from .device_collectives import resolve_grad_reduce
from .distributed import DataParallel
from .phases import Phases


class Busy:
    """Entered while the runtime's own code runs inside a forward: the use detector ignores its tensor ops.
    Under ``torch.inference_mode()`` that code runs outside it: the arena, slots and views it makes are used
    by the copy threads and by later training steps, which inference tensors would refuse. Re-entrant."""

    __slots__ = ("depth", "_guards")

    def __init__(self) -> None:
        self.depth = 0
        self._guards: list[Any] = []

    def __enter__(self) -> None:
        self.depth += 1
        guards: tuple[Any, ...] = ()
        if torch.is_inference_mode_enabled():
            # inference_mode(False) also turns grad mode on; the caller's is off (inference mode implies it),
            # and the runtime reads it to tell a no-grad forward (forward-only plan, p.grad kept) from training
            guards = (torch.inference_mode(False), torch.no_grad())
            for guard in guards:
                guard.__enter__()
        self._guards.append(guards)

    def __exit__(self, *exc: object) -> None:
        for guard in reversed(self._guards.pop()):
            guard.__exit__(*exc)
        self.depth -= 1


@dataclass(frozen=True, eq=False)
class RuntimeContext:
    """Shared by every component of one runtime; fixed at wrap (the holders it names are mutable)."""

    module: nn.Module
    optimizer: AdamW
    config: OffloadConfig
    backend: Backend
    params: tuple[nn.Parameter, ...]
    param_index: dict[int, int]  # id(param) -> its index
    specs: tuple[ParamSpec, ...]
    dtype: torch.dtype  # compute dtype on the device
    itemsize: int  # bytes per element of ``dtype``
    placeholders: tuple[torch.Tensor, ...]  # what a parameter is bound to while its bucket is not on the device
    budget: int  # device bytes (config.budget, resolved)
    bucket_bytes: int  # target bucket size (config.bucket_bytes, resolved)
    hw: HardwareModel | None  # the machine plans are made for (config.hw, resolved; None: the default)
    memory: DeviceMemory
    stats: dict[str, int]  # counters since wrap (memory_stats()["counters"])
    cpu: Lane  # AdamW (and grad widening/accumulation) of each bucket, in arrival order
    lane_log: LaneLog  # copies and updates of the latest steps, for Engine.export_timeline
    busy: Busy
    phases: Phases
    dp: DataParallel | None  # issue 20: the collectives of a data-parallel engine (runtime/distributed.py)

    @classmethod
    def build(cls, module: nn.Module, optimizer: AdamW, config: OffloadConfig, backend: Backend,
              params: Sequence[nn.Parameter], groups: Sequence[int | None]) -> RuntimeContext:
        """``groups``: each parameter's optimizer param group, None for a frozen one."""
        dtype = config.dtype
        specs = tuple(ParamSpec(p.numel(), g) for p, g in zip(params, groups))
        itemsize = torch.empty((), dtype=dtype).element_size()
        hw = config.hw if isinstance(config.hw, HardwareModel) else None
        cpu = backend.host_lane("cpu-adam")
        return cls(
            module=module, optimizer=optimizer, config=config, backend=backend, params=tuple(params),
            param_index={id(p): i for i, p in enumerate(params)}, specs=specs, dtype=dtype, itemsize=itemsize,
            placeholders=tuple(backend.placeholder(p.shape, dtype) for p in params),
            budget=int(config.budget),
            bucket_bytes=resolve_bucket_bytes(config.bucket_bytes, specs, itemsize, hw or DEFAULT_HW),
            hw=hw,
            memory=DeviceMemory(headroom=backend.headroom_bytes()),  # [Note: headroom] in backend/cuda.py
            stats=_new_stats(), cpu=cpu, lane_log=LaneLog(), busy=Busy(), phases=Phases(),
            dp=_data_parallel(config, cpu, backend.device))


def _data_parallel(config: OffloadConfig, lane: Lane, device: torch.device) -> DataParallel | None:
    # issue 20: grads reduce-scattered on the device, or on the host ([Note: grads reduced on the device])
    reduce = resolve_grad_reduce(config.grad_reduce, device, bool(config.overlap_optimizer))
    dp = DataParallel.resolve(config.process_group, lane, device if reduce == "device" else None,
                              config.share_host_copy)
    if dp is not None and config.device_optimizer:
        # A device-optimizer bucket is updated from its local grad slot, before any reduce-scatter: under data
        # parallel every rank would step on its own grads and the replicas would drift apart, silently.
        raise OffloadError("device_optimizer=True is not supported with data parallel yet (the device update "
                          "would use this rank's grads only); use device_optimizer=False, or "
                          "process_group=False for one engine per process")
    return dp


def _new_stats() -> dict[str, int]:
    return {"replans": 0, "plan_departures": 0, "on_demand_fetches": 0, "planned_fetches": 0,
            "over_budget_fetches": 0, "steps": 0, "skipped_steps": 0, "backwards": 0,
            "eval_plans_built": 0, "h2d_bytes": 0, "d2h_bytes": 0,
            "fast_steps": 0,  # training steps that ran the fast path (offload/runtime/fast_path.py)
            "timed_steps": 0, "compute_replans": 0,  # [Note: timing compute] in runtime/executor.py
            "transient_replans": 0,  # [Note: transients] in runtime/accounting.py
            # issue 20, [Note: weights gathered on the device]: the copies of the weights' gathers (the CPU lane's
            # thread counts them: apart from h2d_bytes and d2h_bytes, which the main thread counts)
            "gather_h2d_bytes": 0, "gather_d2h_bytes": 0,
            # issue 20, [Note: resident weights gathered in their slots]: resident buckets refreshed after step()
            # from the node's ranks (their chunk copied, all-gathered in the slot; h2d_bytes counts the chunks)
            "refresh_gathers": 0,
            # issue 20, [Note: the shared copy checked once per backward]: checks that the node's shared copy is
            # whole (one per backward or step() that updated), and those of them a read inside a backward forced
            "copy_checks": 0, "copy_checks_early": 0}

