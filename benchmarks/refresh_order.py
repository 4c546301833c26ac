"""Does step()'s refresh order matter on the runtime? (session 23, [Note: the refresh pipelined] in
offload/runtime/executor.py) ONE engine, all resident (8 x Linear(W), CPU backend, copies throttled to BW), step()'s
refresh order switched every 4 steps between the new order and the order before; the step time of the last 3 of each
block (a step's forward waits for the refreshes the previous step() issued). Beside it the model's prediction of
both orders for that plan and the compute it was planned from (Python reference). The planner is given a link 10x
slower than the throttled one so that it keeps the layers resident; the predictions use the real one.

Session 24 ([Note: the refresh order when the lane is behind] in offload/planning/refresh_candidates.py):
``--candidate``: "new" is that candidate order (not adopted; the plan's costs on the planning hardware model),
"before" ``steady.issue_order`` (session 23's rule, the runtime's). ``--lane-delay MS`` sleeps before each
CPU-lane item (the lane behind backward by two or more updates at step(), each copy still longer than its
update: the weak case); the planner and the predictions see the slower AdamW as a lower params/s (one lane item
a layer; the runtime runs two: weight and bias). ``issued``: each block's last step() order, by layer.

    python benchmarks/refresh_order.py --json benchmarks/results/cpu-2026-11-28/refresh_order_s23_1.json
    python benchmarks/refresh_order.py --candidate --lane-delay 1.3 \
        --json benchmarks/results/cpu-2026-11-28/refresh_order_s24_weak_1.json
"""
import argparse
import json
import os
import statistics
import time
from unittest import mock
import torch
from torch import nn
import offload, offload.api
import offload.runtime.executor as ex
from offload.backend.cpu import CPUBackend
from offload.planning import refresh_candidates, steady
from offload.planning.hw import HardwareModel, latency_curve
from offload.planning.schedule import program_of
from offload.planning.simulate import simulate_reference
from offload.tools.probe import cpu_adam_params_per_s
from rich.console import Console
from rich.table import Table

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--json")
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--bandwidth", type=float, default=1e9, help="throttled link, bytes/s")
ap.add_argument("--blocks", type=int, default=8, help="blocks of 4 steps per order")
ap.add_argument("--lane-delay", type=float, default=0.0, help="ms slept before each CPU-lane item")
ap.add_argument("--candidate", action="store_true", help="new: session 24's candidate against issue_order")
args = ap.parse_args()

W, BATCH, BW, BLOCKS = args.width, args.batch, args.bandwidth, args.blocks
DEPTH = 8
torch.set_num_threads(1)
new_order = steady.issue_order

def old_order(lane, ended, key):
    """The order before session 23: the ended ones in first-use order, then the others in the lane's."""
    flags = [ended(x) for x in lane]
    return sorted((x for x, f in zip(lane, flags) if f), key=key) + [x for x, f in zip(lane, flags) if not f]

def candidate_runtime(lane, ended, key, cache={}):
    """Session 24's candidate in the runtime: the costs of the plan it executes, on the planning model."""
    plan = engine._runtime.executor.train_plan
    if cache.get("plan") is not plan:
        cache.update(plan=plan, order=refresh_candidates.in_the_runtime(plan, plan_hw))
    return cache["order"](lane, ended, key)

if args.candidate:
    new_order, old_order = candidate_runtime, steady.issue_order

DELAY = args.lane_delay / 1e3
adam = cpu_adam_params_per_s()
if DELAY:  # the AdamW of one layer, with the sleep: the model sees a slower lane
    adam = (W * W + W) / ((W * W + W) / adam + DELAY)
curve, slow = latency_curve(BW, 0.0), latency_curve(BW / 10, 0.0)
hw = HardwareModel("cpu backend, throttled", curve, curve, duplex_factor=1.0, adam_params_per_s=adam,
                   host_bytes_per_s=1e10, device_flops_per_s=1e11, device_bytes_per_s=1e10, measured=True)
plan_hw = hw.with_(name="planning: a link 10x slower (keeps every layer resident)", h2d=slow, d2h=slow)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(W, W) for _ in range(DEPTH)])
opt = offload.AdamW(model.parameters(), lr=1e-4)
pbytes = DEPTH * (W * W + W) * 4
with mock.patch.object(offload.api, "make_backend", lambda device: CPUBackend(BW, BW)):
    engine = offload.wrap(model, opt, budget=4 * pbytes, device="cpu", bucket_bytes=W * W * 4 + W * 4, hw=plan_hw)
x = torch.randn(BATCH, W, generator=torch.Generator().manual_seed(1))
if DELAY:
    engine._runtime.ctx.cpu._before = lambda: time.sleep(DELAY)  # read when the lane's thread starts: now
times, issued, in_step = {"new": [], "before": []}, {"new": [], "before": []}, {"new": [], "before": []}
load0 = os.getloadavg()[0]
for blk in range(2 * BLOCKS + 1):
    name = "new" if blk % 2 else "before"
    with mock.patch.object(ex, "issue_order", new_order if name == "new" else old_order):
        for i in range(4):
            t0 = time.perf_counter()
            engine(x).pow(2).mean().backward()
            t1 = time.perf_counter()
            opt.step(); opt.zero_grad()
            if blk and i:  # block 0 warms up; the first step of a block waits for the other order's refreshes
                times[name].append(time.perf_counter() - t0)
                in_step[name].append(time.perf_counter() - t1)
        if blk:
            entries = engine._runtime.ctx.lane_log.last_step[2]
            issued[name].append([b for lane, b, _, _, _ in entries if lane == "h2d"])
rt = engine._runtime
plan, trace = rt.executor.train_plan, rt.executor.trace
pred = {}
pipelined = program_of(plan, trace.compute_seconds, refresh_pipelined=True)
for name, order in (("new", new_order), ("before", old_order)):
    if order is candidate_runtime:
        order = refresh_candidates.in_the_model(pipelined, hw)
    with mock.patch.object(steady, "issue_order", order):
        pred[name] = simulate_reference(pipelined, hw).step_s
drained = program_of(plan, trace.compute_seconds, refresh_pipelined=False)
pred["after the drain"] = simulate_reference(drained, hw).step_s
engine.close()
out = {"width": W, "batch": BATCH, "bandwidth": BW, "adam_params_per_s": adam, "resident": sorted(plan.resident),
       "buckets": len(plan.buckets), "copy_ms": W * W * 4 / BW * 1e3, "adam_ms": (W * W + W) / adam * 1e3,
       "compute_ms": sum(trace.compute_seconds) * 1e3, "load_before": load0, "load_after": os.getloadavg()[0],
       "measured_median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
       "measured_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}, "lane_delay_ms": args.lane_delay,
       "orders": {"new": "session 24's candidate (refresh_candidates)", "before": "steady.issue_order"}
       if args.candidate else {"new": "steady.issue_order", "before": "the order before session 23"},
       "issued": issued, "step_call_median_ms": {k: statistics.median(v) * 1e3 for k, v in in_step.items()},
       "predicted_ms": {k: v * 1e3 for k, v in pred.items()}}
table = Table(title=f"all resident ({len(plan.resident)} of {len(plan.buckets)} layers), link {BW / 1e9:.1f} GB/s: "
              f"copy {out['copy_ms']:.2f} ms, AdamW {out['adam_ms']:.2f} ms a layer (lane delay "
              f"{args.lane_delay} ms included); load {load0:.1f}")
for col in ("step() order", "measured median ms (MEASURED)", "of it in step()", "steps", "predicted ms (model)"):
    table.add_column(col, justify="right")
for k in ("new", "before"):
    table.add_row(k, f"{out['measured_median_ms'][k]:.1f}", f"{out['step_call_median_ms'][k]:.1f}", str(len(times[k])),
                  f"{out['predicted_ms'][k]:.1f}")
table.add_row("after the drain", "-", "-", "-", f"{out['predicted_ms']['after the drain']:.1f}")
Console().print(table)
for k in ("new", "before"):
    print(k, "issued (last step of each block, distinct):", list(dict.fromkeys(map(tuple, issued[k]))))
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
