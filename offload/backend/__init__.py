"""Backends: the only code that touches streams, events, pinning and device memory."""

from __future__ import annotations

import os

import torch

from ..testing.chaos import ChaosConfig
from .base import DONE, Backend, Event, HostEvent, Lane
from .cpu import CPUBackend
from .cuda import CUDABackend

__all__ = ["Backend", "CPUBackend", "CUDABackend", "DONE", "Event", "HostEvent", "Lane", "headroom_bytes",
           "make_backend"]


def make_backend(device: str | torch.device, chaos: ChaosConfig | None = None) -> Backend:
    """The backend for ``device``: ``cpu`` (the asynchronous CPU stand-in) or ``cuda[:index]``; ``chaos``
    puts random delays around its copies (see offload.testing.chaos)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:<index>' or a torch.device; got {device!r}") from e
    if device.type == "cpu":
        return CPUBackend(chaos=chaos, inline_copies=cpu_copies() == "inline")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for but torch.cuda.is_available() is False (no GPU, or a "
                             "CPU-only torch build); use device='cpu' for the CPU backend")
        index = torch.cuda.current_device() if device.index is None else device.index
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(f"device {device} does not exist: this machine has {count} CUDA device(s)")
        # An explicit index: tensors report cuda:N, and the runtime compares devices.
        return CUDABackend(torch.device("cuda", index), chaos=chaos)
    raise ValueError(f"no backend for device type {device.type!r}; use 'cuda' or 'cpu'")


def cpu_copies() -> str:
    """How the CPU backend runs its copies ([Note: inline copies] in backend/cpu.py): ``OFFLOAD_CPU_COPIES``,
    ``inline`` (the default: a copy, or a bucket's AdamW, that could start now runs on the issuing thread) or
    ``lanes`` (every copy and update on its lane's thread, as the test suite runs)."""
    mode = os.environ.get("OFFLOAD_CPU_COPIES", "inline")
    if mode not in ("inline", "lanes"):
        raise ValueError(f"OFFLOAD_CPU_COPIES must be 'inline' or 'lanes'; got {mode!r}")
    return mode


def headroom_bytes(device: str | torch.device) -> int:
    """Device bytes an engine on ``device`` keeps out of its plan: on CUDA the cuBLAS workspaces and allocator
    rounding it measures ([Note: headroom] in backend/cuda.py), on the CPU 0. A budget given as "this much for
    the plan" adds it (the examples' default budgets do)."""
    backend = make_backend(device)
    try:
        return backend.headroom_bytes()
    finally:
        backend.close()
