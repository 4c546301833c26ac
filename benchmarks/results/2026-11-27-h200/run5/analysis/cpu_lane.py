"""What the run-5 analysis reads from a trace beside ``benchmarks/trace_timeline.py``'s output: the sizes of the CPU
lane's items (the D2H copies' parameters), the forward's main-thread time outside recorded ops by gap size, and
``AccumulateGrad``'s time not covered by a recorded op inside it (the grad hooks' Python), as
``analysis/lane_splits.py`` prints the last two for the run-2/3 traces. Read from the trace only.

This file first read the CPU lane itself, which the tool as of 287f0af did not find in traces made since c9adf4c;
the tool reads it now ([Note: reading the CPU lane from its waits] in trace_timeline.py), with the same figures
(``bench/profiles/gpt2-xl-8GiB-offload.timeline.txt``, ``.json``).

    python3 benchmarks/results/2026-11-27-h200/run5/analysis/cpu_lane.py TRACE.json.gz [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/
import trace_timeline as tt  # noqa: E402


def read(path: str, grad_bytes_per_param: int = 2) -> dict:
    lanes = tt.lanes_of(tt.load(path))
    rs = tt.roles(lanes)
    t0 = min(evs[0].start for evs in lanes.values())
    copies = [e for k, es in lanes.items() if rs[k] in ("d2h", "compute", "h2d") for e in es
              if e.cat == "gpu_memcpy" and "DtoH" in e.name]  # the lane's items, as the tool counts them
    ag = lanes[tt.lane_with_role(rs, "autograd")]
    main = lanes[tt.lane_with_role(rs, "main")]
    params = [c.bytes // grad_bytes_per_param for c in copies]
    fwd_end = min(e.start for e in ag if e.name.startswith(tt.BACKWARD_OP))
    out: dict = {"trace": path, "items": len(copies), "forward_end_s": (fwd_end - t0) * tt.US,
                 "item_params": {"min": min(params), "median": statistics.median(params), "max": max(params)}}
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
    ip = s["item_params"]
    print(f"{s['trace']}\n  {s['items']} CPU lane items (D2H copies) of {ip['min']}-{ip['max']} params (median "
          f"{ip['median']:.0f}); forward ends {ms(s['forward_end_s'])}")
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
