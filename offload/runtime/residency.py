"""Residency of a parameter bucket: one state machine per bucket, transitions asserted by the runtime.

    HOST --fetch--> IN_FLIGHT --wait--> DEVICE --release--> HOST

and where a bucket on the device lives (``_Slot``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Residency(enum.Enum):
    HOST = "host"
    """Only the host copy exists; the bucket's parameters are placeholders."""
    IN_FLIGHT = "in flight"
    """A host-to-device copy is issued; its event must be waited on before use."""
    DEVICE = "device"
    """On the device; the bucket's parameters are views of its slot."""


_ALLOWED = {
    (Residency.HOST, Residency.IN_FLIGHT),
    (Residency.IN_FLIGHT, Residency.DEVICE),
    (Residency.DEVICE, Residency.HOST),
    (Residency.IN_FLIGHT, Residency.HOST),
    (Residency.DEVICE, Residency.IN_FLIGHT),  # a resident bucket refreshed after the optimizer step
}


@dataclass
class _Slot:
    storage: torch.Tensor  # uint8 device tensor: the arena, or a bucket-sized on-demand allocation
    offset: int  # byte offset of the bucket in ``storage``
    planned: int | None  # plan buffer id, None when allocated on demand
