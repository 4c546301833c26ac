"""[Note: reads the plan did not foresee]

A layer's backward reads its weight to compute its input's gradient; where the input needs no gradient it does
not. So a model whose input requires grad on some passes only has two kinds of backward pass, one with an extra
read of its first layer's weight. A GAN's discriminator meets this on every step of PyTorch's DCGAN recipe: a
pass over real images and one over detached fake ones, whose inputs need no gradient, then the generator's pass
through it, whose input does. A plan made from one kind of pass then saw the other: the step departed, ran off
plan (nothing prefetched, no fast steps) and was planned again, on every step, and warned after three (session
25: 6 departures and 5 re-plans in 6 steps of a DCGAN loop, all resident and streamed alike).

Such a read changes nothing the plan decided when its bucket is on the device and has not been updated in this
backward, so the executor lets it by (``extra_read_allowed``), without moving along its plan; the node keeps the
bucket while it runs (``ParamAccess.node_buckets``), as it does for a planned read. A bucket is updated once its
grads are complete (overlapped and device-optimizer updates run during backward): a read after the bucket's last
planned grad could read the new weights where torch reads the old ones, so there the step departs as before, and
so it does where the bucket is not on the device.

Which pass to plan from is the other half. A plan made from the pass with the read serves both kinds: where a
pass without it runs and the event that came is the one planned just after reads that did not come, those reads
are passed over (``first_after_unread``) and their actions (releases, prefetches, waits) run in order, as though
they had come. But only where that record is known to stand for a pass that comes again (``wider``): a plan made
from a one-off pass (a data-dependent branch that read a weight late, once) may be a poor one for the passes
that follow (tests/runtime/test_off_plan_late_read.py: 5 buckets streamed at 4x the weights), so a pass that
reads less than its plan departs and is planned from, as before, unless the pass its plan came from comes again
right after it. A record becomes ``wider`` (``plan_from``, at the end of each pass) when its pass departed at a
read of a bucket not on the device for the second time (its kind comes again), or when it is the plan's record
again right after a pass that read less departed, or when a pass that read less than its plan departed and is the
very pass that the plan's record departed from by reading more (the two kinds alternate: session 26 found a
streamed plan whose bucket was not on the device at the read depart three times in three steps, and warn, in ~1 of
6 runs of a test, as the host-timed plan kept that bucket or not); later passes that read less are then planned
from it rather than from their own records; a pass neither less nor the same forgets it. So both kinds of pass
settle on one plan after at most two departures and re-plans (before: one each per step, for good). The price of
the third rule: a pass that reads more once, between two of the usual kind, leaves its plan (one more read in
backward, never smaller) in place for the usual passes that follow.
Tests: tests/runtime/test_unforeseen_reads.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..planning.trace import Event, EventKind, Trace
from .residency import Residency

if TYPE_CHECKING:
    from ..planning.schedule import Plan
    from .slots import SlotTable


def last_grads(events: Sequence[Event], bucket_of: Sequence[int], num_buckets: int) -> tuple[int, ...]:
    """Per bucket, the position of its last planned grad (-1: none planned)."""
    last = [-1] * num_buckets
    for i, e in enumerate(events):
        if e.kind is EventKind.GRAD:
            last[bucket_of[e.key]] = i
    return tuple(last)


def extra_read_allowed(pos: int, bucket: int, on_device: bool, last_grad: Sequence[int]) -> bool:
    """An unplanned read of ``bucket``'s weights at plan position ``pos``: let by when the bucket is on the device
    and no update of it can have begun (its last planned grad is still to come, or it has none)."""
    return on_device and (last_grad[bucket] < 0 or last_grad[bucket] >= pos)


def first_after_unread(events: Sequence[Event], pos: int, kind: EventKind, key: int) -> int | None:
    """Where ``(kind, key)`` is planned right after a run of reads from ``pos`` on that did not come: its
    position; else None."""
    j = pos
    while j < len(events) and events[j].kind is EventKind.UNPACK:
        j += 1
        if j < len(events) and events[j].kind is kind and events[j].key == key:
            return j
    return None


def reads_more(wide: Trace, narrow: Trace) -> bool:
    """``narrow`` is the pass ``wide`` recorded, less some backward reads: a plan made from ``wide`` serves both
    (its activations and grads no smaller)."""
    if (wide.num_forward != narrow.num_forward or len(wide.events) <= len(narrow.events)
            or wide.activation_peak_bytes < narrow.activation_peak_bytes or wide.max_grad_bytes < narrow.max_grad_bytes):
        return False
    i = 0
    for e in wide.events:
        if i < len(narrow.events) and e == narrow.events[i]:
            i += 1
        elif e.kind is not EventKind.UNPACK:
            return False
    return i == len(narrow.events)


class UnforeseenReads:
    """The executor's answer to an event its plan did not foresee at ``pos``, and the record to plan from."""

    def __init__(self, slots: SlotTable) -> None:
        self.slots = slots
        self._last: tuple[Plan, tuple[int, ...]] | None = None  # last_grads of the plan, once per plan
        self.wider: Trace | None = None  # a record that reads more than other passes of this loop
        self._read_more = False  # this pass departed at a read its plan lacks (its bucket not on the device)
        self._read_less: Trace | None = None  # this pass departed where reads its plan has did not come
        self._check: Trace | None = None  # the record the last pass read less than: it comes again, or not
        self._departed_more: Trace | None = None  # the latest pass that departed at a read its plan lacks
        self._more_from: Trace | None = None  # the record of the plan this pass departed from at such a read
        self._departed_from: Trace | None = None  # ... and that of the plan ``_departed_more`` departed from

    def plan_from(self, trace: Trace) -> Trace:
        """The record to plan from, ``trace`` being this pass's (its backward over)."""
        read_more, self._read_more = self._read_more, False
        read_less = self._read_less
        check, self._check, self._read_less = self._check, self._read_less, None
        again = read_more and self._departed_more is not None and trace.events == self._departed_more.events
        if read_more:
            self._departed_more, self._departed_from = trace, self._more_from
        more = self._departed_more
        if (read_less is not None and read_less is more and self._departed_from is not None
                and trace.events == self._departed_from.events and reads_more(more, trace)):
            self.wider, self._check = more, None  # the pass before the one that read more came again after it:
            return more  # both kinds come; plan from the one that reads more (its own pass is not awaited)
        if again or (check is not None and trace.events == check.events):
            self.wider = trace  # both kinds of pass come: plan from the one that reads more
        elif self.wider is not None and reads_more(self.wider, trace):
            return self.wider
        elif self.wider is not None and trace.events != self.wider.events:
            self.wider = None  # another loop
        return trace

    def at(self, plan: Plan, pos: int, kind: EventKind, key: int) -> int | None:
        """-1: let an extra read by; the position of the event that came after planned reads that did not come;
        None: the step departs."""
        at = first_after_unread(plan.trace.events, pos, kind, key)
        if at is not None:
            if plan.trace is self.wider:
                return at
            self._read_less = plan.trace  # not yet known to come again (a one-off read): depart, as before
            return None
        if kind is EventKind.UNPACK:
            slots = self.slots
            if self._last is None or self._last[0] is not plan:
                self._last = (plan, last_grads(plan.trace.events, slots.bucket_of, len(slots.state)))
            b = slots.bucket_of[key]
            if extra_read_allowed(pos, b, True, self._last[1]):  # before the bucket's update can begin
                if slots.state[b] is Residency.DEVICE:
                    return -1
                self._read_more, self._more_from = True, plan.trace
        return None
