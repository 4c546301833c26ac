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

``--contend K`` (issue 18) times (a) alone and with K busy-spinning processes beside it, on 1..N threads,
with the kernel's work split as it is (dynamic chunks) and as it was before issue 18 (one static run per
worker, brought back by the private OFFLOAD_CPU_ADAM_STATIC_SPLIT=1), all cases interleaved call by call in
one process (the spinners pause between contended calls). See [Note: work split under contention] in cpp/cpu_adam.cpp.

    python benchmarks/cpu_adam.py --contend 1 --params 32Mi,4Mi --json .../cpu_adam-contend.json
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import sys
import threading
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
    """``50M`` (10**6), ``32Mi`` (2**20), ``1.5B``, ``4096``."""
    text = text.strip().upper()
    binary = text.endswith("I")
    text = text.rstrip("I")
    scale = ({"K": 2**10, "M": 2**20, "G": 2**30} if binary else
             {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}).get(text[-1], 1)
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


# --- --contend: the kernel's work split beside busy cores (issue 18) ----------------------------------------

SPLITS = {"static": "1", "dynamic": "0"}  # OFFLOAD_CPU_ADAM_STATIC_SPLIT: the split before issue 18, and now


_STOP, _PAUSE, _SPIN = 0, 1, 2


def _spin(state) -> None:
    """A busy core while ``state`` says so: a pure-Python loop in its own process (it holds no lock this
    process needs); paused, it sleeps."""
    x = 0
    while (now := state.value) != _STOP:
        if now == _SPIN:
            x += 1
        else:
            time.sleep(0.0005)


class Spinners:
    """K processes that spin beside the update while switched on, and sleep while paused, so that alone and
    contended calls can be interleaved call by call (load from other processes then hits both alike).
    Processes, not threads: a Python thread spinning in this process does run beside the kernel (it releases
    the GIL), but the caller then waits up to sys.getswitchinterval() (5 ms) for the GIL back after every
    call, which is not the kernel's time (see spinner_check)."""

    def __init__(self, k: int):
        self.state = multiprocessing.Value("i", _PAUSE, lock=False)
        self.procs = [multiprocessing.Process(target=_spin, args=(self.state,), daemon=True) for _ in range(k)]

    def __enter__(self) -> "Spinners":
        for p in self.procs:
            p.start()
        return self

    def spin(self, on: bool) -> None:
        if self.state.value != (_SPIN if on else _PAUSE):
            self.state.value = _SPIN if on else _PAUSE
            time.sleep(0.003)  # a paused spinner wakes within 0.5 ms; a spinning one sees the pause at once

    def __exit__(self, *exc) -> None:
        self.state.value = _STOP
        for p in self.procs:
            p.join()


def spinner_check(impl: Offload, threads: int) -> dict:
    """Whether a pure-Python spinning *thread* runs while the kernel holds no GIL: its loop count advances
    during the call (it could not if the kernel kept the GIL). Also times the call with that thread beside
    at the default switch interval and at 0.1 ms, to show the GIL hand-back after the call."""
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    os.environ["OFFLOAD_CPU_ADAM_STATIC_SPLIT"] = SPLITS["dynamic"]
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    time.sleep(0.05)
    out = {}
    try:
        for interval in (sys.getswitchinterval(), 1e-4):
            old = sys.getswitchinterval()
            sys.setswitchinterval(interval)
            try:
                ms, advanced = [], []
                for _ in range(5):
                    before = count[0]
                    t0 = time.perf_counter()
                    impl.step(threads)
                    ms.append((time.perf_counter() - t0) * 1e3)
                    advanced.append(count[0] - before)
            finally:
                sys.setswitchinterval(old)
            out[f"switch_interval_{interval:g}"] = {"median_ms": round(median(ms), 2),
                                                    "spinner_loops_during_call": advanced}
    finally:
        stop[0] = True
        th.join()
    return out


class Contended(Offload):
    """(a) with an explicit thread count."""

    def step(self, threads: int) -> None:  # type: ignore[override]
        self.step_count += 1
        adamw_step(self.p, self.grad, self.m, self.v, step=self.step_count, lowp_out=self.lowp, num_threads=threads,
                   **HP)


def time_round(impl: Contended, spinners: Spinners, thread_counts: list[int], times: dict, flip: bool) -> None:
    """One call of every case: each thread count, alone and contended, each split (static then dynamic, or
    the other way round when ``flip``: the second of two calls over the same buffers can find some of them
    in cache)."""
    for t in thread_counts:
        for contended in (False, True):
            spinners.spin(contended)
            for name, flag in (reversed(SPLITS.items()) if flip else SPLITS.items()):
                os.environ["OFFLOAD_CPU_ADAM_STATIC_SPLIT"] = flag
                t0 = time.perf_counter()
                impl.step(t)
                times[(t, contended, name)].append((time.perf_counter() - t0) * 1e3)
    spinners.spin(False)
    os.environ.pop("OFFLOAD_CPU_ADAM_STATIC_SPLIT", None)


def contend_main(args, console: Console, info: dict) -> int:
    grad_dtype = DTYPES[args.grad_dtype]
    max_threads = args.threads or os.cpu_count() or 1
    thread_counts = list(range(1, max_threads + 1))
    cases, rows, paired = [], [], []
    for n in (parse_count(x) for x in args.params.split(",")):
        impl = Contended(n, torch.randn(n).to(grad_dtype))
        keys = [(t, c, name) for t in thread_counts for c in (False, True) for name in SPLITS]
        times: dict = {k: [] for k in keys}
        load_before = list(os.getloadavg())
        with Spinners(args.contend) as spinners:
            time_round(impl, spinners, thread_counts, {k: [] for k in keys}, False)  # warm-up: pages, pools
            for r in range(args.repeats):
                time_round(impl, spinners, thread_counts, times, flip=r % 2 == 1)
        load_after = list(os.getloadavg())
        for (t, contended, name), ms in times.items():
            med = median(ms)
            cases.append({"params": n, "grad_dtype": args.grad_dtype, "spinners": args.contend if contended else 0,
                          "threads": t, "split": name, "median_ms": round(med, 3), "min_ms": round(min(ms), 3),
                          "params_per_s": round(n / med * 1e3), "times_ms": [round(x, 3) for x in ms],
                          "load_before": load_before, "load_after": load_after})
        for t in thread_counts:  # paired: the static call over the dynamic call next to it, per round
            for contended in (False, True):
                pairs = [a / b for a, b in zip(times[(t, contended, "static")], times[(t, contended, "dynamic")])]
                paired.append({"params": n, "threads": t, "spinners": args.contend if contended else 0,
                               "median_static_over_dynamic": round(median(pairs), 3)})
        for t in thread_counts:
            got = {(c["spinners"] > 0, c["split"]): c for c in cases if c["params"] == n and c["threads"] == t}
            alone_s, alone_d = got[(False, "static")], got[(False, "dynamic")]
            busy_s, busy_d = got[(True, "static")], got[(True, "dynamic")]
            rows.append([f"{n / 2**20:.0f}Mi", t, f"{alone_s['median_ms']:.1f} / {alone_d['median_ms']:.1f}",
                         f"{busy_s['median_ms']:.1f} / {busy_d['median_ms']:.1f}",
                         f"{alone_s['params_per_s'] / 1e9:.2f} / {alone_d['params_per_s'] / 1e9:.2f}",
                         f"{busy_s['params_per_s'] / 1e9:.2f} / {busy_d['params_per_s'] / 1e9:.2f}",
                         f"{busy_s['median_ms'] / busy_d['median_ms']:.2f}x",
                         *(f"{p['median_static_over_dynamic']:.2f}x" for p in paired
                           if p["params"] == n and p["threads"] == t)])
        check = spinner_check(impl, 1) if n == parse_count(args.params.split(",")[0]) else None
        if check is not None:
            info["spinner_thread_check"] = check
        del impl
        gc.collect()
    print_table(f"CPU AdamW beside {args.contend} busy process(es), {args.grad_dtype} grads + bf16 copy, median of "
                f"{args.repeats}, static (before issue 18) / dynamic (now), all interleaved",
                ["params", "threads", "alone ms", "contended ms", "alone e9/s", "contended e9/s",
                 "contended static/dynamic", "paired alone", "paired contended"], rows, console)
    if "spinner_thread_check" in info:
        console.print(f"a spinning Python thread beside the kernel: {info['spinner_thread_check']}")
    write_json(args.json, {
        "benchmark": "cpu_adam_contend", "machine": info, "load_average_after": machine()["load_average"],
        "settings": {"params": args.params, "grad_dtype": args.grad_dtype, "repeats": args.repeats,
                     "spinners": args.contend, "spinner": "process", "threads": thread_counts,
                     "order": "per round: each thread count, alone then contended, static then dynamic (odd rounds: "
                              "dynamic then static)", "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                     "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
                     "bytes_per_param": bytes_per_param(grad_dtype), "hparams": HP,
                     "splits": {"static": "one run per worker, schedule(static, 1): before issue 18",
                                "dynamic": "chunks handed out dynamically: [Note: work split under contention]"}},
        "cases": cases, "paired": paired,
    })
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--params", default="50M,200M", help="comma-separated parameter counts")
    ap.add_argument("--grad-dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: as is); with --contend, the most threads timed "
                         "(default: the logical CPUs)")
    ap.add_argument("--contend", type=int, default=None, metavar="K",
                    help="time the kernel alone and beside K busy processes, old and new work split, 1..N threads")
    args = ap.parse_args()
    if args.threads and args.contend is None:
        torch.set_num_threads(args.threads)
    console = Console(width=150)
    info = machine()
    info["cpu_adam"] = kernel_info()
    if args.contend is not None:
        describe(console, info)
        return contend_main(args, console, info)
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
