"""Host memory page-locked for the CUDA backend ([Note: pinning] in ``cuda.py``): the registry of ranges given to
``cudaHostRegister``, and the release that the backend's ``close()`` and finalizer run."""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

from ..errors import HostMemoryError, InvariantError, OffloadError

__all__ = ["HostRegistry", "release_pinned"]

# cudaHostRegisterPortable: pinned for every CUDA context, not only the one current when registering (the
# engine may run on cuda:1 while cuda:0 is current); as torch's own pin_memory utilities register.
_HOST_REGISTER_PORTABLE = 1


class HostRegistry:
    """Host ranges page-locked with ``cudaHostRegister``, each registered once, until :meth:`release_all`.

    Each range keeps a reference to its owner (the arena), so the memory cannot be unmapped while it is
    registered. ``cudart`` is a callable returning ``torch.cuda.cudart()`` (or a fake, in tests).
    """

    def __init__(self, cudart: Callable[[], object]) -> None:
        self._cudart = cudart
        self._ranges: dict[int, tuple[int, object]] = {}  # address -> (bytes, owner kept alive)

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self._ranges.values())

    def ranges(self) -> list[tuple[int, int]]:
        return sorted((ptr, n) for ptr, (n, _) in self._ranges.items())

    def register(self, ptr: int, nbytes: int, owner: object) -> bool:
        """Page-lock ``[ptr, ptr + nbytes)``; False if there is nothing to do (empty, or already registered)."""
        if nbytes == 0:
            return False
        have = self._ranges.get(ptr)
        if have is not None:
            if have[0] != nbytes:
                raise InvariantError(f"host range at {ptr:#x} is already pinned with {have[0]} bytes, not {nbytes}")
            return False
        for start, (n, _) in self._ranges.items():
            if ptr < start + n and start < ptr + nbytes:
                raise InvariantError(f"host range [{ptr:#x}, +{nbytes}) overlaps the pinned range [{start:#x}, +{n})")
        cudart = self._cudart()
        err = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
        if err != 0:
            _clear_last_error(cudart)
            raise HostMemoryError(
                f"cudaHostRegister of the {nbytes}-byte host arena failed with CUDA error {err}. Without pinned "
                "memory host/device copies cannot overlap compute. Check `ulimit -l` (locked-memory limit) and "
                "free host RAM; an earlier asynchronous CUDA error can also surface here "
                "(rerun with CUDA_LAUNCH_BLOCKING=1 to find it).")
        self._ranges[ptr] = (nbytes, owner)
        return True

    def release(self, ptr: int) -> None:
        """Unregister the range at ``ptr`` (registered by :meth:`register`; nothing to do if it is not)."""
        if ptr not in self._ranges:
            return
        cudart = self._cudart()
        err = int(cudart.cudaHostUnregister(ptr))
        del self._ranges[ptr]  # forgotten either way: retrying an unregister cannot help
        if err != 0:
            _clear_last_error(cudart)
            raise OffloadError(f"cudaHostUnregister failed for the range at {ptr:#x} (CUDA error {err})")

    def release_all(self) -> None:
        """Unregister every range (all are tried; the first failure is raised after)."""
        failures = []
        for ptr in list(self._ranges):
            cudart = self._cudart()
            err = int(cudart.cudaHostUnregister(ptr))
            del self._ranges[ptr]  # forgotten either way: retrying an unregister cannot help
            if err != 0:
                _clear_last_error(cudart)
                failures.append((ptr, err))
        if failures:
            raise OffloadError(f"cudaHostUnregister failed for {len(failures)} range(s): "
                               + ", ".join(f"{p:#x} (CUDA error {e})" for p, e in failures))


def _clear_last_error(cudart) -> None:
    """Reset CUDA's last error (per host thread) after a runtime call that failed and was handled here.

    torch's cudart bindings return the error of ``cudaHostRegister``/``cudaHostUnregister`` but leave it set
    (``C10_CUDA_ERROR_HANDLED``); the next ``C10_CUDA_KERNEL_LAUNCH_CHECK`` (after any kernel) would read it
    with ``cudaGetLastError`` and fail that kernel with our error. torch exposes no ``cudaGetLastError``, so
    where ``cudart`` lacks it the function is called in the CUDA runtime torch loaded (found by soname,
    never loaded anew: its error state is the one to clear)."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:  # not loaded under that name (or statically linked into torch: nothing to reach)
            continue
        lib.cudaGetLastError()
        return


def release_pinned(streams: list, pinned: HostRegistry) -> None:
    """Finalizer and close(): wait for the copy streams (a copy may still read or write the pinned arena),
    then unregister it."""
    try:
        for stream in streams:
            stream.synchronize()
    finally:
        streams.clear()
        pinned.release_all()
