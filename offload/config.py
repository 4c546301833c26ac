"""User-facing configuration: one frozen dataclass, validated on construction, and byte-size parsing."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist

from .planning.hw import HardwareModel, load_hw

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_MAX_BYTES = 2**63 - 1  # sizes cross into the C++ core (and torch) as int64
_ACCEPTED = 'an int number of bytes or a string such as "64MiB", "8GiB", "1.5GB", "512KiB", "1048576"'


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """Parse ``8GiB``-style sizes (binary and decimal units) or plain byte counts into an int > 0."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be {_ACCEPTED}; got the bool {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{what} must be a whole, finite number of bytes; got {value!r}. Use {_ACCEPTED}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot parse {what} {value!r}; use {_ACCEPTED}")
        number = m.group(1)
        if number.isdigit():  # exact, however many digits: no detour through a float
            n = int(number) * _UNITS[unit]
        else:
            scaled = float(number) * _UNITS[unit]
            # "1e400", "1e308TiB": inf, and int(inf) is an OverflowError; the range check below says why
            n = int(scaled) if math.isfinite(scaled) else _MAX_BYTES + 1
    else:
        raise TypeError(f"{what} must be {_ACCEPTED}; got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{what} must be positive; got {value!r}")
    if n > _MAX_BYTES:
        raise ValueError(f"{what} {value!r} is too large: at most 2**63 - 1 bytes (the C++ core's sizes are "
                         f"int64); use {_ACCEPTED}")
    return n


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


GRAD_REDUCE = ("auto", "device", "host")  # OffloadConfig.grad_reduce (issue 20)


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (the rules of ``torch.amp.GradScaler``): the loss is multiplied by
    ``scale`` before backward; a step whose grads hold an inf or NaN is skipped and the scale is
    multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a row it is multiplied by
    ``growth_factor``."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0; got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1; got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1); got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1; got {self.growth_interval!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """How the engine may use the device. Sizes accept ints (bytes) or strings like ``"8GiB"``."""

    budget: int | str
    """Device memory the engine may use in all: parameter arena, activations, grads in flight, buffers."""
    dtype: torch.dtype = torch.float32
    """Compute dtype on the device. Masters and Adam state are always fp32 on the host."""
    device: str | torch.device | None = None
    """``None`` picks cuda when present, else cpu (the CPU backend: a real, asynchronous stand-in)."""
    bucket_bytes: int | str = "auto"
    """Target size of a parameter bucket, the unit that moves between host and device. ``"auto"``: the
    smallest copy that reaches 90 % of the link's peak bandwidth on ``hw``'s curve, at most 1/8 of the
    model's weights (:func:`offload.planning.buckets.auto_bucket_bytes`)."""
    overlap_optimizer: bool | None = None
    """True: run a bucket's AdamW on the CPU as soon as its grads reach the host, while backward goes on.
    That needs one backward per step and no look at the grads in between, so gradient accumulation and
    ``clip_grad_norm_`` need False: grads gather on the host and the updates run in ``step()`` (same
    numbers, less overlap). ``None`` (default): True, except with a loss scale (float16 always has one), whose
    unscaling and overflow check must see every grad before any update."""
    loss_scale: LossScaleConfig | None = None
    """Dynamic loss scaling. float16 always has it (these defaults when None); another dtype has it only when
    given, and then its updates run in ``step()`` (``overlap_optimizer`` resolves to False; True raises)."""
    activation_checkpointing: Union[None, str, Sequence[str], Callable] = None
    """Recompute some modules' forward in backward instead of keeping their activations (non-reentrant
    ``torch.utils.checkpoint``; numbers unchanged). ``"auto"``: the engine measures what each transformer
    block saves and checkpoints the fewest blocks that make the step fit the budget. A list of module names
    (as in ``model.named_modules()``), or a callable ``(name, module) -> bool``, checkpoints those always.
    None (default): nothing is checkpointed."""
    hw: HardwareModel | str | os.PathLike | None = None
    """The machine the scheduler plans for: a :class:`offload.planning.hw.HardwareModel`, a preset name (``"pcie3"``,
    ``"pcie4"``, ``"pcie5"``: nominal figures) or the path of the JSON that ``offload probe --json`` wrote
    (measured). Resolved once, here, with :func:`offload.planning.hw.load_hw`. ``None``: the ``pcie4`` preset."""
    process_group: Any = None
    """Data parallel (issue 20, ``offload/runtime/distributed.py``): ``None`` (default) trains data parallel over
    the default group when ``torch.distributed`` is initialised at wrap, each rank holding 1/N of the optimizer
    state; a ``torch.distributed.ProcessGroup`` picks that group; ``False`` opts out (one engine per process)."""
    grad_reduce: str = "auto"
    """Where a data-parallel engine reduce-scatters a bucket's grads (issue 20): ``"device"``, in its device grad
    slot (NCCL on CUDA, gloo on the CPU backend), then only this rank's 1/N shard goes to the host; ``"host"``,
    the whole bucket goes to the host and gloo reduce-scatters it there. ``"auto"`` (default): ``"device"`` on
    CUDA with overlapped updates, else ``"host"``. Deferred updates (``overlap_optimizer=False``) always use the
    host. No effect without data parallel ([Note: grads reduced on the device] in runtime/device_collectives.py)."""
    share_host_copy: bool | None = None
    """Whether the data-parallel ranks of one node share one host copy of the weights in the compute dtype
    (issue 20, [Note: one host copy per node] in host/node_copy.py): a file in ``/dev/shm`` each rank maps, each
    rank writing its shard's updated weights into it, so no all-gather of the weights is needed and the node
    holds one copy instead of one per rank (2 B/param per rank less in 16 bits). ``None`` (default): share when
    every rank of the group is on this host and ``/dev/shm`` has room (else each rank keeps its own copy: across
    hosts silently, as designed; on one host with a warning saying why); ``True``: share or raise; ``False``:
    never. No effect without data parallel."""
    device_optimizer: bool = False
    """Let the planner keep some buckets' optimizer on the device (issue 18): their fp32 master, Adam m and v
    live in the device arena and are updated there as soon as the bucket's grads are complete (no grad copy,
    no CPU AdamW, no weight copy for them). The planner chooses which buckets, from the cost model and the
    budget (possibly none). With ``overlap_optimizer=False`` (accumulation, clipping, float16) their grads
    are still summed on the host, and come back to the device for the update in ``step()``. False (default):
    every update runs on the CPU, as before."""
    calibrate_compute: bool | None = None
    """Time the model's compute once more on the first full step that follows a new plan, with the backend's
    clock of compute (CUDA events on the compute stream), and plan again from that step if its compute time is
    more than 25 % off the plan's (``memory_stats()["compute_timing"]``). The first plan comes from the
    first, traced step, whose times on CUDA are host times: lazy initialisation and kernel launches, not the
    kernels (measured: 2.62 s traced against 0.056 s of forward + backward, gpt2-xl on an H200). ``None``
    (default): on for CUDA, off for the CPU backend, whose traced times are host compute already."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "budget", parse_bytes(self.budget, "budget"))
        if self.bucket_bytes != "auto":
            set_(self, "bucket_bytes", parse_bytes(self.bucket_bytes, "bucket_bytes"))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.float32; got {self.dtype!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype} is not supported; use one of "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        set_(self, "device", _resolve_device(self.device))
        if self.overlap_optimizer is None:  # a loss scale's unscaling and inf skip need every grad first
            set_(self, "overlap_optimizer", self.dtype != torch.float16 and self.loss_scale is None)
        if not isinstance(self.overlap_optimizer, bool):
            raise TypeError(f"overlap_optimizer must be a bool or None; got {self.overlap_optimizer!r}")
        if self.overlap_optimizer and self.dtype == torch.float16:
            raise ValueError("overlap_optimizer=True cannot be used with float16: a step whose grads overflow "
                             "must be skipped, which is only known once every grad has arrived. Leave "
                             "overlap_optimizer unset (or False), or compute in torch.bfloat16")
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScaleConfig):
            raise TypeError(f"loss_scale must be an offload.LossScaleConfig; got {self.loss_scale!r}")
        if self.overlap_optimizer and self.loss_scale is not None:
            raise ValueError("overlap_optimizer=True cannot be used with loss_scale: the updates must unscale the "
                             "grads and skip a step whose grads overflow, which is only known once every grad has "
                             "arrived. Leave overlap_optimizer unset (or False) with a loss scale, or drop "
                             "loss_scale (bfloat16 and float32 need none)")
        if self.dtype == torch.float16 and self.loss_scale is None:
            set_(self, "loss_scale", LossScaleConfig())
        set_(self, "activation_checkpointing", _checkpointing(self.activation_checkpointing))
        _check_device_optimizer(self.device_optimizer)
        if self.calibrate_compute is None:
            set_(self, "calibrate_compute", self.device.type == "cuda")
        if not isinstance(self.calibrate_compute, bool):
            raise TypeError(f"calibrate_compute must be True, False or None; got {self.calibrate_compute!r}")
        if self.hw is not None:
            if not isinstance(self.hw, (HardwareModel, str, os.PathLike)):
                raise TypeError(f"hw must be a HardwareModel, a preset name or a probe JSON path; got {self.hw!r}")
            set_(self, "hw", load_hw(self.hw))  # ValueError naming the presets for an unknown name or file
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f'grad_reduce must be "auto", "device" or "host"; got {self.grad_reduce!r}')
        if self.grad_reduce == "device" and not self.overlap_optimizer:
            raise ValueError('grad_reduce="device" needs overlap_optimizer=True: deferred updates (accumulation, '
                             'clipping, float16) sum whole buckets on the host over backward passes. Use '
                             'grad_reduce="auto" or "host" with overlap_optimizer=False')
        if self.share_host_copy not in (None, True, False):
            raise TypeError(f"share_host_copy must be None, True or False; got {self.share_host_copy!r}")
        if not (self.process_group is None or self.process_group is False
                or (dist.is_available() and isinstance(self.process_group, dist.ProcessGroup))):
            raise TypeError("process_group must be None (the default group, when torch.distributed is "
                            "initialised), False (no data parallel) or a torch.distributed.ProcessGroup; got "
                            f"{self.process_group!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _check_device_optimizer(value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"device_optimizer must be a bool; got {value!r}")


def _checkpointing(value):
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f'activation_checkpointing must be None, "auto", a list of module names or a callable '
                             f'(name, module) -> bool; got the string {value!r} (for one module, pass [{value!r}])')
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        if not value:
            raise ValueError("activation_checkpointing=[] names no module; use None to checkpoint nothing")
        return tuple(value)
    raise TypeError(f'activation_checkpointing must be None, "auto", a list of module names or a callable '
                    f"(name, module) -> bool; got {value!r}")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be None, 'cpu', 'cuda' or a torch.device; got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda; got {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch.cuda.is_available() is False; use device='cpu'")
    return dev
