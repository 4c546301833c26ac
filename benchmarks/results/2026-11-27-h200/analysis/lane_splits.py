"""The ad-hoc splits analysis.md cites beside benchmarks/trace_timeline.py's output: the CPU lane's full 4 MiB
items (whose successor was already queued) by how busy the copy engines were and how long the autograd thread
was blocked on the grad ring during each; the main thread's forward time outside recorded ops, by gap size; the
autograd thread's AccumulateGrad time. Read from the traces only.

    python benchmarks/results/2026-11-27-h200/analysis/lane_splits.py TRACE.json.gz ...
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
import trace_timeline as tt  # noqa: E402

FULL = 4 << 20  # bytes of a full grad-ring piece


def blocked_spans(evs):
    """The autograd thread's time inside offload::d2h not covered by a recorded op (waiting for the ring)."""
    starts = [e.start for e in evs]
    out = []
    for sp in (e for e in evs if e.name == "offload::d2h"):
        inner = tt.union((e.start, e.end) for e in tt.inside(evs, starts, sp))
        out += tt.gaps(inner, sp.start, sp.end)
    return tt.union(out)


def by_share(rows, edges, what):
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g, f in rows if lo <= f < hi]
        if sel:
            print(f"  4 MiB items, {what} {lo:.2f}-{min(hi, 1):.2f} of the item: n={len(sel)}, "
                  f"median {statistics.median(sel):.0f} us")


def main(paths) -> None:
    for path in paths:
        lanes = tt.lanes_of(tt.load(path))
        rs = tt.roles(lanes)
        lane, ag, main_ = (lanes[tt.lane_with_role(rs, r)] for r in ("cpu_adam", "autograd", "main"))
        copies = sorted((e for k, es in lanes.items() if rs[k] == "d2h" for e in es if e.cat == "gpu_memcpy"),
                        key=lambda e: e.start)
        dma = tt.union((e.start, e.end) for k, es in lanes.items() if rs[k] in ("h2d", "d2h") for e in es)
        submits = sorted(e.end for e in ag if e.name == "offload::d2h")
        blocked = blocked_spans(ag)
        per = len(lane) // len(copies)
        dma_rows, ag_rows = [], []
        for k in range(len(copies) - 1):
            ready, nxt = lane[per * k + per - 1].end, lane[per * (k + 1)].start
            if submits[k + 1] <= ready and copies[k].bytes == FULL and nxt > ready:
                gap = nxt - ready
                dma_rows.append((gap, tt.covered(dma, ready, nxt) / gap))
                ag_rows.append((gap, tt.covered(blocked, ready, nxt) / gap))
        print(path)
        by_share(dma_rows, (0, 0.1, 0.2, 0.4, 1.01), "copy engines busy")
        by_share(ag_rows, (0, 0.25, 0.5, 0.75, 1.01), "autograd thread blocked on the ring")
        t0 = min(evs[0].start for evs in lanes.values())
        fwd_end = min(e.start for e in ag if e.name.startswith(tt.BACKWARD_OP))
        holes = tt.gaps(tt.union((e.start, e.end) for e in main_), t0, fwd_end)
        for lo, hi in ((0, 100), (100, 1000), (1000, float("inf"))):
            sel = [b - a for a, b in holes if lo <= b - a < hi]
            print(f"  forward, main thread outside recorded ops, gaps {lo}-{hi} us: {len(sel)}, "
                  f"{sum(sel) / 1e3:.1f} ms")
        acc = [e for e in ag if e.name == "torch::autograd::AccumulateGrad"]
        starts = [e.start for e in ag]
        bare = 0.0
        for a in acc:
            kids, end = [], -1.0
            for e in tt.inside(ag, starts, a):
                if e.start >= end:
                    kids.append(e)
                    end = e.end
            bare += (a.end - a.start) - tt.covered(tt.union((e.start, e.end) for e in kids), a.start, a.end)
        print(f"  AccumulateGrad: {len(acc)} calls, {sum(a.end - a.start for a in acc) / 1e3:.1f} ms, of it "
              f"{bare / 1e3:.1f} ms not covered by a recorded op inside (the grad hooks' Python)")


if __name__ == "__main__":
    main(sys.argv[1:])
