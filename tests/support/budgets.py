"""Budgets for tests that run on CUDA too: what the plan may fill, plus the runtime headroom the CUDA backend
measures and keeps out of the plan (cuBLAS workspaces, allocator rounding; 0 on the CPU backend), so a budget
sized for a tiny model is not refused there and the CPU figures do not change."""

from __future__ import annotations

import functools

import torch

from offload.backend import headroom_bytes


@functools.cache
def _headroom(device: str) -> int:
    return headroom_bytes(device)


def with_headroom(plan_bytes: int, device: str | torch.device = "cpu") -> int:
    """``plan_bytes`` for the plan, plus what an engine on ``device`` keeps out of it."""
    device = torch.device(device)
    return int(plan_bytes) + (0 if device.type == "cpu" else _headroom(str(device)))


def fresh_device_peak(device: str | torch.device = "cpu") -> None:
    """Just before a test wraps its engine on CUDA, after a reference trained on the same GPU: reset the
    process's allocator peak. An engine's device peak is that process-wide peak above what was allocated when
    it was made ([Note: peaks] in offload/backend/cuda.py), so a reference's earlier, larger peak (its weights,
    grads, AdamW state and activations at once) would stand in for the engine's. The first CUDA runs of the
    streaming numerics tests (2026-11-27, H200) read 1-15 MB over budgets the engine kept. A no-op on the CPU,
    where the peak is the runtime's own accounting."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
