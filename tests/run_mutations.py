"""Mutation check of the simulated GPU (issue 21, part 3): remove one wait of the CUDA backend or the runtime
at a time and see which simulated-GPU test fails. Not a test (pytest does not collect it); run by hand:

    python tests/run_mutations.py [--only ID,ID] [--timeout SECONDS] [--check]

Every selected mutation's text must occur exactly once in its file, or the runner stops before running
anything (``--check`` only does that check): a mutation is never skipped silently.

Each mutation is applied to a copy of the repository (the checkout is never touched), and pytest runs the
simulated-GPU tests there (``-x``: the first test that fails is the one that caught it): ``TESTS``, or the
mutation's own list (issue 20's data-parallel device path: the two-rank tests, whose spawned ranks import
the copy too; the fast path's simulated-GPU test). The built ``offload._C`` of this checkout is copied along.
The table it prints is what tests/MUTATIONS.md records.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DP = "tests/distributed/test_data_parallel.py::test_a_forward_between_backward_and_step_sees_every_ranks_update"
_DEV = "tests/distributed/test_device_reduce.py::test_two_ranks_reduced_on_the_simulated_gpu"
_CLIP = "tests/distributed/test_data_parallel.py::test_torch_clip_grad_norm_on_p_grad_sees_the_average_over_ranks"
_FAST = "tests/runtime/test_fast_path.py::test_fast_steps_on_the_simulated_gpu_order_the_refresh_after_backward"
_PIPE = "tests/runtime/test_refresh_pipelined.py::test_step_refreshes_each_resident_bucket_as_its_update_ends"
# the routine's own simulated-GPU test, the fast path's, and the usual set
_SEND = ["tests/runtime/test_bucket_send.py::test_on_the_simulated_gpu_a_fast_steps_buckets_go_by_the_routine_as_by_"
         "the_cpu_backend", f"{_FAST}[overlap]", "TESTS"]
_EXPOSED = "tests/runtime/test_exposed_at_c_speed.py"
# [Note: sent as one batch]: the CPU backend's inline mode only (a simulated GPU never batches), under chaos
_BATCH = ["tests/runtime/test_batch_send.py::test_under_chaos_a_batch_waits_for_the_refresh_copies_and_the_lane",
          "tests/runtime/test_batch_send.py"]
# [Note: updated from p.grad]: the fused kernel's batch (the slow lane's test first: the batch queued there)
_DIRECT = ["tests/runtime/test_batch_send.py::test_a_batch_from_p_grad_queued_on_a_slow_lane_calls_the_kernel_per_"
           "bucket", "tests/runtime/test_batch_send.py"]
# issue 17's follow-up: the batch's fallbacks (the table refused at the call, a failing kernel call, bf16)
_FALLBACK = ["tests/runtime/test_batch_send_fallbacks.py"]
_BF16 = ["tests/runtime/test_batch_send_fallbacks.py::test_bf16_batches_from_p_grad_follow_the_autocast_loss_curve"]
_STALE = ["tests/runtime/test_plain_torch_autograd.py::test_a_backward_through_a_graph_from_before_step_raises_as_torch_does"]
# issue 20's device path (two spawned ranks on the simulated GPU, or on the CPU backend: the node's shared copy)
GATHERED = [f"{_DEV}[gathered]", f"{_DP}[False]"]  # [Note: weights gathered on the device]
SHARED = [f"{_DEV}[shared]", f"{_DP}[True]"]  # [Note: one host copy per node]
REDUCED = [f"{_DEV}[gathered]", f"{_DEV}[shared]"]  # [Note: grads reduced on the device]
# N6, R24-R27: the off-plan read (a step that departed) of a bucket inside the backward that updated it
_LATE = ("tests/distributed/test_node_copy_written.py::test_a_bucket_read_inside_the_backward_that_updated_it_is_every_"
         "ranks_update")
_FAULT = "tests/distributed/test_data_parallel.py::test_a_rank_raising_in_backward_makes_every_rank_error"
_OFF = "tests/runtime/test_off_plan_late_read.py::"
_XNODE = "tests/distributed/test_host_copy_per_host.py::"  # N8-N10: one host copy per host
_SLOW_TOO = ["-m", "slow or not slow"]  # pytest's last -m wins over pyproject's: the slow tests listed run too  # [Note: a departed step's updates wait]
_TORCHS = f"{_OFF}test_an_off_plan_read_after_the_update_reads_the_weights_torch_reads"

# (id, what it breaks, file, old text, new text[, the tests to run: TESTS if absent]): old must occur exactly
# once in file
MUTATIONS = [
    # -- the backend (offload/backend/cuda.py): the mechanisms -----------------------------------------------
    ("B1", "copies wait for no device event (compute->copy, copy->copy, slot reuse)", "offload/backend/cuda.py",
     "        for event in waits:\n            self._stream_wait(stream, event)\n        chaos",
     "        for event in waits:\n            if isinstance(event, HostEvent):\n"
     "                self._stream_wait(stream, event)\n        chaos"),
    ("B2", "a copy does not wait for host (CPU-lane) events: AdamW->H2D", "offload/backend/cuda.py",
     "            event.synchronize()  # CPU-lane work", "            pass  # CPU-lane work"),
    ("B3", "record() does not capture compute (a completed event)", "offload/backend/cuda.py",
     "        event = self._api.new_event()\n        event.record(self._compute_stream())\n        return event",
     "        from .base import DONE\n        return DONE"),
    ("B4", "compute waits for no copy (copy->compute)", "offload/backend/cuda.py",
     "            self._stream_wait(self._compute_stream(), event)",
     "            if isinstance(event, HostEvent):\n                event.synchronize()"),
    ("B5", "a copy's event is recorded before the copy", "offload/backend/cuda.py",
     "        self._api.copy(stream, dst, src)\n        if chaos is not None:  # after the copy",
     "        early = self._api.new_event(blocking=True)\n        early.record(stream)\n"
     "        self._api.copy(stream, dst, src)\n        return early\n        if chaos is not None:  # after the copy"),
    ("B6", "empty(): the H2D stream does not wait for compute (stream-ordered memory)", "offload/backend/cuda.py",
     "            self._h2d.wait_stream(compute)  # [Note: stream-ordered memory]",
     "            pass  # [Note: stream-ordered memory]"),
    ("B7", "the new H2D stream does not wait for compute issued before it", "offload/backend/cuda.py",
     "            self._h2d.wait_stream(self._compute_stream())  # [Note: stream-ordered memory]",
     "            pass  # [Note: stream-ordered memory]"),
    ("B8", "synchronize() does not wait for the copies", "offload/backend/cuda.py",
     "            for stream in (self._h2d, self._d2h, self._coll, self._wcoll):\n                if stream is not None:\n"
     "                    stream.synchronize()",
     "            pass"),
    ("B9", "no compute stream bound at the first forward (defect 7: the user's stream)", "offload/backend/cuda.py",
     "        if self._compute is None:\n            self._compute = current\n        elif",
     "        if True:\n            pass\n        elif"),
    # -- the runtime (offload/runtime/: slots.py, executor.py, grads.py, warmup.py, weights.py, core.py) -------
    ("R1", "a forward does not wait for the grad copies of the previous backward (accumulation)", "offload/runtime/grads.py",
     "        for event in self.copies:\n            self.ctx.backend.wait(event)\n",
     "        for event in self.copies:\n            pass\n"),
    ("R2", "a forward's boundary is not a compute event", "offload/runtime/core.py",
     "        self.grads.wait_for_copies()\n        self.slots.mark_boundary()",
     "        self.grads.wait_for_copies()\n        from ..backend.base import DONE\n        self.slots.boundary = DONE"),
    ("R3", "an H2D does not wait for the AdamW of its bucket (AdamW->H2D)", "offload/runtime/slots.py",
     "(*waits, self.adam_event.get(b))", "(*waits,)"),
    ("R4", "compute does not wait for a bucket's H2D (copy->compute)", "offload/runtime/slots.py",
     "        self.ctx.backend.wait(self.h2d_event[b])\n        self.set_state(b, Residency.DEVICE)\n        if b not in",
     "        self.set_state(b, Residency.DEVICE)\n        if b not in"),
    ("R5", "a prefetch does not wait for the slot's previous occupant (slot reuse)", "offload/runtime/executor.py",
     "        waits = [done[j] for j in x.after if j in done] + [slots.boundary]",
     "        waits = [slots.boundary]"),
    ("R6", "a prefetch does not wait for the compute boundary", "offload/runtime/executor.py",
     "        waits = [done[j] for j in x.after if j in done] + [slots.boundary]",
     "        waits = [done[j] for j in x.after if j in done]"),
    ("R7", "an on-demand fetch does not wait for the compute boundary", "offload/runtime/slots.py",
     "        self.copy_in(b, Slot(storage, 0, None), [self.boundary])",
     "        self.copy_in(b, Slot(storage, 0, None), [])"),
    ("R8", "grad slots are freed before their D2H is known complete", "offload/runtime/slots.py",
     "            if block or ev.query():\n                ev.synchronize()", "            if True:\n                pass"),
    ("R9", "a bucket still in flight is released without compute waiting for its H2D", "offload/runtime/slots.py",
     "            ctx.backend.wait(self.h2d_event[b])  # never free memory a copy is still writing",
     "            pass  # never free memory a copy is still writing"),
    ("R10", "a released planned slot gets no compute event (slot reuse)", "offload/runtime/slots.py",
     "            self.done[slot.planned] = ctx.backend.record()", "            self.done[slot.planned] = DONE"),
    ("R11", "the end of a step's compute is not recorded (PlanExecutor.release_all)", "offload/runtime/executor.py",
     "                slots.release(b)\n        slots.mark_boundary()",
     "                slots.release(b)\n        from ..backend.base import DONE\n        slots.boundary = DONE"),
    ("R12", "resident buckets are copied in without waiting for compute (PlanExecutor.activate)",
     "offload/runtime/executor.py",
     "            slots.copy_in(b, Slot(arena, plan.buffers[k].offset, k), [slots.boundary])",
     "            slots.copy_in(b, Slot(arena, plan.buffers[k].offset, k), [])"),
    ("R13", "the arena is dropped without waiting for the copies (PlanExecutor.deactivate)", "offload/runtime/executor.py",
     "        self.ctx.backend.synchronize()\n        if self.device_state is not None:\n"
     "            self.device_state.deactivate()",
     "        if self.device_state is not None:\n            self.device_state.deactivate()"),
    ("R14", "a resident refresh does not wait for compute that reads the slot", "offload/runtime/executor.py",
     "        slots.copy_in(b, slots.slot[b], [slots.boundary], keep_bound=keep, copy=copy)",
     "        slots.copy_in(b, slots.slot[b], [], keep_bound=keep, copy=copy)"),
    ("R15", "a resident refresh does not wait for a refresh still in flight", "offload/runtime/executor.py",
     "        if slots.state[b] is Residency.IN_FLIGHT:\n            self.need(b)\n        slots.copy_in",
     "        if slots.state[b] is Residency.IN_FLIGHT:\n            slots.set_state(b, Residency.DEVICE)\n"
     "        slots.copy_in"),
    ("R16", "departing the plan moves grad slots without waiting for the copies", "offload/runtime/executor.py",
     "            self.stale = True\n        with torch.no_grad():\n            self.ctx.backend.synchronize()\n"
     "            for move_out in self._leaving:",
     "            self.stale = True\n        with torch.no_grad():\n            for move_out in self._leaving:"),
    ("R17", "load_state_dict writes host masters while copies read them", "offload/runtime/weights.py",
     "                self.ctx.backend.synchronize()\n                self.slots.hosted().write_master(p, value)",
     "                self.slots.hosted().write_master(p, value)"),
    ("P1", "the traced step reads a parameter before its H2D (copy->compute)", "offload/runtime/warmup.py",
     "        ctx.backend.wait(ctx.backend.h2d(view, src, [boundary]))",
     "        ctx.backend.h2d(view, src, [boundary])"),
    ("P2", "the traced step's H2D does not wait for the compute boundary", "offload/runtime/warmup.py",
     "        ctx.backend.wait(ctx.backend.h2d(view, src, [boundary]))",
     "        ctx.backend.wait(ctx.backend.h2d(view, src, []))"),
    ("G1", "a grad slot is refilled before its previous occupant's copy/compute (slot reuse)", "offload/runtime/grads.py",
     "            for j in x.after:\n                if j in slots.done:\n                    ctx.backend.wait(slots.done[j])",
     "            for j in x.after:\n                pass"),
    ("G2", "a grad slot is used without waiting for the boundary", "offload/runtime/grads.py",
     "            ctx.backend.wait(slots.boundary)\n            rec.exclude_end()",
     "            rec.exclude_end()"),
    ("G3", "a grad D2H does not wait for the compute that wrote the slot (compute->D2H)", "offload/runtime/grads.py",
     "        waits = [ctx.backend.record()] + [e for e in (slots.adam_event.get(b),) if e is not None]",
     "        waits = [e for e in (slots.adam_event.get(b),) if e is not None]"),
    ("G4", "a grad D2H does not wait for the previous AdamW reading the host grad", "offload/runtime/grads.py",
     "        waits = [ctx.backend.record()] + [e for e in (slots.adam_event.get(b),) if e is not None]",
     "        waits = [ctx.backend.record()]"),
    ("G5", "a grad slot's reuse does not wait for its D2H (slot reuse)", "offload/runtime/grads.py",
     "        if k is not None:\n            self.slots.done[k] = d2h", "        if k is not None:\n            pass"),
    ("G6", "accumulation adds the staged grads before their D2H (D2H->CPU)", "offload/runtime/grads.py",
     "self.sums.fold(b, got, first, staged, lo, last), [d2h, *(",
     "self.sums.fold(b, got, first, staged, lo, last), [*("),
    ("G7", "AdamW reads the host grads before their D2H (D2H->CPU AdamW)", "offload/runtime/grads.py",
     "        waits = [ready] + [e for e in (slots.h2d_event.get(b),) if e is not None]",
     "        waits = [e for e in (slots.h2d_event.get(b),) if e is not None]"),
    ("G8", "AdamW rewrites a bucket's host copy while its H2D may read it", "offload/runtime/grads.py",
     "        waits = [ready] + [e for e in (slots.h2d_event.get(b),) if e is not None]",
     "        waits = [ready]"),
    ("G9", "step() frees grad slots without waiting for their D2H", "offload/runtime/grads.py",
     "        self.slots.reclaim(block=True)  # every update", "        self.slots.reclaim()  # every update"),
    ("G10", "a grad D2H into the staging copy does not wait for the previous pass's add (it reads that copy)",
     "offload/runtime/grads.py",
     "+ ([earlier.ready] if earlier is not None else [])  # the previous sum is done",
     "  # the previous sum is done"),
    ("L1", "a CPU-lane item never synchronizes a device event (D2H->CPU AdamW, on the lane's side)",
     "offload/backend/base.py",
     "            if isinstance(w, HostEvent) or not w.query():", "            if isinstance(w, HostEvent):",
     ["tests/runtime/test_chunked_staging.py::test_pieces_on_the_simulated_gpu_bit_for_bit", "TESTS"]),
    ("L2", "every piece of a bucket skips the H2D wait, the first one too (AdamW->H2D, pieces)",
     "offload/runtime/grads.py",
     "        if span is not None and span[0] > 0:  # [Note: one H2D wait per bucket's update]",
     "        if span is not None:  # [Note: one H2D wait per bucket's update]",
     ["tests/runtime/test_chunked_staging.py::test_pieces_on_the_simulated_gpu_bit_for_bit", "TESTS"]),
    # -- issue 20's data-parallel device path (runtime/device_collectives.py, distributed.py, backend/base.py) --
    ("D1", "a shard's H2D into a gather buffer does not wait for that buffer's previous copy back (`free`)",
     "offload/runtime/device_collectives.py",
     "copied = self.backend.h2d(mine[: s.numel], copy[s.start: s.end], free)",
     "copied = self.backend.h2d(mine[: s.numel], copy[s.start: s.end], [])", GATHERED),
    ("D2", "the weights' all-gather does not wait for the shard's H2D", "offload/runtime/device_collectives.py",
     "group=self.group), [copied], weights=True)", "group=self.group), [], weights=True)", GATHERED),
    ("D3", "the gathered bucket's copy back (D2H) does not wait for the all-gather",
     "offload/runtime/device_collectives.py",
     "self.backend.d2h(copy[:n], buf[:n], [gathered])", "self.backend.d2h(copy[:n], buf[:n], [])", GATHERED),
    ("D4", "a bucket's update does not wait for its previous gather's copy back (`_gathered`, submit_update)",
     "offload/runtime/distributed.py",
     "updated = self.lane.submit(update, [reduce, *waits, *([last] if last is not None else [])],",
     "updated = self.lane.submit(update, [reduce, *waits],", GATHERED),
    ("D5", "a `Deferred` event's synchronize() waits for the lane item only, not its device work",
     "offload/backend/base.py",
     "        self.device[0].synchronize()", "        pass", GATHERED),
    ("D6", "a `Deferred` event's query() says done once the lane item is, before its device work",
     "offload/backend/base.py",
     "        return self.host.query() and bool(self.device) and self.device[0].query()",
     "        return self.host.query()", GATHERED),
    ("D7", "the grads' reduce-scatter does not wait for the grads' event (compute->collective)",
     "offload/runtime/distributed.py",
     "_reduce_scatter, mine, slot, group=device.group), [ready])",
     "_reduce_scatter, mine, slot, group=device.group), [])", REDUCED),
    ("D8", "the shard's D2H does not wait for the reduce-scatter", "offload/runtime/distributed.py",
     "return backend.d2h(dst, mine, [reduced, *waits])", "return backend.d2h(dst, mine, [*waits])", REDUCED),
    # [Note: resident weights gathered in their slots]: step()'s refresh of the resident buckets
    ("D9", "a resident bucket's refresh all-gather does not wait for this rank's chunk's H2D",
     "offload/runtime/device_collectives.py", "group=self.node), copies)", "group=self.node), copies[1:])",
     REDUCED),
    ("D10", "a resident bucket's refresh all-gather does not wait for the tail's H2D (compute then neither)",
     "offload/runtime/device_collectives.py", "group=self.node), copies)", "group=self.node), copies[:1])",
     REDUCED),
    ("D11", "compute waits for a refreshed bucket's chunk copy, not for its all-gather",
     "offload/runtime/device_collectives.py", "        return gathered, (c + dst.numel() - end)",
     "        return copies[0], (c + dst.numel() - end)", REDUCED),
    ("D12", "no agreement on the buckets gathered after step(): each rank gathers its own list",
     "offload/runtime/distributed.py",
     '        if not bool((self._agree(tag, "agreement on the buckets gathered after step()")[:, 1:3] == tag[1:3]).all()):',
     '        if not bool((self._agree(tag, "agreement on the buckets gathered after step()")[:, 1:3] == tag[1:3]).any()):',
     ["tests/distributed/test_device_reduce.py::test_ranks_that_keep_other_buckets_resident_copy_them_whole"]),
    # [Note: the shared copy checked once per backward] (runtime/node_share.py): one check per backward or step()
    ("N1", "a bucket's update on the node's shared copy is never checked whole (not recorded for the batched "
     "check)", "offload/runtime/distributed.py",
     "            self.unchecked[b] = None  # checked", "            pass  # checked",
     [f"{_DP}[True]", f"{_DEV}[shared]"]),  # the numbers' test first
    ("N4", "the check that the shared copy is whole does not wait for this rank's own updates (the CPU lane)",
     "offload/runtime/distributed.py", "            self.lane.drain()  # this rank's writes are done",
     "            pass  # this rank's writes are done", SHARED),
    ("N5", "no check at the end of a backward: a later read issues it (then a read forces it: `copy_checks_early`)",
     "offload/runtime/core.py", "            self.slots.check_shared_copies()  # issue 20",
     "            pass  # issue 20", SHARED),
    # N6: since a fetch inside the backward that updated its bucket raises (R27), the check is reached only by the
    # refresh after a fault, where it does nothing (the rank is out of step): expected not caught (tests/MUTATIONS.md)
    ("N6", "a read inside the backward that updated the bucket does not issue the check first",
     "offload/runtime/slots.py", "            self.check_shared_copies(early=True)  # that updated it",
     "            pass  # that updated it", [*SHARED, _LATE, _FAULT]),
    # [Note: one host copy per host] (host/node_copy.py): ranks on two hosts (faked), one shared copy per host
    ("N8", "over several hosts the column's all-gather does not run (the other hosts' shards never reach the copy)",
     "offload/runtime/distributed.py",
     "        if shards is not None:  # after the other hosts' shards came in",
     "        if shards is not None and host.node_copy is None:  # after the other hosts' shards came in",
     [f"{_XNODE}test_four_ranks_on_two_hosts_share_one_copy_per_host"]),
    ("N9", "the check that the shared copy is whole does not wait for this rank's copies back from the device",
     "offload/runtime/distributed.py", "        self.settle()  # and its copies back from the device",
     "        pass  # and its copies back from the device",
     [*_SLOW_TOO, f"{_XNODE}test_four_ranks_on_two_hosts_reduced_on_the_device_share_one_copy_per_host[True]",
      f"{_XNODE}test_four_ranks_on_two_hosts_reduced_on_the_device_share_one_copy_per_host[False]"]),
    ("N10", "weights written outside a step: a rank writes only its own shard of its host's copy, not its column's",
     "offload/host/shard.py", "        shards = [shard_of(n, r, self.world) for r in hosts.column]",
     "        shards = [self.shards[b]]",
     [*_SLOW_TOO, f"{_XNODE}test_a_load_between_steps_on_two_hosts_is_seen_whole_by_every_rank"]),
    ("N11", "grads reduced on the device over several hosts: nothing of the device's all-gather is copied back "
     "into the host's shared copy", "offload/runtime/device_collectives.py",
     "        self.column = None if column is None else tuple(r for r in column if r != rank)",
     "        self.column = None if column is None else ()",
     [f"{_XNODE}test_four_ranks_on_two_hosts_reduced_on_the_device_share_one_copy_per_host[False]"]),
    ("R24", "a step off its plan: its updates do not wait for the end of its backward",
     "offload/runtime/grads.py",
     "            self.held, self.hold_only = [] if self.held is None else self.held, None  # [Note: a departed step's",
     "            pass  # [Note: a departed step's", [f"{_TORCHS}[streamed-simulated-gpu]", _LATE]),
    ("R25", "a forward call reading a parameter its planned call did not stays on the plan (check_use)",
     "offload/runtime/executor.py", "        if i >= len(uses[1]) or p not in uses[1][i]:\n            self.leave(",
     "        if i >= len(uses[1]) or p not in uses[1][i]:\n            pass  # self.leave(",
     [f"{_TORCHS}[resident-simulated-gpu]", f"{_TORCHS}[device-optimizer-simulated-gpu]"]),
    ("R26", "a device update in backward does not bump its parameters' version counters",
     "offload/runtime/device_optim.py", "            torch.autograd.graph.increment_version(ctx.params[p])",
     "            pass", [f"{_OFF}test_on_a_fast_step_a_device_bucket_read_after_its_update_raises"]),
    ("R27", "a bucket fetched again inside the backward that updated it is not refused (it reads the new weights)",
     "offload/runtime/slots.py", "            raise_read_after_update(b)", "            pass",
     [f"{_OFF}test_a_read_only_the_backward_shows_after_the_update_is_refused"]),
    ("N7", "deferred updates: no check in step() (the next reads force it, or the end of the next backward)",
     "offload/runtime/core.py", "                self.slots.check_shared_copies()  # deferred",
     "                pass  # deferred", [_CLIP]),
    ("N2", "the first masters written into the node's shared copy: no check that every rank's part is in "
     "(`copy_written`, traced step)", "offload/runtime/warmup.py",
     "            ctx.dp.copy_written()  # every rank's part of it is in before any fetch reads it",
     "            pass  # every rank's part of it is in before any fetch reads it", SHARED),
    ("N3", "weights written outside a step (load_state_dict, p.data): no check that every rank's part of the node's "
     "copy is in (`copy_written`)", "offload/runtime/weights.py",
     "            self.ctx.dp.copy_written()", "            pass",
     [*SHARED, "tests/distributed/test_node_copy_written.py"]),
    ("G11", "a grad D2H into the host's staging ring does not wait for the ring bytes' previous CPU-lane reader "
     "([Note: grad staging ring])", "offload/runtime/grads.py",
     "after = [*waits, *dst.after] + (", "after = [*waits] + (",
     ["TESTS", "tests/runtime/test_chaos.py::test_one_slot_grad_ring_bitwise_equal_under_chaos"]),
    # [Note: the refresh pipelined] (executor.py): step() issues a resident bucket's refresh before the lane drained
    ("R20", "step()'s pipelined refresh: a copy does not wait for its bucket's update (AdamW->H2D, lane not drained)",
     "offload/runtime/executor.py",
     "                self._refresh_one(b, keep, None)\n",
     "                update = self.slots.adam_event.pop(b, None)\n                self._refresh_one(b, keep, None)\n"
     "                if update is not None:\n                    self.slots.adam_event[b] = update\n",
     [f"{_PIPE}[simulated_gpu]", f"{_PIPE}[cpu_backend]", "TESTS"]),
    ("R21", "step()'s pipelined refresh copies into the slots of a plan that step() then replaces (a re-plan)",
     "offload/runtime/executor.py", "        if self.replans_at_step():\n            return  # the arena goes",
     "        if False:\n            return  # the arena goes", [f"{_PIPE}[simulated_gpu]", f"{_PIPE}[cpu_backend]"]),
    # step()'s refresh order (branch reforder): the updates already ended first, in first-use order
    ("R33", "step()'s pipelined refresh asks no update whether it ended (every refresh in the lane's order)",
     "offload/runtime/executor.py",
     "lambda b: (ev := adam.get(b)) is None or ev.query(),", "lambda b: False,",
     [_PIPE.replace("test_step_refreshes_each_resident_bucket_as_its_update_ends",
                    "test_updates_ended_before_step_are_refreshed_in_first_use_order")]),
    ("R34", "step()'s pipelined refresh takes every update as ended (all refreshes in first-use order)",
     "offload/runtime/executor.py",
     "lambda b: (ev := adam.get(b)) is None or ev.query(),", "lambda b: True,",
     [f"{_PIPE}[simulated_gpu]", f"{_PIPE}[cpu_backend]"]),
    # session 23 (branch refon): the bucket used first goes first where its update is the lane's next
    ("R40", "step()'s pipelined refresh queues the bucket used first behind the ended ones where its update is the "
     "lane's next (the order before session 23)", "offload/planning/steady.py",
     "    if done and rest and min(lane, key=key) == rest[0]:", "    if False:",
     [_PIPE.replace("test_step_refreshes_each_resident_bucket_as_its_update_ends",
                    "test_the_bucket_used_first_goes_first_where_its_update_is_the_lanes_next")]),
    # -- the fast path (commit 50c6a53) ----------------------------------------------------------------------
    ("F1", "the end of a fast backward marks no boundary (step()'s refresh copies vs the backward's reads)",
     "offload/runtime/core.py",
     "                self.slots.mark_boundary()\n            else:\n                executor.leave_unless_followed()",
     "                pass\n            else:\n                executor.leave_unless_followed()",
     [f"{_FAST}[overlap]", f"{_FAST}[deferred]"]),
    ("R18", "a fast step's departure moves grad slots out without waiting for the copies (leave_keeping_weights)",
     "offload/runtime/executor.py",
     "        self.ctx.stats[\"plan_departures\"] += 1\n        with torch.no_grad():\n"
     "            self.ctx.backend.synchronize()\n            for move_out in self._leaving:",
     "        self.ctx.stats[\"plan_departures\"] += 1\n        with torch.no_grad():\n"
     "            for move_out in self._leaving:", [f"{_FAST}[overlap]", f"{_FAST}[deferred]",
                                               "tests/runtime/test_fast_departure_sim.py", "TESTS"]),
    # -- a fast step's bucket sent by one routine ([Note: one routine per fast bucket], bucket_send.py) --------
    ("S1", "a fast bucket's grad slot is refilled before its previous occupant's copy/compute (slot reuse)",
     "offload/runtime/bucket_send.py",
     "        for j in r.after:\n            if j in done:\n                backend.wait(done[j])",
     "        for j in r.after:\n            pass", _SEND),
    ("S2", "a fast bucket's grad slot is used without waiting for the boundary", "offload/runtime/bucket_send.py",
     "        backend.wait(slots.boundary)\n        rec.exclude_end()", "        rec.exclude_end()", _SEND),
    ("S3", "a fast bucket's grad D2H does not wait for the compute that wrote the slot (compute->D2H)",
     "offload/runtime/bucket_send.py",
     "waits = [backend.record()] if last is None else [backend.record(), last]",
     "waits = [] if last is None else [last]", _SEND),
    ("S4", "a fast bucket's grad D2H does not wait for the bucket's previous AdamW (it read the host grads)",
     "offload/runtime/bucket_send.py",
     "waits = [backend.record()] if last is None else [backend.record(), last]", "waits = [backend.record()]",
     _SEND),
    ("S5", "a fast bucket's grad slot's reuse does not wait for its D2H (slot reuse)", "offload/runtime/bucket_send.py",
     "        slots.done[r.k] = d2h", "        pass", _SEND),
    ("S6", "a fast bucket's AdamW reads the host grads before their D2H (D2H->CPU AdamW)",
     "offload/runtime/bucket_send.py", "[d2h] if h2d is None else [d2h, h2d]", "[] if h2d is None else [h2d]", _SEND),
    ("S7", "a fast bucket's AdamW rewrites its host copy while its H2D may read it", "offload/runtime/bucket_send.py",
     "[d2h] if h2d is None else [d2h, h2d]", "[d2h]", _SEND),
    ("S8", "a fast bucket's grad D2H does not wait for the ring bytes' previous CPU-lane reader ([Note: grad staging "
     "ring])", "offload/runtime/bucket_send.py", "after = [*waits, *landing.after]", "after = [*waits]",
     [*_SEND, "tests/runtime/test_chaos.py::test_one_slot_grad_ring_bitwise_equal_under_chaos"]),
    # -- a fast step's buckets sent after backward as one batch ([Note: sent as one batch], bucket_send.py) ----
    ("R28", "a batch's update rewrites a bucket's host copy while its last H2D may still read it (AdamW after H2D)",
     "offload/runtime/bucket_send.py", "(slots.adam_event.get(r.b), slots.h2d_event.get(r.b))",
     "(slots.adam_event.get(r.b),)", _BATCH),
    ("R29", "a batch does not wait for its buckets' previous updates", "offload/runtime/bucket_send.py",
     "(slots.adam_event.get(r.b), slots.h2d_event.get(r.b))", "(slots.h2d_event.get(r.b),)", _BATCH),
    ("R30", "a batch's grads land in ring bytes before their previous CPU-lane reader is done ([Note: grad staging "
     "ring])", "offload/runtime/bucket_send.py", "        batch.waits = [*waits, *after]\n",
     "        batch.waits = [*waits]\n", _BATCH),
    ("R31", "a batch's ring piece is not cleared where a bucket's grads do not fill it (padding sends old bytes)",
     "offload/runtime/bucket_send.py", "                    piece[:r.numel].zero_()", "                    pass",
     _BATCH),
    ("R32", "a batch's ring piece is lent without naming its reader (the next copy there would not wait for it)",
     "offload/runtime/bucket_send.py", "        host.staged_read_by(lent, done)\n        grads.copies.append(done)",
     "        grads.copies.append(done)", _BATCH),
    # -- [Note: updated from p.grad] (host/segments.py): a batch updated from the parameters' own grads ----------
    ("R35", "a batch updated from p.grad queued on the lane's thread makes one kernel call for all its buckets (each "
     "bucket's event set only once every bucket is updated: step()'s refresh waits for the whole batch)",
     "offload/runtime/bucket_send.py", "        if threading.get_ident() == self.issuer:\n",
     "        if True:\n", _DIRECT),
    ("R36", "the padding between parameters is updated with grads that are not zeros", "offload/host/segments.py",
     "zeros = torch.zeros(max(gap, 1), dtype=host.device_dtype)",
     "zeros = torch.ones(max(gap, 1), dtype=host.device_dtype)", _DIRECT),
    ("R37", "a grad of another layout than its parameter's is read as if it were contiguous",
     "offload/host/segments.py", " or not all(map(_is_contiguous, grads)):", ":", _DIRECT),
    ("R38", "a batch updated from p.grad leaves its parameters' step counts where they were",
     "offload/runtime/bucket_send.py", "        if failed is None:\n            batch.count(count)\n",
     "        if failed is None:\n            pass\n", _DIRECT),
    ("R41", "a batch whose parameters are not all at one step count is updated from p.grad at the first one's count "
     "(BatchUpdate.ready does not refuse it)", "offload/host/segments.py",
     "counts.count(counts[0]) != len(counts) or ", "", _FALLBACK),
    ("R42", "a batch from p.grad whose kernel call failed counts every bucket's step (the failed ones' too)",
     "offload/runtime/bucket_send.py", "        if failed is None:\n            batch.count(count)\n",
     "        if True:\n            batch.count(count)\n", _FALLBACK),
    ("R43", "a failed kernel call's buckets have their update events set as if they were updated",
     "offload/runtime/bucket_send.py", "                for i in at:\n                    work[i][3].set(e)\n",
     "                for i in at:\n                    work[i][3].set()\n", _FALLBACK),
    ("R44", "a batch from p.grad leaves the buckets' 16-bit copies as they were (bf16: the next forward reads the old "
     "weights)", "offload/host/segments.py", "0 if lowp is None else lowp.data_ptr() + item * start, numel, hyper]",
     "0, numel, hyper]", _BF16),
    ("R45", "a saved weight view whose bucket step() updated since it was saved is unpacked as any other (the "
     "backward reads the new weights)", "offload/runtime/core.py",
     "        self.slots.check_saved(saved)  # [Note: stale graphs] (slots.py)\n", "", _STALE),
    ("R46", "step() does not count the updates it applied (saved weight views never go stale)",
     "offload/runtime/core.py", "            self.slots.note_updates(updated)  # [Note: stale graphs] (slots.py)\n",
     "", _STALE),
    ("R47", "a state dict loaded does not count as a change of every bucket's weights (views saved before stay valid)",
     "offload/runtime/weights.py",
     "        self.slots.note_updates(range(len(self.slots.versions)))  # [Note: stale graphs] (slots.py)\n", "",
     ["tests/runtime/test_plain_torch_autograd.py::"
      "test_a_backward_after_a_state_dict_was_loaded_into_its_graphs_weights_raises_as_torch_does"]),
    ("R48", "a grad copy's host wait for the CPU lane to free its ring bytes is timed as compute",
     "offload/runtime/grads.py", "        if ctx.backend.copy_waits_on_host(after):  # CPU-lane work not done",
     "        if False:  # CPU-lane work not done",
     ["tests/runtime/test_compute_timing.py::test_waiting_for_the_cpu_lane_is_not_compute"]),
    ("R60", "a step of two training forwards verifies its plan for fast steps (whose backward interleaves the two "
     "graphs otherwise: depart, re-plan, again)", "offload/runtime/core.py",
     "                if self.passes.forwards == 1:  # [Note: one forward per fast step] (step_passes.py)",
     "                if True:  # [Note: one forward per fast step] (step_passes.py)", ["tests/runtime/test_two_forwards.py"]),
    ("R61", "a model with blocks measured for checkpointing (none checkpointed) counts as checkpointed at the end of "
     "a first backward pass (every two-pass step departs)", "offload/runtime/core.py",
     "self.fast.on, bool(self.recompute.ckpt.active)):", "self.fast.on, bool(self.recompute.ckpt.block_of)):",
     ["tests/runtime/test_penalty_passes.py::test_two_pass_steps_of_a_model_with_blocks_stay_on_their_plan"]),
    ("R62", "a plan's arena is laid out while buckets fetched on demand still hold their own slots (the slot index "
     "breaks; over the budget)", "offload/runtime/executor.py",
     "        for b in [b for b, slot in slots.slot.items() if slot.planned is None]:\n            slots.release(b)",
     "        for b in []:\n            slots.release(b)",
     ["tests/runtime/test_two_forwards.py::"
      "test_the_root_and_a_submodule_called_directly_in_one_step_train_like_torch"]),
    ("R63", "steps that keep departing are not counted (no warning)", "offload/runtime/core.py",
     "            executor.departures.step_ended(ctx.module)  # [Note: steps that keep departing] (departures.py)\n",
     "", ["tests/runtime/test_two_forwards.py::test_steps_that_keep_departing_warn_once_naming_where"]),
    # [Note: exposed at C speed] (plain_grads.py): not waits, what a user sees of p.grad on the hot path
    ("R49", "the fast exposure makes the spares `exposed` without setting them in p.grad",
     "offload/runtime/plain_grads.py", '                _drain(map(setattr, cached[1], repeat("grad"), given))',
     "                pass", [_EXPOSED]),
    ("R50", "a data-less grad is current whatever `exposed` holds (no epoch renewed, no identity check either)",
     "offload/runtime/plain_grads.py",
     "        if (exposure.exposed.get(self._p) is not self) if self._data is None else exposure.epoch != self._epoch:",
     "        if False if self._data is None else exposure.epoch != self._epoch:", [_EXPOSED]),
    ("R51", "step() takes the exposed grads back without setting p.grad to None",
     "offload/runtime/plain_grads.py",
     '        _drain(map(setattr, owners, repeat("grad"), repeat(None)))  # [Note: exposed at C speed]',
     "        pass", [_EXPOSED]),
    ("R52", "a refresh whose wait raised in the fast path's settle leaves its parameters bound to the slot",
     "offload/runtime/fast_path.py", "                    slots.unbind(b)", "                    pass",
     ["tests/runtime/test_batch_send_fallbacks.py::"
      "test_a_kernel_call_that_fails_raises_at_step_and_counts_only_the_buckets_it_updated"]),
    ("R64", "step() does not check the parameters (a .data reassigned after backward is rebound by the refresh, "
     "silently)", "offload/runtime/core.py",
     "            self.guard.check_at_step()  # a .data reassigned since the forward: refused before anything changes\n",
     "", ["tests/runtime/test_guards.py::test_data_assigned_between_backward_and_step_is_refused_at_step"]),
    ("R65", "a parameter frozen at wrap and made trainable later is not refused (never updated, silently)",
     "offload/runtime/guards.py", "        if self._frozen and any(map(_REQUIRES_GRAD, self._frozen)):",
     "        if False:", ["tests/runtime/test_guards.py::"
                          "test_unfreezing_a_parameter_frozen_at_wrap_is_refused_where_torch_would_train_it"]),
    ("R66", "add_param_group on a bound optimizer is torch's (the group is never updated, silently)",
     "offload/optim.py", '        if getattr(self, "_engine", None) is not None:', "        if False:",
     ["tests/runtime/test_guards.py::test_add_param_group_after_wrap_is_refused"]),
    # [Note: reads the plan did not foresee] (unforeseen_reads.py): a GAN's discriminator holds its plan
    ("R91", "an extra backward read of a weight on the device departs (as before session 25)",
     "offload/runtime/unforeseen_reads.py",
     "                if slots.state[b] is Residency.DEVICE:\n                    return -1",
     "                if False:\n                    return -1",
     ["tests/runtime/test_unforeseen_reads.py::test_a_dcgan_loop_holds_both_plans_bit_for_bit_like_torch[resident]"]),
    ("R92", "an extra read is let by after its bucket's last grad (its update may have begun)",
     "offload/runtime/unforeseen_reads.py",
     "    return on_device and (last_grad[bucket] < 0 or last_grad[bucket] >= pos)", "    return on_device",
     ["tests/runtime/test_unforeseen_reads.py::test_an_extra_read_is_let_by_only_before_its_buckets_update_can_begin"]),
    ("R93", "planned reads that do not come depart, from a plan made from a record known to read more too",
     "offload/runtime/unforeseen_reads.py", "            if plan.trace is self.wider:\n                return at",
     "            if False:\n                return at",
     ["tests/runtime/test_unforeseen_reads.py::test_passes_with_and_without_the_input_grad_settle_on_one_plan[with-resident-deferred]"]),
    ("R94", "planned reads that do not come are passed over whatever the plan was made from (a one-off pass too)",
     "offload/runtime/unforeseen_reads.py",
     "            self._read_less = plan.trace  # not yet known to come again (a one-off read): depart, as before\n"
     "            return None", "            return at",
     ["tests/runtime/test_off_plan_late_read.py::"
      "test_an_off_plan_read_after_the_update_reads_the_weights_torch_reads[resident-cpu]"]),
    ("R96", "a pass that departed at a read once is planned from at once (a one-off's plan kept)",
     "offload/runtime/unforeseen_reads.py",
     "        again = read_more and self._departed_more is not None and trace.events == self._departed_more.events",
     "        again = read_more",
     ["tests/runtime/test_unforeseen_reads.py::test_the_record_to_plan_from_is_the_one_that_reads_more_only_once_both_kinds_of_pass_come"]),
    ("R101", "the pass a read-more departure left coming again after it is planned from its own record (a third "
     "departure)", "offload/runtime/unforeseen_reads.py",
     "        if (read_less is not None and read_less is more and self._departed_from is not None",
     "        if (False and read_less is not None and read_less is more and self._departed_from is not None",
     ["tests/runtime/test_unforeseen_reads.py::"
      "test_the_pass_before_a_read_more_departure_coming_again_settles_on_the_wider_record_at_once"]),
    ("R95", "a record that reads more is never kept to plan from",
     "offload/runtime/unforeseen_reads.py",
     "            self.wider = trace  # both kinds of pass come: plan from the one that reads more", "            pass",
     ["tests/runtime/test_unforeseen_reads.py::test_the_record_to_plan_from_is_the_one_that_reads_more_only_once_both_kinds_of_pass_come"]),
    # [Note: a forward after an inner pass] (step_passes.py): WGAN-GP's critic and FGSM steps hold one plan
    ("R97", "a training forward after an inner autograd pass begins a step (as before issue 17's change: every such "
     "step departs)", "offload/runtime/step_passes.py",
     "        return self.state in (Between.PASSES, Between.CONTINUED) and grad_enabled and self.ctx.dp is None",
     "        return False",
     ["tests/runtime/test_forward_after_inner_pass.py::test_adversarial_training_steps_settle_on_one_plan_bit_for_bit[resident-overlap-adversarial]"]),
    ("R98", "an inner pass that ends off plan ends its step (the first step's record stops there: the plan never "
     "sees the forward after it)", "offload/runtime/step_passes.py",
     "            and (forward_planned_next(executor) or not executor.on_plan))",
     "            and forward_planned_next(executor))",
     ["tests/runtime/test_forward_after_inner_pass.py::test_adversarial_training_steps_settle_on_one_plan_bit_for_bit[streamed-deferred-adversarial]"]),
    ("R99", "step() and zero_grad() do not end a step between its passes (the next step's forward continues it)",
     "offload/runtime/step_passes.py",
     "        if self.state in (Between.PASSES, Between.CONTINUED):\n            self.state = Between.ENDED",
     "        if False:\n            self.state = Between.ENDED",
     ["tests/runtime/test_forward_after_inner_pass.py::test_wgan_gp_critic_and_generator_settle_on_their_plans_bit_for_bit[resident-overlap]"]),
    ("R100", "a backward pass that begins before its plan's last forward departs (an inner pass the plan has too)",
     "offload/runtime/step_passes.py",
     "    return pos == nf or (pos < nf and plan.trace.events[pos].kind in (EventKind.UNPACK, EventKind.GRAD))",
     "    return pos == nf",
     ["tests/runtime/test_forward_after_inner_pass.py::test_wgan_gp_critic_and_generator_settle_on_their_plans_bit_for_bit[streamed-deferred]"]),
    ("R67", "a checkpointed BatchNorm's running statistics are not noted as updated by its forward (its kernel moves "
     "no version counter): the recompute updates them again, silently", "offload/runtime/recompute.py",
     "    return [(m._buffers, name, t, -1 if name in _RUNNING and m.training and isinstance(m, _NormBase) else t._version)",
     "    return [(m._buffers, name, t, t._version)",
     ["tests/runtime/test_plain_torch_models.py::test_checkpointed_blocks_update_their_buffers_once"]),
    ("R68", "a recompute updates the block's buffers themselves, not clones (twice per step, silently)",
     "offload/runtime/recompute.py", "                table[name] = t.detach().clone()", "                pass",
     ["tests/runtime/test_plain_torch_models.py::test_checkpointed_blocks_update_their_buffers_once"]),
    ("R69", "an op of the forward that writes a parameter in place is not refused (the write is lost, silently)",
     "offload/runtime/param_access.py", "                if written and any(w in index for w in written):",
     "                if False:",
     ["tests/runtime/test_plain_torch_models.py::test_parameters_written_in_forward_are_refused"]),
    ("R70", "F.embedding / F.embedding_bag with max_norm or sparse=True are not refused (max_norm's renorm is lost "
     "silently; a sparse grad crashes in backward)", "offload/runtime/param_access.py",
     "            lookup = _LOOKUPS.get(func)", "            lookup = None",
     ["tests/runtime/test_plain_torch_models.py::test_parameters_written_in_forward_are_refused"]),
    # session 25, the loop audit (tests/runtime/test_plain_torch_loops.py)
    ("R75", "a param group's torch option (amsgrad, maximize, ...) set after wrap is not refused (ignored, silently)",
     "offload/optim.py", "            if any(g.get(k, v) != v for k, v in _TORCH_OPTIONS.items()):",
     "            if False:", ["tests/runtime/test_plain_torch_loops.py::test_a_torch_option_set_on_a_group_later_is_"
                              "refused_and_training_goes_on[amsgrad-streamed-overlapped]"]),
    ("R76", "a loaded state_dict's param groups are not checked (a torch amsgrad checkpoint trains on as AdamW)",
     "offload/optim.py", '        for i, g in enumerate(state_dict.get("param_groups", ())):  # before anything changes',
     "        for i, g in enumerate(()):", ["tests/runtime/test_plain_torch_loops.py::test_a_torch_amsgrad_or_adam_l2_"
                                            "checkpoint_is_refused_before_anything_changes[resident]"]),
    ("R77", "p.grad.data = t is torch's setter on the wrapper (dropped: the host sum keeps the old values)",
     "offload/runtime/plain_grads.py", "            torch.Tensor.copy_(self, value)",
     "            torch._C.TensorBase.data.__set__(self, value)",
     ["tests/runtime/test_plain_torch_loops.py::test_gradients_the_user_rewrites_train_like_torch[grad.data=t-"
      "resident]"]),
    ("R78", "p.grad after backward(create_graph=True) is usable with grad mode on (a penalty on it is dropped)",
     "offload/runtime/plain_grads.py", "        if exposure.graph_asked and torch.is_grad_enabled():",
     "        if False:", ["tests/runtime/test_plain_torch_loops.py::test_a_penalty_on_p_grad_after_backward_with_"
                          "create_graph_is_refused[resident]"]),
    ("R79", "a param group's params list changed after wrap is not refused (the engine updates the old set, silently)",
     "offload/optim.py", "        if self._layout is not None and self._group_layout() != self._layout:",
     "        if False:", ["tests/runtime/test_plain_torch_loops.py::test_a_param_groups_params_changed_after_wrap_is_"
                          "refused[reassigned-resident-deferred]"]),
    ("R80", "a parameter a loaded state_dict has no state for keeps the engine's (torch starts it afresh)",
     "offload/optim.py", '                self.state[p] = {"step": zero, "exp_avg": zero.expand(p.shape), '
     '"exp_avg_sq": zero.expand(p.shape)}', "                pass",
     ["tests/runtime/test_plain_torch_loops.py::test_adamw_state_reset_by_loading_a_state_dict_without_it_trains_"
      "like_torch[all-resident-deferred]"]),
    # -- the planner (issue 18, gap18): a point over the capacity does not end a greedy sequence --------------
    # (the Python reference's loop: the C++ one is built, not mutated; test_greedy_kernel.py compares the two)
    ("P40", "a point over the capacity ends its mode's sequence again (later points that fit are lost)",
     "offload/planning/greedy.py",
     "                if peak > capacity and self.least_peak(resident) > capacity:",
     "                if peak > capacity:", ["tests/planning/test_greedy.py"]),
    ("P41", "the stop rule's least peak counts the resident buckets' needs twice (it stops before points that fit)",
     "offload/planning/greedy.py",
     "        live = ~np.isin(x.use_b, res)\n",
     "        live = np.ones(len(x.use_b), dtype=bool)\n", ["tests/planning/test_greedy.py"]),
    # -- pairs of waits that cover each other (each alone is redundant) -------------------------------------
    ("R19", "a streamed weight read after its update: its update does not wait for the end of backward",
     "offload/runtime/grads.py",
     "        self.held = None if self.deferred or self.hold_only == frozenset() else []",
     "        self.held = None if self.deferred or plan is not None else []",
     ["tests/runtime/test_device_optimizer.py::test_a_streamed_weight_read_after_its_update_trains_as_torch"]),
    ("B6+R7", "on-demand fetch: neither empty()'s wait nor the boundary orders the H2D after compute", "+",
     "B6+R7", ""),
    ("B7+P2", "traced step: neither the new stream's wait nor the boundary orders the H2D after compute", "+",
     "B7+P2", ""),
    ("B6+R12", "a new arena: neither empty()'s wait nor the boundary orders its first H2Ds after compute", "+",
     "B6+R12", ""),
    ("G11+G10", "accumulation: a grad D2H into ring bytes waits neither for their previous reader nor for the "
     "previous pass's add", "+", "G11+G10", ""),
    ("R24+R27", "a step off its plan neither holds its updates nor refuses a bucket fetched after its update", "+",
     "R24+R27", ""),
    ("R25+R27", "a read its planned call did not have departs only in backward, and the fetch after the update is not "
     "refused", "+", "R25+R27", ""),
]

_BIT = "tests/backend/test_cuda_backend.py::test_simulated_gpu_trains_bit_for_bit_like_the_cpu_backend"
TESTS = ["tests/backend/test_sim_strict.py", f"{_BIT}[mlp]", f"{_BIT}[gpt]", f"{_BIT}[reused_module]",
         "tests/backend/test_cuda_backend.py::test_simulated_gpu_training_features_bit_for_bit_like_the_cpu_backend"
         "[accumulate-clip]",
         "tests/backend/test_cuda_backend.py::test_simulated_gpu_departures_evaluation_and_checkpoint",
         "tests/backend/test_sim_update_order.py"]

LAUNCH = """
import os, sys
# the editable install's finder would import the checkout's offload: drop it, import the copy's
drop = [f for f in sys.meta_path if 'editable' in type(f).__module__.lower() or 'ScikitBuild' in type(f).__name__]
sys.meta_path[:] = [f for f in sys.meta_path if f not in drop]
sys.path.insert(0, {copy!r})
# and so do processes the tests spawn (the data-parallel ranks): the finder skips a build dir listed in
# SKBUILD_EDITABLE_SKIP, and PYTHONPATH puts the copy first
os.environ["SKBUILD_EDITABLE_SKIP"] = os.pathsep.join(
    [os.environ.get("SKBUILD_EDITABLE_SKIP", ""), *(str(getattr(f, "path", "") or "") for f in drop)])
os.environ["PYTHONPATH"] = os.pathsep.join([{copy!r}, os.environ.get("PYTHONPATH", "")])
if __name__ == "__main__":  # a spawned rank imports this module again (as __mp_main__): no pytest there
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
"""


def copy_repo(dest: Path) -> None:
    for part in ("offload", "tests", "examples"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    built = glob.glob(str(ROOT / "build" / "*" / "_C*.so")) or glob.glob(str(ROOT / "offload" / "_C*.so"))
    shutil.copy(built[0], dest / "offload")


def edits(mutation) -> list[tuple[str, str, str]]:
    """A mutation's (file, old, new) edits: its own, or those of the mutations it combines."""
    ident, _, path, old, new = mutation[:5]
    if path == "+":
        return [e for part in old.split("+") for m in MUTATIONS if m[0] == part for e in edits(m)]
    return [(path, old, new)]


def tests_of(mutation) -> list[str]:
    """The tests a mutation runs: its own list, TESTS if it has none, a pair's: its first part's."""
    if mutation[2] == "+":
        return tests_of(next(m for m in MUTATIONS if m[0] == mutation[3].split("+")[0]))
    listed = mutation[5] if len(mutation) > 5 else ["TESTS"]
    return [t for name in listed for t in (TESTS if name == "TESTS" else [name])]


def missing_patterns(mutations) -> list[str]:
    """Mutations whose old text does not occur exactly once in this checkout (the code moved on: update the
    pattern, never skip the mutation)."""
    bad = []
    for mutation in mutations:
        for path, old, _ in edits(mutation):
            found = (ROOT / path).read_text().count(old) if (ROOT / path).exists() else 0
            if found != 1:
                bad.append(f"{mutation[0]}: {path} has its text {found} time(s), not once: {old!r}")
    return bad


def run_one(mutation, timeout: int) -> tuple[str, float, str]:
    ident = mutation[0]
    with tempfile.TemporaryDirectory(prefix=f"mut-{ident}-") as tmp:
        dest = Path(tmp)
        copy_repo(dest)
        for path, old, new in edits(mutation):
            text = (dest / path).read_text()
            if text.count(old) != 1:
                raise SystemExit(f"{ident}: its text is not found once in {path} (checked at start: a file changed?)")
            (dest / path).write_text(text.replace(old, new))
        (dest / "launch.py").write_text(LAUNCH.format(copy=str(dest)))
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "launch.py", "-x", "-q", "-p", "no:cacheprovider",
                                   *tests_of(mutation)],
                                  cwd=dest, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", time.time() - t0, ""
        out = proc.stdout + proc.stderr
        caught = list(dict.fromkeys(line.split(" ", 1)[1].split(" - ")[0] for line in out.splitlines()
                                    if line.startswith(("FAILED ", "ERROR "))))
        if proc.returncode == 0:
            summary = [line for line in out.splitlines() if " passed" in line]
            return "NOT CAUGHT", time.time() - t0, summary[-1].strip("= ") if summary else ""
        reason = ""
        for line in out.splitlines():
            if line.startswith("E ") and not reason:
                reason = line[1:].strip()[:160]
        for mark in ("SimulatedRace: ", "SimulatedRace('"):  # a spawned rank's race, inside its traceback: name
            if mark in out:  # it, not the traceback's first line
                reason = out[out.index(mark):][:200].splitlines()[0]
                break
        return ("caught by " + ", ".join(caught)) if caught else f"pytest exit {proc.returncode}", \
            time.time() - t0, reason


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--check", action="store_true", help="only check that every mutation's text is found once")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    unknown = only - {m[0] for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"no such mutation: {sorted(unknown)}")
    selected = [m for m in MUTATIONS if not only or m[0] in only]
    bad = missing_patterns(selected)
    if bad:  # fail loudly: a mutation that does not apply would otherwise look like one that was not caught
        raise SystemExit("mutations that do not apply to this checkout:\n  " + "\n  ".join(bad))
    if args.check:
        print(f"all {len(selected)} mutations apply")
        return
    for mutation in selected:
        verdict, seconds, reason = run_one(mutation, args.timeout)
        files = ", ".join(sorted({f"`{path}`" for path, _, _ in edits(mutation)}))
        print(f"| {mutation[0]} | {mutation[1]} | {files} | {verdict} | {reason} | {seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
