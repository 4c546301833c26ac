"""Residency of a parameter bucket: one state machine per bucket, every transition checked (a bad one
raises :class:`~offload.errors.InvariantError`; ``python -O`` strips asserts, not raises):

    HOST --fetch--> IN_FLIGHT --wait--> DEVICE --release--> HOST

and the records the slot table keeps about buckets on the device: where one lives (:class:`Slot`), which
parameter a saved weight view names (:class:`ParamRef`) and an on-demand grad slot kept until the copy that
reads it has finished (:class:`Freeing`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backend.base import Event
from ..errors import InvariantError


class Residency(enum.Enum):
    HOST = "host"
    """Only the host copy exists; the bucket's parameters are placeholders."""
    IN_FLIGHT = "in flight"
    """A host-to-device copy is issued; its event must be waited on before use."""
    DEVICE = "device"
    """On the device; the bucket's parameters are views of its slot."""


TRANSITIONS = frozenset({
    (Residency.HOST, Residency.IN_FLIGHT),
    (Residency.IN_FLIGHT, Residency.DEVICE),
    (Residency.DEVICE, Residency.HOST),
    (Residency.IN_FLIGHT, Residency.HOST),
    (Residency.DEVICE, Residency.IN_FLIGHT),  # a resident bucket refreshed after the optimizer step
})


def check_move(b: int, old: Residency, new: Residency) -> None:
    if (old, new) not in TRANSITIONS:
        raise InvariantError(f"bucket {b}: illegal residency change {old.value} -> {new.value}")


@dataclass
class Slot:
    """Where a bucket on the device lives."""

    storage: torch.Tensor  # uint8 device tensor: the arena, or a bucket-sized on-demand allocation
    offset: int  # byte offset of the bucket in ``storage``
    planned: int | None  # plan buffer id, None when allocated on demand


class ParamRef:
    """A saved tensor that is a view of a parameter (see [Note: saved parameters] in param_access.py)."""

    __slots__ = ("param", "byte_offset", "size", "stride", "dtype", "version")

    def __init__(self, param: int, byte_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                 dtype: torch.dtype, version: int = 0) -> None:
        self.param, self.byte_offset, self.size, self.stride, self.dtype = param, byte_offset, size, stride, dtype
        self.version = version  # its bucket's SlotTable.versions when saved (0: the traced step, before any)


class Freeing(NamedTuple):
    """An on-demand grad slot whose device-to-host copy may still be reading it: (tensor, event) held
    until the event completed, then its bytes are given back."""

    event: Event
    nbytes: int
    slot: torch.Tensor
