"""Fused CPU AdamW (cpp/cpu_adam) against the torch path doing the same work, DeepSpeed's CPU Adam when it
is installed, and the host memory bandwidth bound for the bytes the update touches.

The same work, per parameter: read the fp32 master, the grad (bf16 by default), Adam m and v; write the
master, m, v and a bf16 copy of the new master. Bytes touched per parameter: 4+2+4+4 read, 4+4+4+2 written
= 28 with bf16 grads (32 with fp32 grads).

    (a) offload    offload.host.cpu_adam.adamw_step(..., lowp_out=bf16 copy): one pass
    (b) torch      grad bf16 -> fp32 copy, torch.optim.AdamW(fused=True).step(), master -> bf16 copy
    (c) deepspeed  grad bf16 -> fp32 copy, deepspeed.ops.adam.DeepSpeedCPUAdam.step() (JIT-built), master ->
                   bf16 copy, when deepspeed is installed
    (d) bound      the same loads and stores as (a), same loop and threads, with no arithmetic
                   (offload._C.adamw_memory_traffic): the best this access pattern does on this machine.
                   torch's add_/copy_/sum bandwidths are recorded alongside for context

Implementations are timed interleaved (a, b, c, d, a, b, c, d, ...) so that load from other processes hits
them alike; each case reports the median and the minimum, and the ratios of both.

    python benchmarks/cpu_adam.py --json benchmarks/results/cpu-<date>/cpu_adam.json

Goals (issue 6): (a) >= 1.8x faster than (b), >= 1.6x faster than (c), and >= 90 % of the bound.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from common import describe, machine, median, print_table, write_json  # noqa: E402
from offload.host.cpu_adam import adamw_step, kernel_info  # noqa: E402
from rich.console import Console  # noqa: E402

from offload import _C  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bytes_per_param(grad_dtype: torch.dtype) -> int:
    return 4 + grad_dtype.itemsize + 4 + 4 + 4 + 4 + 4 + 2


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMBG")) * scale)


class Offload:
    name = "offload"

    def __init__(self, n: int, grad: torch.Tensor):
        self.p, self.m, self.v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        self.grad, self.lowp, self.step_count = grad, torch.empty(n, dtype=torch.bfloat16), 0

    def step(self) -> None:
        self.step_count += 1
        adamw_step(self.p, self.grad, self.m, self.v, step=self.step_count, lowp_out=self.lowp, **HP)


class Torch:
    name = "torch"

    def __init__(self, n: int, grad: torch.Tensor):
        self.p = torch.nn.Parameter(torch.randn(n))
        self.p.grad = torch.zeros(n)
        self.opt = torch.optim.AdamW([self.p], fused=True, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                     eps=HP["eps"], weight_decay=HP["weight_decay"])
        self.grad, self.lowp = grad, torch.empty(n, dtype=torch.bfloat16)

    @torch.no_grad()
    def step(self) -> None:
        self.p.grad.copy_(self.grad)  # bf16 -> fp32
        self.opt.step()
        self.lowp.copy_(self.p)  # fp32 -> bf16 for the next host-to-device copy


class DeepSpeed:
    name = "deepspeed"

    def __init__(self, n: int, grad: torch.Tensor):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        self.p = torch.nn.Parameter(torch.randn(n))
        self.p.grad = torch.zeros(n)
        self.opt = DeepSpeedCPUAdam([self.p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                    weight_decay=HP["weight_decay"], adamw_mode=True)
        self.grad, self.lowp = grad, torch.empty(n, dtype=torch.bfloat16)

    @torch.no_grad()
    def step(self) -> None:
        # DeepSpeed's step takes fp32 grads (ZeRO-Offload converts into an fp32 buffer too), and since
        # 0.1x no longer writes the low-precision copy itself (fp16_param_groups is gone): torch does both.
        self.p.grad.copy_(self.grad)
        self.opt.step()
        self.lowp.copy_(self.p)


def deepspeed_status() -> str | None:
    """None when DeepSpeedCPUAdam can be built here, else why not."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    except Exception as e:  # ImportError, or its op builder failing
        return f"deepspeed is not installed or its CPU Adam does not import ({type(e).__name__}: {e})"
    return None


def deepspeed_version() -> str | None:
    try:
        import deepspeed

        return deepspeed.__version__
    except Exception:
        return None


def bandwidth_gbps(nbytes: int, repeats: int) -> dict[str, float]:
    """Host memory bandwidth with torch's own multithreaded kernels over ``nbytes`` of data, GB/s counting
    the bytes each one reads and writes (no write-allocate traffic counted)."""
    n = nbytes // 4
    a, b = torch.ones(n), torch.ones(n)
    out = {}
    tests = {"add_ (read 2, write 1)": (lambda: a.add_(b), 12), "copy_ (read 1, write 1)": (lambda: a.copy_(b), 8),
             "sum (read 1)": (lambda: a.sum(), 4)}
    for name, (fn, per) in tests.items():
        fn()
        best = min(_seconds(fn) for _ in range(repeats))
        out[name] = per * n / best / 1e9
    return out


class Traffic(Offload):
    """(d): adamw_step's loads and stores on its own buffers, without the arithmetic (it garbles them)."""

    name = "bound"

    def step(self) -> None:
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.grad.dtype]
        _C.adamw_memory_traffic(self.p.data_ptr(), self.m.data_ptr(), self.v.data_ptr(), self.grad.data_ptr(),
                                dtype, self.lowp.data_ptr(), self.p.numel(), torch.get_num_threads())


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--params", default="50M,200M", help="comma-separated parameter counts")
    ap.add_argument("--grad-dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=150)
    info = machine()
    info["cpu_adam"] = kernel_info()
    info["deepspeed"] = deepspeed_version()
    describe(console, info)
    grad_dtype = DTYPES[args.grad_dtype]
    per_param = bytes_per_param(grad_dtype)
    ds_reason = deepspeed_status()

    cases, rows = [], []
    for n in (parse_count(x) for x in args.params.split(",")):
        need = n * (4 * 3 + 2 + 2) * 4 + n * (4 + grad_dtype.itemsize) + n * 8  # 4 impls + grads + bandwidth
        if need * 1.2 > psutil.virtual_memory().available:
            reason = f"needs ~{need / 2**30:.1f} GiB, {psutil.virtual_memory().available / 2**30:.1f} GiB available"
            for impl in ("offload", "torch", "deepspeed"):
                cases.append({"params": n, "grad_dtype": args.grad_dtype, "impl": impl, "ms": None, "gbps": None,
                              "bound_ms": None, "status": "not run", "reason": reason})
            continue
        bw = bandwidth_gbps(n * per_param // 3, repeats=3)  # a third of the optimizer's bytes, in two arrays
        grad = torch.randn(n).to(grad_dtype)
        impls = [Offload(n, grad), Torch(n, grad)]
        if ds_reason is None:
            impls.append(DeepSpeed(n, grad))
        impls.append(Traffic(n, grad))
        for impl in impls:
            impl.step()  # warm-up: first touch of state, thread pools
        times = {impl.name: [] for impl in impls}
        for _ in range(args.repeats):
            for impl in impls:
                t0 = time.perf_counter()
                impl.step()
                times[impl.name].append((time.perf_counter() - t0) * 1e3)
        load = list(os.getloadavg())
        traffic_ms = times.pop("bound")
        impls.pop()
        bound_ms, bound_min_ms = median(traffic_ms), min(traffic_ms)
        torch_ms, torch_min = median(times["torch"]), min(times["torch"])
        for impl in impls:
            ms, min_ms = median(times[impl.name]), min(times[impl.name])
            cases.append({"params": n, "grad_dtype": args.grad_dtype, "impl": impl.name, "ms": round(ms, 2),
                          "gbps": round(n * per_param / ms / 1e6, 2), "bound_ms": round(bound_ms, 2),
                          "status": "ok", "min_ms": round(min_ms, 2), "bound_min_ms": round(bound_min_ms, 2),
                          "times_ms": [round(t, 2) for t in times[impl.name]],
                          "bound_times_ms": [round(t, 2) for t in traffic_ms],
                          "speedup_vs_torch": round(torch_ms / ms, 3), "pct_of_bound": round(100 * bound_ms / ms, 1),
                          "speedup_vs_torch_min": round(torch_min / min_ms, 3),
                          "pct_of_bound_min": round(100 * bound_min_ms / min_ms, 1),
                          "bound_gbps": round(n * per_param / bound_ms / 1e6, 2),
                          "torch_stream_gbps": {k: round(v, 2) for k, v in bw.items()}, "load_average": load})
            rows.append([f"{n / 1e6:.0f}M", args.grad_dtype, impl.name, f"{ms:.1f}", f"{min_ms:.1f}",
                         f"{n * per_param / ms / 1e6:.1f}", f"{bound_ms:.1f} / {bound_min_ms:.1f}",
                         f"{100 * bound_ms / ms:.0f} % / {100 * bound_min_ms / min_ms:.0f} %",
                         f"{torch_ms / ms:.2f}x / {torch_min / min_ms:.2f}x"])
        if ds_reason is not None:
            cases.append({"params": n, "grad_dtype": args.grad_dtype, "impl": "deepspeed", "ms": None, "gbps": None,
                          "bound_ms": round(bound_ms, 2), "status": "not run", "reason": ds_reason})
            rows.append([f"{n / 1e6:.0f}M", args.grad_dtype, "deepspeed", "not run", "", "", "", "", ""])
        del impls, grad
        gc.collect()

    print_table(f"CPU AdamW, {per_param} bytes/param, {torch.get_num_threads()} threads",
                ["params", "grad", "impl", "median ms", "min ms", "GB/s (median)", "bound ms median / min",
                 "% of bound median / min", "vs torch median / min"],
                rows, console)
    if ds_reason:
        console.print(f"deepspeed: not run: {ds_reason}")
    ok = [c for c in cases if c["status"] == "ok" and c["impl"] == "offload"]
    goals = {
        "speedup_vs_torch_goal": 1.8, "pct_of_bound_goal": 90.0, "speedup_vs_deepspeed_goal": 1.6,
        "speedup_vs_torch": {str(c["params"]): c["speedup_vs_torch"] for c in ok},
        "pct_of_bound": {str(c["params"]): c["pct_of_bound"] for c in ok},
        "speedup_vs_torch_met": all(c["speedup_vs_torch"] >= 1.8 for c in ok) if ok else None,
        "pct_of_bound_met": all(c["pct_of_bound"] >= 90 for c in ok) if ok else None,
    }
    ds = {c["params"]: c for c in cases if c["impl"] == "deepspeed" and c["status"] == "ok"}
    for c in ok:
        vs_ds = ""
        if c["params"] in ds:
            r = ds[c["params"]]["ms"] / c["ms"]
            c["speedup_vs_deepspeed"] = round(r, 3)
            vs_ds = f", {r:.2f}x deepspeed (goal 1.6x: {'met' if r >= 1.6 else 'MISSED'})"
        console.print(f"{c['params'] / 1e6:.0f}M (medians): {c['speedup_vs_torch']:.2f}x torch (goal 1.8x: "
                      f"{'met' if c['speedup_vs_torch'] >= 1.8 else 'MISSED'}){vs_ds}, {c['pct_of_bound']:.1f} % of "
                      f"the bandwidth bound (goal 90 %: {'met' if c['pct_of_bound'] >= 90 else 'MISSED'})")
    goals["speedup_vs_deepspeed"] = {str(c["params"]): c.get("speedup_vs_deepspeed") for c in ok}
    goals["speedup_vs_deepspeed_met"] = (all(c.get("speedup_vs_deepspeed", 0) >= 1.6 for c in ok)
                                         if ok and not ds_reason else None)
    write_json(args.json, {
        "benchmark": "cpu_adam", "machine": info, "load_average_after": machine()["load_average"],
        "settings": {"params": args.params, "grad_dtype": args.grad_dtype, "repeats": args.repeats,
                     "threads": torch.get_num_threads(), "bytes_per_param": per_param, "hparams": HP},
        "goals": goals, "cases": cases,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
