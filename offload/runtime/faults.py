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
  kept (they are correct updates from complete gradients) and the warning names them. With
  ``overlap_optimizer=False`` a failed backward changes no weight: ``zero_grad()`` and the next step give
  exactly what plain PyTorch gives.

A backward started with ``engine.backward(loss)`` is cleaned up as the exception leaves it; one started
with a plain ``loss.backward()`` is noticed (and cleaned up) by the next forward, ``zero_grad()``,
``step()`` or ``clip_grad_norm_()``.
"""

from __future__ import annotations

import sys
import warnings

import torch

from ..errors import OffloadError, OffloadWarning


def _describe(error: BaseException | None) -> str:
    return "did not finish" if error is None else f"raised {type(error).__name__}: {error}"


def abort_forward(rt, error: BaseException | None) -> None:
    """The forward of ``rt`` (a :class:`offload.runtime.core.Runtime`) raised ``error`` (None: it was noticed
    later that a forward never finished): release what it fetched and warn."""
    streamed = sum(1 for b, slot in rt.slot.items() if not rt._is_resident(b, slot))
    tracing = rt.original is not None
    streamed += len(rt.trace_views)
    under_way = bool(rt.recorder.stack)
    rt.abort_forward()
    if not (under_way or streamed):
        return  # it failed before it began (e.g. a check at its start): nothing to discard
    what = "its saved activations"
    if streamed:
        what = f"{streamed} parameter bucket(s) it had brought to the device (released), and {what}"
    if tracing:
        what += "; the first step is traced again by the next forward"
    _warn(f"offload: the forward {_describe(error)}. Discarded: {what}. The engine is ready for the next forward.",
          error)


def watch_root(rt) -> None:
    """Notice an exception leaving the wrapped module's forward when it is called directly (not through the
    engine): a forward hook with ``always_call`` runs even then (not for KeyboardInterrupt, which torch
    lets through; that one is noticed by the next forward)."""
    def hook(module, args, output):
        if rt.recorder.stack and not rt.engine_call:  # it did not reach its end (through the engine: see there)
            abort_forward(rt, sys.exc_info()[1])

    rt._handles.append(rt.module.register_forward_hook(hook, always_call=True))


def abort_backward(rt, error: BaseException | None) -> None:
    """The backward of ``rt`` raised ``error`` (None: noticed later): see [Note: what a fault discards]."""
    if not rt.in_backward:  # it raised before reaching anything of the engine's: nothing was gathered
        with torch.no_grad():
            rt._release_all()  # what the forward streamed in (as the next forward would)
        rt.pos = 0
        return
    problems = []
    with torch.no_grad():
        try:
            rt.cpu.drain()  # AdamW already submitted reads grads and writes masters: let it finish
        except OffloadError as e:
            problems.append(str(e))
        rt.backend.synchronize()
        for b, (view, k) in list(rt.grad_slots.items()):
            if k is None:  # an on-demand slot (planned ones are bytes of the arena)
                rt.memory.add("slots", -view.numel() * rt.itemsize)
        rt.grad_slots.clear()
        rt._reclaim(block=True)
        rt.grad_copies = []
        arrived = sum(len(ps) for ps in rt.received.values())
        if rt.deferred:
            updated, dropped = [], sorted(rt.pending)
        else:  # overlap: every bucket in pending had its update submitted (and now run)
            updated, dropped = sorted(rt.pending), []
        for p in rt.params:
            p.grad = None
        rt._clear_grads()
        rt.next_backward_scale = None
        rt._release_all()
        rt._refresh_resident(set(updated))  # updated before the fault and resident: bring the new weights
        rt._reset_step()
        rt.backward_seen = False  # the failed backward does not count for step()

    what = [f"the gradients of {arrived} parameter(s) that had reached the engine in this backward"]
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
    if problems:
        msg += " Background work also failed: " + "; ".join(problems)
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
        error.add_note(message)


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> 'buckets 0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return "buckets " + ", ".join(out)


def check_backward_finished(rt, what: str | None) -> None:
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
