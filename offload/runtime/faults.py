"""Faults mid-step: an exception (or ``KeyboardInterrupt``) inside forward or backward leaves the engine
usable, with nothing leaked, and a warning that says what was discarded.

[Note: what a fault discards]
* Forward: the buckets fetched for it are released (slots freed, parameters back to placeholders), its
  saved activations die with its autograd graph, and the next forward starts from the first plan event.
  Gradients gathered by earlier backward passes of this step (accumulation) are kept.
* Backward: copies and CPU work in flight are finished first (nothing is freed under a copy), then every
  gradient slot is freed and the gradients gathered since the last ``step()`` are dropped, as
  ``zero_grad()`` would drop them. With ``overlap_optimizer=True`` a bucket whose gradients were all in
  before the fault has already been updated by AdamW (that is what the overlap is); such updates are
  kept (they are correct updates from complete gradients) and the warning names them; in the first step,
  whose updates wait for its plan ([Note: refusing the first step whole] in warmup.py), none ran. With
  ``overlap_optimizer=False`` a failed backward changes no weight: ``zero_grad()`` and the next step give
  exactly what plain PyTorch gives.

A backward started with ``engine.backward(loss)`` is cleaned up as the exception leaves it; one started
with a plain ``loss.backward()`` is noticed (and cleaned up) by the next forward, ``zero_grad()``,
``step()`` or ``clip_grad_norm_()``.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import OffloadError, OffloadWarning

if TYPE_CHECKING:
    from .core import Runtime


def _describe(error: BaseException | None) -> str:
    return "did not finish" if error is None else f"raised {type(error).__name__}: {error}"


def abort_forward(rt: Runtime, error: BaseException | None) -> None:
    """The forward of ``rt`` raised ``error`` (None: it was noticed later that a forward never finished):
    release what it fetched and warn."""
    found = rt.abort_forward()
    if not (found.under_way or found.streamed):
        return  # it failed before it began (e.g. a check at its start): nothing to discard
    what = "its saved activations"
    if found.streamed:
        what = f"{found.streamed} parameter bucket(s) it had brought to the device (released), and {what}"
    if found.tracing:
        what += "; the first step is traced again by the next forward"
    _warn(f"offload: the forward {_describe(error)}. Discarded: {what}. The engine is ready for the next forward.",
          error)


def root_watcher(rt: Runtime) -> Callable[[nn.Module, Any, Any], None]:
    """A forward hook (registered with ``always_call``) that notices an exception leaving the wrapped
    module's forward when it is called directly (not through the engine): it runs even then (not for
    KeyboardInterrupt, which torch lets through; that one is noticed by the next forward)."""
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if rt.forward_under_way() and not rt.engine_call:  # it did not reach its end (through the engine: see there)
            abort_forward(rt, sys.exc_info()[1])
    return hook


def abort_backward(rt: Runtime, error: BaseException | None) -> None:
    """The backward of ``rt`` raised ``error`` (None: noticed later): see [Note: what a fault discards]."""
    found = rt.abort_backward()
    if found is None:  # it raised before reaching anything of the engine's: nothing was gathered
        return
    updated, dropped = found.updated, found.dropped
    what = [f"the gradients of {found.arrived} parameter(s) that had reached the engine in this backward"]
    if dropped:
        what.append(f"every gradient gathered since the last step() ({len(dropped)} bucket(s)), as zero_grad() "
                    "would")
    msg = f"offload: the backward {_describe(error)}. Discarded: {'; '.join(what)}."
    if updated:
        msg += (f" Kept: AdamW updates of {len(updated)} bucket(s) ({_ranges(updated)}) whose gradients were "
                "complete before the failure: overlap_optimizer=True applies each bucket's update as soon as its "
                "gradients are in. Wrap with overlap_optimizer=False for all-or-nothing steps.")
    else:
        msg += " No weight was changed."
    if found.problems:
        msg += " Background work also failed: " + "; ".join(found.problems)
    msg += " Call zero_grad() and go on with the next step."
    _warn(msg, error)


def _warn(message: str, error: BaseException | None) -> None:
    """Warn; where a filter turns the warning into an error while ``error`` is propagating, the message goes
    onto ``error`` as a note instead, so that a warnings filter never hides the exception that caused it."""
    try:
        warnings.warn(message, OffloadWarning, stacklevel=4)
    except OffloadWarning:
        if error is None:
            raise
        if sys.version_info >= (3, 11):
            error.add_note(message)
        else:  # PEP 678 notes by hand: Python 3.10's traceback does not print them, the attribute is there
            error.__notes__ = [*getattr(error, "__notes__", ()), message]  # type: ignore[attr-defined]


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> 'buckets 0-2, 5'."""
    out: list[str] = []
    start: int | None = None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return "buckets " + ", ".join(out)


def check_backward_finished(rt: Runtime, what: str | None) -> None:
    """Called by forward, ``step()``, ``zero_grad()`` and ``clip_grad_norm_()``: a backward that began but
    never reached its end either is running now or raised; clean up after one that raised. ``what`` names
    the caller, which may not run during backward (None: it may, e.g. a forward recomputed in backward)."""
    if not rt.in_backward:
        return
    if torch._C._current_autograd_node() is not None:  # inside the autograd engine: still running
        if what is not None:
            raise OffloadError(f"{what} was called during backward")
        return
    abort_backward(rt, None)
