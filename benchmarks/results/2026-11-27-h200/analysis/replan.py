"""Issue 18/17 analysis, question 5: what the planner (offload.planning.schedule.build_plan, the engine's greedy)
chooses and predicts for the run-3 cases on the run-3 probe hardware, with the compute the engine believed
(its calibrated traced compute) and with the compute measured outside the engine (vs_baselines.json's
calibration). SIMULATED: every step time this prints is the cost model's, not a measurement.

The trace is the model's meta-device trace (offload/tools/metatrace.py: the same shapes, batch 1 x 1024, bf16),
its per-event compute distributed as the roofline estimate and scaled so that the step's sum is the given total.
Buckets as the engine made them (bucket_bytes 6629882 from the run's plan), budget 8 GiB less the headroom the
engine measured (69214207 B).

    python benchmarks/results/2026-11-27-h200/analysis/replan.py --json benchmarks/results/2026-11-27-h200/analysis/replan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from offload.planning.buckets import make_buckets  # noqa: E402
from offload.planning.hw import load_hw  # noqa: E402
from offload.planning.placement import placement_bound  # noqa: E402
from offload.planning.schedule import build_plan, least_traffic  # noqa: E402
from offload.planning.simulate import physical_bound  # noqa: E402
from offload.tools.metatrace import trace_meta  # noqa: E402
from offload.tools.presets import preset_inputs  # noqa: E402
from vs_baselines import MODELS  # noqa: E402

RUN3 = HERE.parent / "run3" / "bench"
BUCKET_BYTES = 6629882  # the runs' plan.bucket_bytes (vs_baselines.json)
HEADROOM = 69214207  # the runs' headroom_bytes
BUDGET = 8 << 30
ITEMSIZE = 2
# the saved-activation peak the engine traced on the GPU (plan.activation_bytes in vs_baselines.json): the meta
# trace's estimate (math attention, every intermediate) is far above it (7.67 GiB for gpt2-xl) and fits no plan
ACTIVATIONS = {"gpt3-2.7b": 3247555076, "gpt2-xl": 3053806852}
# the CPU lane's params per busy second in the run-3 traces (analysis/trace_timeline.json: params / busy_est_s),
# per-item cost included: a sensitivity case, the lane priced as it ran rather than at the probe's kernel rate
LANE_RATE = {"gpt3-2.7b": 2651553280 / 0.947910, "gpt2-xl": 1557611200 / 0.507767}
# model -> (compute the engine planned with after calibrate_compute, compute measured outside the engine), s
COMPUTE = {"gpt3-2.7b": (1.091296590059997, 0.054195660000004864), "gpt2-xl": (0.7958330298364166, 0.0905232979999937)}


def placement(plan) -> dict:
    kinds: dict[str, list[int]] = {}
    for b in range(len(plan.buckets)):
        kinds.setdefault(plan.placement_of(b).value, []).append(b)
    return {k: {"buckets": len(v), "bytes": sum(plan.buckets[b].nbytes(ITEMSIZE) for b in v)} for k, v in kinds.items()}


def one(mt, buckets, hw, total: float, device_optimizer: bool) -> dict:
    raw = mt.compute_s(hw)
    compute = tuple(c * total / sum(raw) for c in raw)
    t = time.perf_counter()
    plan = build_plan(mt.trace, buckets, itemsize=ITEMSIZE, budget_bytes=BUDGET, fixed_bytes=mt.buffer_bytes, hw=hw,
                      compute_s=compute, headroom_bytes=HEADROOM, device_optimizer=device_optimizer)
    s = plan.simulated
    cap = BUDGET - HEADROOM - mt.trace.activation_peak_bytes - mt.trace.max_grad_bytes - mt.buffer_bytes
    causal = placement_bound(mt.trace, buckets, ITEMSIZE, cap, total, hw, forward_s=sum(compute[:mt.trace.num_forward]))
    return {"compute_total_s": total, "device_optimizer": device_optimizer, "plan_s": time.perf_counter() - t,
            "strategy": plan.strategy, "placement": placement(plan), "peak_bytes": plan.peak_bytes,
            "predicted_step_s": s.step_s, "sim": {"compute_s": s.compute_s, "device_adam_s": s.device_adam_s,
                                                   "stall_s": s.stall_s, "h2d_bytes": s.h2d_bytes,
                                                   "h2d_busy_s": s.h2d_busy_s, "d2h_busy_s": s.d2h_busy_s,
                                                   "cpu_adam_s": s.adam_s, "tail_s": s.tail_s},
            "bound_placement_causal_s": causal.seconds, "bound_placement_causal_limit": causal.limit,
            "param_capacity_bytes_approx": cap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    hw = load_hw(RUN3 / "probe.json")
    out = {"simulated": "every step time here is the cost model's (SIMULATED), on the run-3 probe's hardware model",
           "hw": hw.name, "budget_bytes": BUDGET, "headroom_bytes": HEADROOM, "bucket_bytes": BUCKET_BYTES,
           "load_avg_1m": os.getloadavg()[0], "cases": []}
    for name, (believed, measured) in COMPUTE.items():
        shape, batch, seq = MODELS[name]
        mt = trace_meta(shape.build(dtype=torch.bfloat16), preset_inputs(shape, batch, seq), hw)
        meta_activations = mt.trace.activation_peak_bytes
        mt = dataclasses.replace(mt, trace=dataclasses.replace(mt.trace, activation_peak_bytes=ACTIVATIONS[name]))
        buckets = make_buckets(list(mt.specs), list(mt.order), BUCKET_BYTES, ITEMSIZE)
        least = least_traffic(mt.trace, buckets, ITEMSIZE, BUDGET)
        bound = physical_bound(measured, least["h2d"], least["d2h"], least["adam_numel"], hw)
        case = {"model": name, "params": mt.numel, "buckets": len(buckets),
                "activation_peak_bytes_meta": meta_activations, "activation_peak_bytes_used": ACTIVATIONS[name],
                "max_grad_bytes": mt.trace.max_grad_bytes, "buffer_bytes": mt.buffer_bytes,
                "bound_all_cpu_s_measured_compute": bound.seconds, "bound_limit": bound.limit, "plans": []}
        lane_hw = dataclasses.replace(hw, name=f"{hw.name}, CPU AdamW at the traced lane's rate",
                                      adam_params_per_s=LANE_RATE[name])
        for total, h in ((believed, hw), (measured, hw), (measured, lane_hw)):
            for dev in (False, True):
                r = one(mt, buckets, h, total, dev)
                r["hw"], r["adam_params_per_s"] = h.name, h.adam_params_per_s
                case["plans"].append(r)
                pl = ", ".join(f"{k} {v['buckets']} ({v['bytes'] / 2**30:.2f} GiB)" for k, v in r["placement"].items())
                print(f"{name} compute {total:.3f} s, CPU AdamW {h.adam_params_per_s:.3g}/s, device_optimizer={dev}: predicted {r['predicted_step_s']:.3f} s "
                      f"[{pl}] sim {json.dumps({k: round(v, 4) for k, v in r['sim'].items()})} causal bound "
                      f"{r['bound_placement_causal_s']:.3f} ({r['bound_placement_causal_limit']})", flush=True)
        out["cases"].append(case)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
