"""Backends: the only code that touches streams, events, pinning and device memory."""

from __future__ import annotations

import torch

from .base import DONE, Event, HostEvent, Lane
from .cpu import CPUBackend

__all__ = ["CPUBackend", "DONE", "Event", "HostEvent", "Lane", "make_backend"]


def make_backend(device: torch.device):
    if device.type == "cpu":
        return CPUBackend()
    raise NotImplementedError(
        f"the {device.type} backend is not implemented yet; pass device='cpu' to use the CPU backend")
