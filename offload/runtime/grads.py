"""The runtime's backward and optimizer side: gradients gathered per bucket in a device grad slot, copied to
the host as soon as the bucket's grads are final, summed over backward passes (accumulation), their norms
for clipping, and the AdamW updates they feed (overlapped with backward, or deferred to ``step()``).

A part of :class:`offload.runtime.core.Runtime`, split out by concern; its state is set up in
``Runtime.__init__`` and ``Runtime._reset_step``. Like the rest of the runtime it executes the plan
(``plan.grad_buffer``) and touches streams only through the backend."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.autograd import Variable

from ..errors import OffloadError
from ..planning.trace import EventKind
from . import faults, guards


class GradientsMixin:
    """Backward hooks, gradient transfer and accumulation, clipping and the optimizer step of the runtime."""

    # ---------------------------------------------------------------------------------------------------
    # backward: grads

    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        if self.awaiting_step and not self.deferred:
            raise OffloadError(
                "a second backward ran before optimizer.step(), but this engine applies each bucket's AdamW "
                "while backward runs (overlap_optimizer=True), so the previous backward's update is already "
                "applied. To accumulate gradients over several backward passes, wrap with "
                "overlap_optimizer=False; otherwise call step() after each backward.")
        scaled = self.next_backward_scale is not None
        scale = self.next_backward_scale if scaled else 1.0
        self.next_backward_scale = None
        if self.step_scale is not None and scale != self.step_scale:
            raise OffloadError(
                f"this backward's loss is scaled by {scale:g} but the grads gathered since the last step() "
                f"by {self.step_scale:g}: with float16, call engine.backward(loss) for every backward pass")
        self.step_scale = scale
        if self.scaler is not None and not scaled and not self._warned:
            self._warned = True
            warnings.warn("offload: with float16, call engine.backward(loss) rather than loss.backward(), so "
                          "that the loss is scaled and small gradients do not underflow to zero", stacklevel=3)
        self.in_backward = True
        self.backward_seen = True
        self.stats["backwards"] += 1
        self.hparams = self.optimizer.hparams()  # overlapped updates: hyperparameters read as backward begins
        if self.on_plan and self.pos != self.plan.trace.num_forward:
            self._leave_plan()
        Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: nn.Parameter) -> None:
        p = self.param_index[id(param)]
        grad = param.grad
        nbytes = grad.numel() * grad.element_size()
        self.memory.add("grads", nbytes)  # autograd has materialised it; it dies below
        self._begin_backward()
        self.node_buckets = set()
        self.recorder.grad(p, nbytes)
        self._advance(EventKind.GRAD, p)
        b = self.bucket_of[p]
        slot = self._grad_slot(b)
        off = self.host.offset[p]
        with torch.no_grad():
            slot[off: off + param.numel()].copy_(grad.reshape(-1))
        param.grad = None
        del grad
        self.memory.add("grads", -nbytes)
        got = self.received.setdefault(b, set())
        got.add(p)
        if got >= self._expected(b):
            self._finish_grads(b)

    def _expected(self, b: int) -> set[int]:
        touched = self.recorder.touched
        return {p for run in self.buckets[b].runs for p in run.params if p in touched}

    def _grad_slot(self, b: int) -> torch.Tensor:
        """The device slot bucket ``b``'s grads are gathered in (typed, trainable prefix only)."""
        have = self.grad_slots.get(b)
        if have is not None:
            return have[0]
        n = self.buckets[b].trainable_numel
        k = self.plan.grad_buffer[b] if self.on_plan else None
        if k is not None:
            x = self.plan.buffers[k]
            for j in x.after:
                if j in self.done:
                    self.backend.wait(self.done[j])
            self.backend.wait(self.boundary)
            view = self.arena[x.offset: x.offset + n * self.itemsize].view(self.dtype)
        else:
            self._make_room(n * self.itemsize)
            view = self.backend.empty(n * self.itemsize).view(self.dtype)
            self.memory.add("slots", n * self.itemsize)
        with torch.no_grad():
            # Cleared once (one fill on the compute stream, after the waits above): the padding between
            # parameters ([Note: parameter alignment] in buckets.py) and any parameter without a grad this
            # pass (an unused branch) send zeros, not the bytes of the slot's previous occupant.
            view.zero_()
        self.grad_slots[b] = (view, k)
        return view

    def _finish_grads(self, b: int) -> None:
        """All of bucket ``b``'s grads are in its slot: copy them to the host, then update on the CPU."""
        if b in self.finished:
            return
        self.finished.add(b)
        view, k = self.grad_slots.pop(b)
        got = frozenset(self.received[b])  # the slot was cleared when taken: the others send zeros
        host = self.host
        earlier = self.pending.get(b)
        with torch.no_grad():
            if self.deferred and earlier is None:  # the norms clipping needs, where the grads are
                self.norms.update(self._slot_norms(view, got))
        waits = [self.backend.record()] + [e for e in (self.adam_event.get(b),) if e is not None]
        self.stats["d2h_bytes"] += view.numel() * self.itemsize
        # The copy never converts: it lands in pinned host memory of the slot's dtype ([Note: host grads]
        # in buckets.py), the grad the update reads or the bucket's staging copy.
        dst = host.landing(b, first=earlier is None)
        if earlier is not None:
            waits.append(earlier[1])  # the previous pass's sum (which read the staging copy) is done
        d2h = self.backend.d2h(dst, view, waits)
        if dst is host.grad[b]:
            ready = d2h
        elif earlier is None:  # the step's first grads, in 16 bits: widened into the fp32 sum
            ready = self.cpu.submit(lambda: host.take_staged(b, first=True), [d2h],
                                    f"gradient widening of bucket {b}")
        else:  # accumulate: added into the sum on the CPU lane (which also owns the sum's norms)
            ready = self.cpu.submit(lambda: self._accumulate(b, got), [d2h, earlier[1]],
                                    f"gradient accumulation of bucket {b}")
        self.lane_log.add("d2h", b, view.numel() * self.itemsize, d2h)
        self.grad_copies.append(d2h)
        if k is not None:
            self.done[k] = d2h
        else:  # (tensor, event): the slot is kept until the copy has read it
            self.freeing.append((d2h, view.numel() * self.itemsize, view))
        self.pending[b] = ((earlier[0] if earlier else frozenset()) | got, ready)
        if not self.deferred:
            self._submit_update(b, got, ready)

    def _slot_norms(self, view: torch.Tensor, params) -> dict[int, torch.Tensor]:
        dtype = None if self.dtype == torch.float32 else torch.float32
        off = self.host.offset
        return {p: torch.linalg.vector_norm(view[off[p]: off[p] + self.specs[p].numel], dtype=dtype)
                for p in params}

    def _accumulate(self, b: int, got) -> None:
        """CPU lane: add one more backward's grads of bucket ``b`` (staged) into the fp32 sum, renew their norms."""
        self.host.take_staged(b, first=False)
        self.norms.update(self.host.grad_norms(b, got))

    def _submit_update(self, b: int, params, ready, hparams=None, factors: tuple[float, ...] = ()) -> None:
        hparams = hparams or self.hparams
        params = frozenset(params)
        waits = [ready] + [e for e in (self.h2d_event.get(b),) if e is not None]
        self.adam_event[b] = self.cpu.submit(lambda: self.host.update(b, params, hparams, factors), waits,
                                             f"AdamW of bucket {b}")
        self.lane_log.add("cpu_adam", b, 0, self.adam_event[b])

    def _end_backward(self) -> None:
        """Queued on the autograd engine: runs once the whole backward has finished."""
        with torch.no_grad():
            for b in list(self.received):
                if b not in self.finished:
                    self._finish_grads(b)  # some grad of it never came (an unused branch): flush
            if self.on_plan and self.pos != len(self.plan.trace.events):
                self._leave_plan()
            for region in set(self.recompute_event) | set(self.recompute_holds) | set(self.held):
                self.region_done(region)  # a call whose inputs need no grad: its backward is over now
            self.recorder.activation_peak = self.memory.activation_peak
            if self.plan is not None and self.memory.activation_peak > self.plan.activation_bytes:
                self.stale = True  # same calls, larger activations (a longer sequence): plan again at step()
            self.trace = self.recorder.finish()
            self.profile = self._profile(self.memory.activation_peak)
            self._release_all()
            self._reclaim()
        self.awaiting_step = bool(self.pending)
        self.in_backward = False
        self.pos = 0

    # ---------------------------------------------------------------------------------------------------
    # optimizer step

    def wait_for_updates(self) -> None:
        self.cpu.drain()

    def step(self) -> None:
        faults.check_backward_finished(self, "optimizer.step()")
        guards.check_step_has_grads(self)
        skipped = False
        if self.deferred and self.pending:
            skipped = self._step_deferred()
        self.cpu.drain()
        self._reclaim(block=True)  # every update waited for its grads' copy: all grad slots are free
        updated = set() if skipped else set(self.pending)
        self._clear_grads()
        self.last_step_skipped = skipped
        if updated:
            self.stats["steps"] += 1
        with torch.no_grad():
            if (self.train_plan is None or self.stale) and self.trace is not None and self.trace.complete:
                self._replan(self.trace)  # brings every resident bucket in afresh
            else:
                self._refresh_resident(updated)
        self.stale = False
        self.lane_log.step_done(self.recorder, self.memory)

    def _step_deferred(self) -> bool:
        """Run the gathered updates (loss scale and clipping applied); return True if the step is skipped."""
        hparams = self.optimizer.hparams()  # read now, as torch.optim does
        factors = []
        if self.scaler is not None:
            self.cpu.drain()  # the norms of accumulated grads are computed on the CPU lane
            norms = [self.norms[p] for ps, _ in self.pending.values() for p in ps]
            found_inf = bool(norms) and not bool(torch.isfinite(_norms_on_host(norms)).all())
            inv_scale = 1.0 / self.step_scale if self.step_scale else 1.0
            self.scaler.update(found_inf)
            if found_inf:
                self.stats["skipped_steps"] += 1
                return True
            factors.append(inv_scale)
        factors.append(self.clip_factor)
        for b in sorted(self.pending):  # first-use order: the next forward's first buckets are done first
            params, ready = self.pending[b]
            self._submit_update(b, params, ready, hparams, tuple(factors))
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` over every grad gathered since the last step, applied by the
        next ``step()``. Returns the total norm (of the unscaled grads, with float16 loss scaling)."""
        if not self.deferred:
            raise OffloadError(
                "clip_grad_norm_ needs every grad before any update, but this engine applies each bucket's "
                "AdamW while backward runs (overlap_optimizer=True). Wrap with overlap_optimizer=False to clip.")
        faults.check_backward_finished(self, "clip_grad_norm_")
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = sorted(p for ps, _ in self.pending.values() for p in ps)
        if not params:
            return torch.tensor(0.0)
        self.cpu.drain()  # grads (and the norms of accumulated ones) are final
        if norm_type == 2.0:
            norms = _norms_on_host([self.norms[p] for p in params])
        else:
            by_bucket: dict[int, list[int]] = {}
            for p in params:
                by_bucket.setdefault(self.bucket_of[p], []).append(p)
            found = {}
            for b, ps in by_bucket.items():
                found.update(self.host.grad_norms(b, ps, norm_type))
            norms = torch.stack([found[p] for p in params])
        total = torch.linalg.vector_norm(norms, norm_type)
        if self.step_scale is not None and self.step_scale != 1.0:
            total = total / self.step_scale  # exact: loss scales are powers of two
        if self.clip_factor != 1.0:
            total = total * self.clip_factor
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                               "cannot be clipped. Pass error_if_nonfinite=False to go on anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.clip_factor *= float(coef)
        return total

    def zero_grad(self) -> None:
        """Grads are consumed by the update, so after step() there is nothing to clear; before it (deferred
        updates), the grads gathered so far are dropped, as ``optimizer.zero_grad()`` would."""
        faults.check_backward_finished(self, "zero_grad()")
        if self.deferred and self.pending:
            self.cpu.drain()
            self._reclaim(block=True)
            self._clear_grads()

    def _clear_grads(self) -> None:
        self.pending = {}
        self.norms = {}
        self.clip_factor = 1.0
        self.step_scale = None
        self.awaiting_step = False


def _norms_on_host(norms) -> torch.Tensor:
    """Per-parameter norms (0-d tensors) as one fp32 CPU tensor, in order, read with one device-to-host copy
    per device they are on instead of one per parameter (each a sync on CUDA): the norms of grads gathered
    on the device live there, those of accumulated grads (summed by the CPU lane) on the host."""
    out = torch.empty(len(norms), dtype=torch.float32)
    where: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        where.setdefault(n.device, []).append(i)
    for device, at in where.items():
        values = torch.stack([norms[i].float() for i in at])
        out[at] = values if device.type == "cpu" else values.cpu()
    return out
