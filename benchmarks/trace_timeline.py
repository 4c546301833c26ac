"""Where one training step's time goes, lane by lane, read from a torch.profiler chrome trace of that step
(``benchmarks/vs_baselines.py --profile DIR`` writes one per run: ``bench_systems.profile_step``).

    python benchmarks/trace_timeline.py benchmarks/results/2026-11-27-h200/run3/bench/profiles/*.json.gz
    python benchmarks/trace_timeline.py TRACE.json.gz --json summary.json

Every number is read from the trace (times are the profiler's, with its own overhead in them); what the trace
cannot show is said so, and the few derived estimates are named ``*_est`` in the JSON.

Lanes, and how each is recognised:

* host threads: ``main`` (the thread whose id is the process id: it runs forward and ``step()``), ``autograd``
  (another thread with ``autograd::engine::evaluate_function`` ops: CUDA backward runs on autograd's device
  thread), ``cpu_adam`` (a thread whose only events are its waits: ``cudaEventSynchronize``, or since c9adf4c
  ``cudaEventQuery``, each followed by a ``cudaEventSynchronize`` at most: the engine's CPU lane. The profiler
  records no op on a thread it did not start on, so its AdamW calls themselves are invisible; its waits for the
  copies its items depend on are CUDA API calls, which CUPTI records on every thread);
* GPU streams: ``h2d`` / ``d2h`` (the stream whose copies are mostly host-to-device / device-to-host, the
  backend's two copy streams), ``compute`` (any other stream with kernels).

Phases: ``forward`` from the first event to the first backward op, ``backward`` to the last event of the
autograd thread (its end-of-backward callback included), ``after`` to the last event (``step()``'s wait for the
CPU lane, the refresh copies it issues, ``zero_grad``, the harness's device synchronize).

[Note: reading the CPU lane from its waits]
Each lane item waits for its events (the grad copy, then the bucket's last weight copy) and then runs AdamW on one
piece of the grad ring. The items are the D2H copies, in order; the lane's waits are read in one of two ways:
* traces made before c9adf4c: a wait is one ``cudaEventSynchronize``, and every item has as many
  (``waits_per_item``: the waits over the copies; a count that does not divide is not read);
* since c9adf4c: a wait is a ``cudaEventQuery``, with the ``cudaEventSynchronize`` right after it where the event
  was not complete ([Note: the cost of a lane item] in offload/backend/base.py), the two one wait from the query's
  start to the synchronize's end (``queries``, ``synchronizes``). An item has two waits, but the later pieces of
  a bucket that crosses the grad ring in pieces wait for their grad copy only ([Note: one H2D wait per bucket's
  update] in offload/runtime/grads.py). A later piece is a copy that follows a copy of the ring's piece size (the
  largest copy size that repeats: ``ring_piece_bytes``; ``later_pieces``), and the count is checked: where two
  waits an item less one per later piece is not the number of waits (a wait for a host event calls no CUDA API,
  so it is not in the trace), the items are not read.
``wait_by_position_s`` sums the items' first waits, their second ones, ... An item's AdamW is the time from the
end of its last wait to the start of the next item's first wait, when the next item was already queued then (it
is submitted when the thread issuing backward returns from its ``offload::d2h``); otherwise that gap holds idle
time too. The queued items give the lane's achieved rate (``params_per_s_queued``) and, by a least-squares line
through their (parameters, time), a cost per item and a rate per parameter (``fit_per_item_s``,
``fit_params_per_s``); the idle time in the other gaps is estimated at the queued rate (``idle_est_s``), and the
busy time as the window less waits and idle (``busy_est_s``). The last item's gap ends when the main thread
resumes after the lane's last wait (``step()``'s drain returned): an upper bound.

Host waits for the CPU lane (the grad ring's readers, an update a copy must follow) block inside the backend's
``offload::d2h`` / ``offload::h2d`` / ``offload::wait`` annotations on a lock the profiler does not see: the
part of such an annotation not covered by the ops recorded inside it is that wait (plus a few microseconds of
Python).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"})
BACKWARD_OP = "autograd::engine::evaluate_function"
LANE_WAIT = "cudaEventSynchronize"
LANE_QUERY = "cudaEventQuery"  # a lane item's waits since c9adf4c ([Note: reading the CPU lane from its waits])
HOST_WAIT_SPANS = ("offload::d2h", "offload::h2d", "offload::wait")
US = 1e-6  # trace times are microseconds; the JSON's are seconds
SMALL_ITEM = 1 << 15  # parameters: the C++ AdamW runs on the calling thread below this (cpp/cpu_adam.cpp)


@dataclass(frozen=True)
class Ev:
    name: str
    cat: str
    start: float  # microseconds, as in the trace
    end: float
    args: dict = field(default_factory=dict, compare=False)

    @property
    def bytes(self) -> int:
        return int(self.args.get("bytes", 0))


# -- intervals ----------------------------------------------------------------------------------------------


def union(spans) -> list[tuple[float, float]]:
    """Merged, sorted ``(start, end)`` of possibly overlapping or nested spans."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(merged, lo: float, hi: float) -> float:
    """How much of ``[lo, hi)`` the merged spans cover."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in merged)


def gaps(merged, lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi)`` no merged span covers."""
    out, at = [], lo
    for s, e in merged:
        if s > at and at < hi:
            out.append((at, min(s, hi)))
        at = max(at, e)
    if at < hi:
        out.append((at, hi))
    return out


# -- reading ------------------------------------------------------------------------------------------------


def load(path: str | Path) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def lanes_of(trace: dict) -> dict[tuple, list[Ev]]:
    """``(pid, tid) -> events`` (complete ``X`` events of host threads and GPU streams, sorted by start)."""
    lanes: dict[tuple, list[Ev]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS | HOST_CATS or "dur" not in e:
            continue
        ts = float(e["ts"])
        lanes.setdefault((e["pid"], e["tid"]), []).append(
            Ev(e.get("name", ""), e["cat"], ts, ts + float(e["dur"]), e.get("args") or {}))
    for evs in lanes.values():
        evs.sort(key=lambda x: (x.start, -x.end))
    return lanes


def roles(lanes: dict[tuple, list[Ev]]) -> dict[tuple, str]:
    """Each lane's role (see the module docstring); ``other`` where none fits."""
    out: dict[tuple, str] = {}
    host = [k for k, evs in lanes.items() if not any(e.cat in GPU_CATS for e in evs)]
    for k, evs in lanes.items():
        if k in host:
            continue
        h2d = sum(e.bytes for e in evs if e.cat == "gpu_memcpy" and "HtoD" in e.name)
        d2h = sum(e.bytes for e in evs if e.cat == "gpu_memcpy" and "DtoH" in e.name)
        kernels = any(e.cat == "kernel" for e in evs)
        out[k] = "h2d" if h2d > d2h and not kernels else "d2h" if d2h > h2d and not kernels else "compute"
    mains = [k for k in host if k[0] == k[1]] or sorted(host, key=lambda k: lanes[k][0].start)[:1]
    for k in host:
        evs = lanes[k]
        if k in mains[:1]:
            out[k] = "main"
        elif is_lane(evs):
            out[k] = "cpu_adam"
        elif any(e.name.startswith(BACKWARD_OP) for e in evs):
            out[k] = "autograd"
        else:
            out[k] = "other"
    return out


def is_lane(evs: list[Ev]) -> bool:
    """Whether a host thread's events are all the CPU lane's waits: synchronizes, or queries each followed by a
    synchronize at most ([Note: reading the CPU lane from its waits])."""
    names = [e.name for e in evs]
    if any(n not in (LANE_WAIT, LANE_QUERY) for n in names):
        return False
    return LANE_QUERY not in names or all(n != LANE_WAIT or (i > 0 and names[i - 1] == LANE_QUERY)
                                          for i, n in enumerate(names))


def lane_waits(evs: list[Ev]) -> list[tuple[float, float]]:
    """The lane's waits, ``(start, end)``: each synchronize, but one right after a query is part of its wait."""
    out: list[tuple[float, float]] = []
    for i, e in enumerate(evs):
        if e.name == LANE_WAIT and i > 0 and evs[i - 1].name == LANE_QUERY:
            out[-1] = (out[-1][0], e.end)
        else:
            out.append((e.start, e.end))
    return out


def lane_with_role(rs: dict[tuple, str], role: str) -> tuple | None:
    """The one lane of ``role`` (None: none, or several)."""
    ks = [k for k, r in rs.items() if r == role]
    return ks[0] if len(ks) == 1 else None


def label(key: tuple, role: str) -> str:
    return f"{role} (pid {key[0]}, {'stream' if role in ('h2d', 'd2h', 'compute') else 'tid'} {key[1]})"


# -- the summary --------------------------------------------------------------------------------------------


def summarise(trace: dict, grad_bytes_per_param: int = 2, gap_us: float = 1000.0, top: int = 5) -> dict:
    """The whole summary of one step's trace, as a JSON-ready dict (seconds)."""
    lanes = lanes_of(trace)
    if not lanes:
        raise ValueError("no complete (ph X) host or GPU events in this trace")
    rs = roles(lanes)
    t0 = min(evs[0].start for evs in lanes.values())
    t1 = max(max(e.end for e in evs) for evs in lanes.values())
    phases = _phases(lanes, rs, t0, t1)
    out: dict = {"step_s": (t1 - t0) * US, "phases": {n: {"start_s": (a - t0) * US, "end_s": (b - t0) * US,
                                                          "seconds": (b - a) * US} for n, (a, b) in phases.items()}}
    out["lanes"] = [_lane(k, rs[k], lanes[k], phases, t0, t1, gap_us, top) for k in sorted(lanes, key=str)]
    out["copies"] = {d: _copies(lanes, rs, d, phases, t0) for d in ("h2d", "d2h")}
    out["gpu_kernels"] = _kernels(lanes, rs, phases)
    out["host_waits"] = _host_waits(lanes, rs, phases)
    out["cpu_adam"] = _cpu_adam(lanes, rs, t0, grad_bytes_per_param)
    out["end_of_step"] = _end_of_step(lanes, rs, phases, t0, t1)
    return out


def _phases(lanes, rs, t0: float, t1: float) -> dict[str, tuple[float, float]]:
    bwd = [e for k, evs in lanes.items() if rs[k] in ("main", "autograd") for e in evs
           if e.name.startswith(BACKWARD_OP)]
    if not bwd:
        return {"step": (t0, t1)}
    start = min(e.start for e in bwd)
    ag = lane_with_role(rs, "autograd")
    end = max(e.end for e in lanes[ag]) if ag is not None else max(e.end for e in bwd)
    return {"forward": (t0, start), "backward": (start, end), "after": (end, t1)}


def _lane(key, role, evs, phases, t0, t1, gap_us, top) -> dict:
    spans = union((e.start, e.end) for e in evs)
    first = spans[0][0] if spans else t0
    idle = gaps(spans, first, t1)
    big = sorted((g for g in idle if g[1] - g[0] >= gap_us), key=lambda g: g[0] - g[1])
    return {"lane": label(key, role), "role": role, "pid": key[0], "tid": key[1], "events": len(evs),
            "first_s": (first - t0) * US, "last_s": (max(e.end for e in evs) - t0) * US,
            "busy_s": sum(e - s for s, e in spans) * US,
            "busy_by_phase_s": {n: covered(spans, a, b) * US for n, (a, b) in phases.items()},
            "idle_s": sum(e - s for s, e in idle) * US, "gaps_over_threshold": len(big),
            "gaps_over_threshold_s": sum(e - s for s, e in big) * US, "gap_threshold_s": gap_us * 1e-6,
            "largest_gaps": [{"start_s": (s - t0) * US, "end_s": (e - t0) * US, "seconds": (e - s) * US}
                             for s, e in big[:top]]}


def _copies(lanes, rs, direction: str, phases, t0: float) -> dict:
    tag = "HtoD" if direction == "h2d" else "DtoH"
    evs = [e for k, es in lanes.items() if rs[k] in ("h2d", "d2h", "compute") for e in es
           if e.cat == "gpu_memcpy" and tag in e.name]
    spans = union((e.start, e.end) for e in evs)
    busy = sum(e - s for s, e in spans)
    nbytes = sum(e.bytes for e in evs)
    out = {"copies": len(evs), "bytes": nbytes, "busy_s": busy * US,
           "achieved_GBps": nbytes / busy / 1e3 if busy else None,  # bytes per microsecond / 1e3 = GB/s
           "by_phase": {}}
    for n, (a, b) in phases.items():
        inside = [e for e in evs if a <= e.start < b]
        out["by_phase"][n] = {"copies": len(inside), "bytes": sum(e.bytes for e in inside),
                              "busy_s": covered(spans, a, b) * US}
    return out


def _kernels(lanes, rs, phases) -> dict:
    evs = [e for k, es in lanes.items() if rs[k] == "compute" for e in es if e.cat in GPU_CATS]
    spans = union((e.start, e.end) for e in evs)
    kspans = union((e.start, e.end) for e in evs if e.cat == "kernel")
    return {"kernels": sum(e.cat == "kernel" for e in evs), "kernel_busy_s": sum(e - s for s, e in kspans) * US,
            "busy_s": sum(e - s for s, e in spans) * US,  # kernels, memsets and device-to-device copies
            "busy_by_phase_s": {n: covered(spans, a, b) * US for n, (a, b) in phases.items()}}


def _host_waits(lanes, rs, phases) -> dict:
    """Per host thread and annotation: the part of its spans that no op recorded inside covers (see the
    module docstring: the host blocked on the CPU lane)."""
    out: dict = {}
    for k, evs in lanes.items():
        if rs[k] not in ("main", "autograd", "other"):
            continue
        for name in HOST_WAIT_SPANS:
            spans = [e for e in evs if e.name == name and e.cat == "user_annotation"]
            if not spans:
                continue
            blocked = []
            starts = [e.start for e in evs]
            for sp in spans:
                inner = union((e.start, e.end) for e in inside(evs, starts, sp))
                blocked.append((sp.start, (sp.end - sp.start) - covered(inner, sp.start, sp.end)))
            times = sorted(b for _, b in blocked)
            out[f"{rs[k]}:{name}"] = {
                "thread": label(k, rs[k]), "spans": len(spans), "span_s": sum(e.end - e.start for e in spans) * US,
                "uncovered_s": sum(times) * US, "over_100us": sum(b > 100 for b in times),
                "over_100us_s": sum(b for b in times if b > 100) * US, "max_s": times[-1] * US,
                "uncovered_by_phase_s": {n: sum(b for s, b in blocked if a <= s < z) * US
                                         for n, (a, z) in phases.items()}}
    return out


def inside(evs: list[Ev], starts: list[float], sp: Ev) -> list[Ev]:
    """Events of ``evs`` (sorted by start; ``starts`` theirs) that lie within ``sp``, ``sp`` itself not."""
    lo, hi = bisect.bisect_left(starts, sp.start), bisect.bisect_right(starts, sp.end)
    return [e for e in evs[lo:hi] if e is not sp and e.end <= sp.end]


def _cpu_adam(lanes, rs, t0: float, grad_bytes_per_param: int) -> dict:
    """The CPU lane read from its waits ([Note: reading the CPU lane from its waits], the module docstring)."""
    key = lane_with_role(rs, "cpu_adam")
    if key is None:
        return {"found": False, "note": "no thread whose only events are event synchronizes or queries: the CPU lane "
                                        "is not in this trace (on the CPU backend the profiler records nothing of it)"}
    evs = lanes[key]
    waits = lane_waits(evs)
    copies = sorted((e for k, es in lanes.items() if rs[k] in ("d2h", "compute", "h2d") for e in es
                     if e.cat == "gpu_memcpy" and "DtoH" in e.name), key=lambda e: e.start)
    submits = sorted(e.end for k, es in lanes.items() if rs[k] in ("main", "autograd", "other") for e in es
                     if e.name == "offload::d2h" and e.cat == "user_annotation")
    n = len(copies)
    out: dict = {"found": True, "thread": label(key, "cpu_adam"), "waits": len(waits),
                 "wait_s": sum(e - s for s, e in waits) * US, "first_s": (waits[0][0] - t0) * US, "items": n}
    counts = _item_waits(evs, copies, len(waits), out)
    if counts is None:
        return out
    firsts = list(itertools.accumulate(counts, initial=0))  # item k's waits: firsts[k] to firsts[k + 1]
    out["wait_by_position_s"] = [sum(waits[f + j][1] - waits[f + j][0] for f, c in zip(firsts, counts) if j < c) * US
                                 for j in range(max(counts))]
    main = lane_with_role(rs, "main")
    later = [e.start for e in lanes[main] if e.start >= waits[-1][1]] if main is not None else []
    resume = min(later) if later else None  # step()'s drain returned: the last AdamW ended before
    items = []  # (params, gap after the item's last wait, next item already queued then)
    for k in range(n):
        ready = waits[firsts[k + 1] - 1][1]
        nxt = waits[firsts[k + 1]][0] if k + 1 < n else resume
        queued = k + 1 < n and len(submits) == n and submits[k + 1] <= ready
        items.append((copies[k].bytes // grad_bytes_per_param, None if nxt is None else nxt - ready, queued))
    out.update(_rates(items, grad_bytes_per_param, len(submits) == n))
    params = sum(p for p, _, _ in items)
    out["params"] = params
    if resume is not None:
        window = resume - waits[0][0]
        out["last_adam_end_at_most_s"] = (resume - t0) * US
        out["window_s"] = window * US
        out["achieved_params_per_s_window"] = params / window * 1e6
        if out.get("idle_est_s") is not None:
            out["busy_est_s"] = out["window_s"] - out["wait_s"] - out["idle_est_s"]
    return out


def _item_waits(evs: list[Ev], copies: list[Ev], nwaits: int, out: dict) -> list[int] | None:
    """How many of the lane's waits each item (D2H copy) has, or None with ``out["note"]`` where the count does not
    check ([Note: reading the CPU lane from its waits]); adds how the waits were read to ``out``."""
    n = len(copies)
    queries = sum(e.name == LANE_QUERY for e in evs)
    if not queries:  # before c9adf4c: every item synchronizes as many events
        if n == 0 or nwaits % n:
            out["note"] = f"{nwaits} waits for {n} grad copies: not one item per copy, items not read"
            return None
        out["waits_per_item"] = nwaits // n
        return [nwaits // n] * n
    syncs = [e for e in evs if e.name == LANE_WAIT]
    sizes = collections.Counter(c.bytes for c in copies)
    piece = max((b for b, m in sizes.items() if m > 1), default=None)
    later = [k > 0 and copies[k - 1].bytes == piece for k in range(n)]
    out.update({"queries": queries, "synchronizes": len(syncs),
                "synchronize_s": sum(e.end - e.start for e in syncs) * US, "ring_piece_bytes": piece,
                "later_pieces": sum(later)})
    counts = [1 if x else 2 for x in later]
    if n == 0 or sum(counts) != nwaits:
        out["note"] = (f"{nwaits} waits for {n} grad copies, {sum(later)} of them later pieces of a bucket: not two "
                       "waits per item less one per later piece, items not read")
        return None
    return counts


def _rates(items, grad_bytes_per_param: int, have_submits: bool) -> dict:
    q = [(p, g) for p, g, queued in items if queued and g is not None]
    out: dict = {"grad_bytes_per_param": grad_bytes_per_param, "submit_times": have_submits,
                 "queued_items": len(q), "queued_params": sum(p for p, _ in q), "queued_s": sum(g for _, g in q) * US}
    if not q or not out["queued_s"]:
        out["note_rate"] = ("no item whose successor was queued before it began: the AdamW rate cannot be read"
                            if have_submits else "no offload::d2h spans to time the submits by")
        return out
    rate = out["queued_params"] / out["queued_s"]  # per second
    big = [p / g * 1e6 for p, g in q if p >= 1 << 20 and g > 0]
    out["params_per_s_queued"] = rate
    out["params_per_s_queued_median_large"] = statistics.median(big) if big else None
    fit = fit_line([(p, g * US) for p, g in q])
    if fit is not None:  # seconds per item at no parameters, and the rate per parameter beyond it
        out["fit_per_item_s"], out["fit_params_per_s"] = fit[0], (1 / fit[1] if fit[1] > 0 else None)
    small = [g * US for p, g in q if p < SMALL_ITEM]
    out["small_items"] = len(small)  # their AdamW runs on the lane's thread in microseconds: the rest is per item
    out["small_items_median_s"] = statistics.median(small) if small else None
    rest = [(p, g) for p, g, queued in items if not queued and g is not None]
    out["unqueued_items"] = len(rest)
    out["unqueued_gap_s"] = sum(g for _, g in rest) * US
    # Idle in each such gap: what the queued rate says its AdamW did not take (an estimate).
    out["idle_est_s"] = sum(max(0.0, g * US - p / rate) for p, g in rest)
    return out


def fit_line(points) -> tuple[float, float] | None:
    """Least squares ``y = a + b x`` over ``(x, y)`` points: ``(a, b)``; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def _end_of_step(lanes, rs, phases, t0: float, t1: float) -> dict:
    if "backward" not in phases:
        return {"note": "no backward op in this trace"}
    bwd_end = phases["backward"][1]
    out: dict = {"backward_end_s": (bwd_end - t0) * US, "step_end_s": (t1 - t0) * US}
    main = lane_with_role(rs, "main")
    if main is not None:
        evs = lanes[main]
        after = [e for e in evs if e.start >= bwd_end]
        if after:
            out["main_resumes_s"] = (after[0].start - t0) * US  # blocked in backward and step()'s drain until then
            issue = [e for e in after if e.name == "offload::h2d"]
            if issue:
                out["refresh_issue_s"] = {"first_s": (issue[0].start - t0) * US, "last_s": (issue[-1].end - t0) * US,
                                          "spans": len(issue)}
        last = max(evs, key=lambda e: e.end)
        out["main_last_event"] = {"name": last.name, "start_s": (last.start - t0) * US,
                                  "seconds": (last.end - last.start) * US}
    refresh = [e for k, es in lanes.items() if rs[k] in ("h2d", "compute") for e in es
               if e.cat == "gpu_memcpy" and "HtoD" in e.name and e.start >= bwd_end]
    if refresh:
        spans = union((e.start, e.end) for e in refresh)
        busy = sum(e - s for s, e in spans)
        out["refresh_copies"] = {"copies": len(refresh), "bytes": sum(e.bytes for e in refresh),
                                 "first_s": (spans[0][0] - t0) * US, "last_end_s": (spans[-1][1] - t0) * US,
                                 "busy_s": busy * US, "achieved_GBps": sum(e.bytes for e in refresh) / busy / 1e3}
    ends = sorted(((max(e.end for e in es), rs[k], k) for k, es in lanes.items()), reverse=True)
    out["lanes_by_last_end"] = [{"lane": label(k, r), "last_end_s": (end - t0) * US} for end, r, k in ends]
    return out


# -- output -------------------------------------------------------------------------------------------------


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def render(path: str, s: dict, console) -> None:
    from rich.table import Table

    console.print(f"[bold]{path}[/bold]: step {_ms(s['step_s'])} ms; phases "
                  + ", ".join(f"{n} {_ms(p['start_s'])}-{_ms(p['end_s'])} ({_ms(p['seconds'])})"
                              for n, p in s["phases"].items()))
    names = list(s["phases"])
    t = Table(title="lanes (ms): busy = union of the lane's recorded spans; gaps over the threshold")
    for c in ("lane", "events", "first", "last", "busy", *[f"busy {n}" for n in names], "idle", "gaps", "in gaps",
              "largest gap"):
        t.add_column(c, justify="left" if c == "lane" else "right")
    for ln in s["lanes"]:
        g = ln["largest_gaps"][0] if ln["largest_gaps"] else None
        t.add_row(ln["lane"], str(ln["events"]), _ms(ln["first_s"]), _ms(ln["last_s"]), _ms(ln["busy_s"]),
                  *[_ms(ln["busy_by_phase_s"][n]) for n in names], _ms(ln["idle_s"]), str(ln["gaps_over_threshold"]),
                  _ms(ln["gaps_over_threshold_s"]),
                  f"{_ms(g['seconds'])} at {_ms(g['start_s'])}" if g else "-")
    console.print(t)
    for d, c in s["copies"].items():
        gbps = "-" if c["achieved_GBps"] is None else f"{c['achieved_GBps']:.1f}"
        console.print(f"{d.upper()}: {c['copies']} copies, {c['bytes'] / 1e9:.3f} GB, busy {_ms(c['busy_s'])} ms, "
                      f"{gbps} GB/s while busy; by phase "
                      + ", ".join(f"{n} {p['bytes'] / 1e9:.3f} GB / {_ms(p['busy_s'])} ms"
                                  for n, p in c["by_phase"].items()))
    k = s["gpu_kernels"]
    console.print(f"GPU compute stream(s): {k['kernels']} kernels, kernel busy {_ms(k['kernel_busy_s'])} ms, with "
                  f"memsets and device copies {_ms(k['busy_s'])} ms; by phase "
                  + ", ".join(f"{n} {_ms(v)}" for n, v in k["busy_by_phase_s"].items()))
    for name, w in s["host_waits"].items():
        console.print(f"host blocked inside {name} ({w['thread']}): {_ms(w['uncovered_s'])} ms of {w['spans']} spans "
                      f"({_ms(w['span_s'])} ms), {w['over_100us']} over 100 us ({_ms(w['over_100us_s'])} ms), "
                      f"max {_ms(w['max_s'])} ms; by phase "
                      + ", ".join(f"{n} {_ms(v)}" for n, v in w["uncovered_by_phase_s"].items()))
    _render_adam(s["cpu_adam"], console)
    e = s["end_of_step"]
    if "backward_end_s" in e:
        line = f"end of step: backward ends {_ms(e['backward_end_s'])}"
        if "main_resumes_s" in e:
            line += f", the main thread resumes {_ms(e['main_resumes_s'])} (blocked in backward and step()'s drain)"
        if "refresh_issue_s" in e:
            r = e["refresh_issue_s"]
            line += f", issues {r['spans']} copies {_ms(r['first_s'])}-{_ms(r['last_s'])}"
        if "refresh_copies" in e:
            r = e["refresh_copies"]
            line += (f"; refresh copies {r['copies']} ({r['bytes'] / 1e9:.3f} GB) run {_ms(r['first_s'])}-"
                     f"{_ms(r['last_end_s'])}, busy {_ms(r['busy_s'])} ms, {r['achieved_GBps']:.1f} GB/s")
        if "main_last_event" in e:
            m = e["main_last_event"]
            line += f"; the main thread's last event {m['name']} at {_ms(m['start_s'])}"
        console.print(line + f"; step ends {_ms(e['step_end_s'])}")
    else:
        console.print(f"end of step: {e['note']}")
    console.print("lanes by last end: " + ", ".join(f"{x['lane']} {_ms(x['last_end_s'])}"
                                                    for x in e.get("lanes_by_last_end", [])[:4]))


def _render_adam(a: dict, console) -> None:
    if not a["found"]:
        console.print(f"CPU AdamW lane: {a['note']}")
        return
    line = (f"CPU AdamW lane ({a['thread']}): {a['items']} items, {a['waits']} waits ({_ms(a['wait_s'])} ms waiting "
            f"for copies")
    if "queries" in a:
        line += (f"; {a['queries']} cudaEventQuery, {a['synchronizes']} cudaEventSynchronize after one: "
                 f"{_ms(a['synchronize_s'])} ms; {a['later_pieces']} later pieces of a bucket in ring pieces of "
                 f"{a['ring_piece_bytes']} B")
    line += ")"
    if "params" in a:
        line += f", {a['params'] / 1e9:.3f}e9 params"
    if "window_s" in a:
        line += (f"; window {_ms(a['window_s'])} ms (to {_ms(a['last_adam_end_at_most_s'])}), "
                 f"{a['achieved_params_per_s_window'] / 1e9:.2f}e9 params/s over it")
    if a.get("params_per_s_queued"):
        med = a["params_per_s_queued_median_large"]
        line += (f"; queued items {a['queued_items']}: {a['params_per_s_queued'] / 1e9:.2f}e9 params/s"
                 f" (median of >= 1 Mi-param items {'-' if med is None else f'{med / 1e9:.2f}e9'}); "
                 + (f"fit over them: {a['fit_per_item_s'] * 1e6:.0f} us per item + "
                    f"{a['fit_params_per_s'] / 1e9:.2f}e9 params/s; " if a.get("fit_params_per_s") else "")
                 + (f"{a['small_items']} small items (< 32 Ki params): median "
                    f"{a['small_items_median_s'] * 1e6:.0f} us; " if a.get("small_items") else "")
                 + f"unqueued {a['unqueued_items']}: {_ms(a['unqueued_gap_s'])} ms of gaps, idle est "
                 f"{_ms(a['idle_est_s'])} ms")
    if "busy_est_s" in a:
        line += f"; AdamW busy est {_ms(a['busy_est_s'])} ms"
    for k in ("note", "note_rate"):
        if k in a:
            line += f" ({a[k]})"
    console.print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="chrome traces (.json or .json.gz) of one step each")
    ap.add_argument("--json", help="write the summaries here ({path: summary})")
    ap.add_argument("--grad-bytes-per-param", type=int, default=2,
                    help="bytes of one parameter's grad on the way to the host (2: bf16/fp16 compute; 4: fp32)")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="idle gaps at least this long are counted and listed")
    ap.add_argument("--top", type=int, default=5, help="the largest gaps listed per lane in the JSON")
    args = ap.parse_args(argv)
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 220)
    out = {}
    for p in args.traces:
        s = summarise(load(p), args.grad_bytes_per_param, args.gap_ms * 1e3, args.top)
        out[p] = s
        render(p, s, console)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
