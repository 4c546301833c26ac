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
