"""The CPU lane of a run-5 trace, which ``benchmarks/trace_timeline.py`` (as of 287f0af) does not find: since
c9adf4c a lane item queries a device event (``cudaEventQuery``) and synchronizes it only when it is not complete
([Note: the cost of a lane item] in offload/backend/base.py), so the lane's thread is no longer "only
``cudaEventSynchronize``" and the tool calls it ``other``. This reads it the same way
([Note: reading the CPU lane from its waits] in trace_timeline.py), with two changes:

* a wait is a ``cudaEventQuery``, plus the ``cudaEventSynchronize`` right after it when the event was not done;
* an item has two waits (its grad copy, the bucket's last H2D), except the later pieces of a bucket that crosses
  the grad ring in pieces, which wait for their copy only ([Note: one H2D wait per bucket's update] in
  runtime/grads.py). Such pieces are read from the D2H copies: a copy that follows a copy of the ring's piece size
  (the largest size that repeats) continues that bucket. The count is checked against the waits.

Also the forward's main-thread time outside recorded ops and ``AccumulateGrad``'s bare time, as
``analysis/lane_splits.py`` prints them for the run-2/3 traces. Read from the trace only; ``est`` as in the tool.

    python3 benchmarks/results/2026-11-27-h200/run5/analysis/cpu_lane.py TRACE.json.gz [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/
import trace_timeline as tt  # noqa: E402

QUERY, SYNC = "cudaEventQuery", "cudaEventSynchronize"


def lane_thread(lanes, rs):
    """The one host thread whose events are all event queries or synchronizes (the CPU lane)."""
    ks = [k for k, r in rs.items() if r in ("other", "cpu_adam")
          and all(e.name in (QUERY, SYNC) for e in lanes[k])]
    if len(ks) != 1:
        raise ValueError(f"{len(ks)} threads of only event queries/synchronizes: expected one (the CPU lane)")
    return ks[0]


def waits_of(evs):
    """``[(start, end, synchronized)]``: a query, merged with the synchronize that follows it."""
    out: list[list] = []
    for e in evs:
        if e.name == SYNC and out and not out[-1][2]:
            out[-1][1], out[-1][2] = e.end, True
        else:
            out.append([e.start, e.end, e.name == SYNC])
    return [tuple(w) for w in out]


def read(path: str, grad_bytes_per_param: int = 2) -> dict:
    lanes = tt.lanes_of(tt.load(path))
    rs = tt.roles(lanes)
    t0 = min(evs[0].start for evs in lanes.values())
    key = lane_thread(lanes, rs)
    evs = lanes[key]
    waits = waits_of(evs)
    copies = sorted((e for k, es in lanes.items() if rs[k] == "d2h" for e in es if e.cat == "gpu_memcpy"),
                    key=lambda e: e.start)
    ag = lanes[tt.lane_with_role(rs, "autograd")]
    main = lanes[tt.lane_with_role(rs, "main")]
    submits = sorted(e.end for e in ag if e.name == "offload::d2h")
    sizes = collections.Counter(c.bytes for c in copies)
    piece = max((b for b, n in sizes.items() if n > 1), default=None)
    later = [k > 0 and copies[k - 1].bytes == piece for k in range(len(copies))]
    n = len(copies)
    out: dict = {"trace": path, "lane": tt.label(key, "cpu_adam"), "events": len(evs),
                 "queries": sum(e.name == QUERY for e in evs), "synchronizes": sum(e.name == SYNC for e in evs),
                 "synchronize_s": [(e.end - e.start) * tt.US for e in evs if e.name == SYNC],
                 "waits": len(waits), "wait_s": sum(b - a for a, b, _ in waits) * tt.US, "items": n,
                 "ring_piece_bytes": piece, "later_pieces": sum(later), "submits": len(submits)}
    if sum(2 - x for x in later) != len(waits):
        out["note"] = f"{len(waits)} waits for {n} items ({sum(later)} later pieces): not read"
        return out
    firsts, k0 = [], 0  # index of each item's first wait
    for x in later:
        firsts.append(k0)
        k0 += 1 if x else 2
    fwd_end = min(e.start for e in ag if e.name.startswith(tt.BACKWARD_OP))
    resume = min(e.start for e in main if e.start >= waits[-1][1])  # step()'s drain returned
    items = []  # (params, gap after the item's last wait, next item queued then)
    for k in range(n):
        ready = waits[(firsts[k + 1] if k + 1 < n else len(waits)) - 1][1]
        nxt = waits[firsts[k + 1]][0] if k + 1 < n else resume
        queued = k + 1 < n and len(submits) == n and submits[k + 1] <= ready
        items.append((copies[k].bytes // grad_bytes_per_param, nxt - ready, queued))
    q = [(p, g) for p, g, queued in items if queued]
    rate = sum(p for p, _ in q) / sum(g for _, g in q) * 1e6
    a, b = tt.fit_line([(p, g * tt.US) for p, g in q])
    rest = [(p, g) for p, g, queued in items if not queued]
    params = sum(p for p, _, _ in items)
    window = (resume - waits[0][0]) * tt.US
    idle = sum(max(0.0, g * tt.US - p / rate) for p, g in rest)
    small = [g * tt.US for p, g in q if p < tt.SMALL_ITEM]
    out.update({
        "params": params, "forward_end_s": (fwd_end - t0) * tt.US, "first_wait_s": (waits[0][0] - t0) * tt.US,
        "last_wait_end_s": (waits[-1][1] - t0) * tt.US, "main_resumes_s": (resume - t0) * tt.US,
        "window_s": window, "params_per_s_window": params / window,
        "queued_items": len(q), "queued_params": sum(p for p, _ in q), "params_per_s_queued": rate,
        "fit_per_item_s": a, "fit_params_per_s": 1 / b if b > 0 else None,
        "small_items": len(small), "small_items_median_s": statistics.median(small) if small else None,
        "unqueued_items": len(rest), "unqueued_gap_s": sum(g for _, g in rest) * tt.US, "idle_est_s": idle,
        "busy_est_s": window - out["wait_s"] - idle,
        "item_params": {"min": min(p for p, _, _ in items), "median": statistics.median(p for p, _, _ in items),
                        "max": max(p for p, _, _ in items)},
    })
    holes = tt.gaps(tt.union((e.start, e.end) for e in main), t0, fwd_end)
    out["forward_main_outside_ops"] = {f"{lo}-{hi} us": [len(s), sum(s) * tt.US] for lo, hi in
                                       ((0, 100), (100, 1000), (1000, float("inf")))
                                       for s in ([y - x for x, y in holes if lo <= y - x < hi],)}
    starts = [e.start for e in ag]
    acc = [e for e in ag if e.name == "torch::autograd::AccumulateGrad"]
    bare = 0.0
    for sp in acc:
        kids, end = [], -1.0
        for e in tt.inside(ag, starts, sp):
            if e.start >= end:
                kids.append(e)
                end = e.end
        bare += (sp.end - sp.start) - tt.covered(tt.union((e.start, e.end) for e in kids), sp.start, sp.end)
    out["accumulate_grad"] = {"calls": len(acc), "s": sum(e.end - e.start for e in acc) * tt.US,
                              "not_covered_s": bare * tt.US}
    return out


def render(s: dict) -> None:
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    print(f"{s['trace']}\n  CPU lane {s['lane']}: {s['events']} events ({s['queries']} cudaEventQuery, "
          f"{s['synchronizes']} cudaEventSynchronize: {', '.join(f'{x * 1e6:.1f} us' for x in s['synchronize_s'])})"
          f" = {s['waits']} waits, {ms(s['wait_s'])} ms in them; {s['items']} items (D2H copies; "
          f"{s['later_pieces']} later pieces of a bucket in ring pieces of {s['ring_piece_bytes']} B)")
    if "note" in s:
        print(f"  {s['note']}")
        return
    ip = s["item_params"]
    print(f"  items of {ip['min']}-{ip['max']} params (median {ip['median']:.0f}), {s['params']:.4g} params; "
          f"forward ends {ms(s['forward_end_s'])}, lane's first wait {ms(s['first_wait_s'])}, last wait ends "
          f"{ms(s['last_wait_end_s'])}, main resumes {ms(s['main_resumes_s'])}")
    print(f"  window {ms(s['window_s'])} ms, {s['params_per_s_window']:.3g} params/s over it; queued items "
          f"{s['queued_items']} ({s['queued_params']:.4g} params): {s['params_per_s_queued']:.3g} params/s; fit over "
          f"them: {s['fit_per_item_s'] * 1e6:.0f} us per item + {s['fit_params_per_s']:.3g} params/s; "
          f"{s['small_items']} small items (< 32 Ki params): median "
          + ("-" if s["small_items_median_s"] is None else f"{s['small_items_median_s'] * 1e6:.0f} us"))
    print(f"  unqueued {s['unqueued_items']}: {ms(s['unqueued_gap_s'])} ms of gaps, idle est {ms(s['idle_est_s'])} "
          f"ms; AdamW busy est {ms(s['busy_est_s'])} ms")
    for k, (cnt, sec) in s["forward_main_outside_ops"].items():
        print(f"  forward, main thread outside recorded ops, gaps {k}: {cnt}, {ms(sec)} ms")
    a = s["accumulate_grad"]
    print(f"  AccumulateGrad: {a['calls']} calls, {ms(a['s'])} ms, of it {ms(a['not_covered_s'])} ms not covered by "
          "a recorded op inside (the grad hooks' Python)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", help="write {path: summary} here")
    args = ap.parse_args(argv)
    out = {}
    for p in args.traces:
        out[p] = read(p)
        render(out[p])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
