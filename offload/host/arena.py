"""One exact-size host region (C++ ``PinnedArena``: mmap'd, 2 MiB-aligned, first-touched) with typed tensor
views. Pinning it (``cudaHostRegister``) is the CUDA backend's job, not this module's."""

from __future__ import annotations

import torch

from .. import _C

__all__ = ["HostArena", "numa_node_of_pci_device"]


def _require_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


class HostArena:
    """Exact-size host region (C++ PinnedArena) with typed tensor views.

    ``touch_threads`` threads back its pages at construction (0: one per core); ``numa_node`` runs them
    on that node's CPUs so the pages land there (for a GPU, its node: ``numa_node_of_pci_device``);
    ``populate`` backs each thread's range with one ``madvise(MADV_POPULATE_WRITE)`` instead of a write
    per page, where the kernel has it (``touch_method`` says which happened). Off by default: no
    consistent gain where measured (see ``cpp/pinned_arena.h``).
    """

    def __init__(self, size_bytes: int, touch_threads: int = 0, numa_node: int | None = None,
                 populate: bool = False) -> None:
        _require_int("size_bytes", size_bytes)
        _require_int("touch_threads", touch_threads)
        if size_bytes < 0 or touch_threads < 0:
            raise ValueError(
                f"size_bytes and touch_threads must be >= 0, got {size_bytes} and {touch_threads}"
            )
        if numa_node is not None:
            _require_int("numa_node", numa_node)
            if numa_node < 0:
                raise ValueError(f"numa_node must be >= 0 or None, got {numa_node}")
        self._arena = _C.PinnedArena(size_bytes, touch_threads, -1 if numa_node is None else numa_node,
                                     bool(populate))
        # Made once. frombuffer holds a reference to the C++ arena, so views outlive this object
        # safely; it rejects empty buffers, hence the special case.
        if size_bytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
        else:
            self.tensor = torch.frombuffer(self._arena, dtype=torch.uint8)

    @property
    def touch_method(self) -> str:
        """How the pages were backed: "populate" (madvise), "write" (a store per page) or "none" (empty)."""
        return self._arena.touch_method

    @property
    def size_bytes(self) -> int:
        return self._arena.size_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes mapped: ``size_bytes`` rounded up to 2 MiB."""
        return self._arena.reserved_bytes

    @property
    def data_ptr(self) -> int:
        """Address of byte 0 (2 MiB-aligned; 0 for an empty arena), e.g. for cudaHostRegister."""
        return self._arena.data_ptr

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements starting at byte ``offset``."""
        _require_int("offset", offset)
        _require_int("numel", numel)
        itemsize = dtype.itemsize
        if offset < 0 or numel < 0:
            raise ValueError(f"offset and numel must be >= 0, got {offset} and {numel}")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} (itemsize {itemsize})")
        end = offset + numel * itemsize
        if end > self.size_bytes:
            raise ValueError(
                f"view [{offset}, {end}) is past the end of the arena ({self.size_bytes} bytes)"
            )
        return self.tensor[offset:end].view(dtype)

    def exact_view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Like :meth:`view`, but the tensor's storage is exactly those bytes (``torch.frombuffer`` over the
        arena: no copy), where :meth:`view`'s shares the whole arena's storage; so ``torch.save`` of it writes
        those bytes and nothing else of the arena."""
        return torch.frombuffer(self._arena, dtype=dtype, count=numel, offset=offset)

    def reserve(self, offset: int, size: int) -> None:
        """Claim ``[offset, offset + size)`` (for example a planned offset)."""
        self._arena.reserve(offset, size)

    def allocate(self, size: int, alignment: int = 64) -> int:
        """Best-fit allocation; returns the offset. ``MemoryError`` if no free gap fits."""
        return self._arena.allocate(size, alignment)

    def release(self, offset: int) -> None:
        """Free a ``reserve``d or ``allocate``d range and merge it with its free neighbours."""
        self._arena.release(offset)

    def stats(self) -> dict[str, int]:
        return self._arena.stats()

    def __repr__(self) -> str:
        return f"HostArena({self._arena!r})"


def numa_node_of_pci_device(bus_id: str) -> int | None:
    """The NUMA node of a PCI device (for example a GPU, ``"0000:3b:00.0"``), or None where the machine
    has no NUMA or does not say."""
    from pathlib import Path

    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
