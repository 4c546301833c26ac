"""One training run of one system, in its own process (the child side of ``vs_baselines.py`` and
``max_model.py``; ``bench_runner.py`` starts it and keeps what it reports).

    python benchmarks/bench_systems.py SPEC_JSON RESULT_PATH

``SPEC_JSON`` says which system, model shape, batch, sequence length, device, GPU budget, steps; the
result (a JSON object) goes to ``RESULT_PATH``, whether the run worked or not. The process exists so a
system's OOM, crash or hang cannot take the others with it, and so its peak GPU memory and peak host
RSS are its own.

Every system trains the same model (``offload.tools.presets``-style transformer, random init, synthetic tokens)
with AdamW and bf16 compute over fp32 master weights, and no activation checkpointing for anyone (the
same setting for every system; this engine's ``activation_checkpointing`` stays off):

    offload        this engine: fp32 masters + AdamW state on the host, bf16 buckets streamed, CPU AdamW;
                   it plans with the harness's ``--hw`` (on a GPU machine the ``offload probe`` of that machine)
    offload_devopt this engine with ``device_optimizer=True``: the planner may keep some buckets' fp32 master,
                   m and v on the GPU and update them there (issue 18)
    zero_offload   DeepSpeed ZeRO-2, offload_optimizer to pinned CPU memory (bf16 params on the GPU)
    zero3_offload  DeepSpeed ZeRO-3, offload_param and offload_optimizer to pinned CPU memory
    twinflow       DeepSpeed ZeRO-3 "Twin-Flow" (ZeRO-Offload++): offload_optimizer to pinned CPU memory with
                   ``ratio`` r (spec["twinflow_ratio"]): a fraction r of the optimizer state and its update
                   on the CPU, the rest on the GPU; params on the GPU (no offload_param). DeepSpeed accepts a
                   ratio with ZeRO-3 only. vs_baselines.py sweeps r, as a user tuning it would
    torchao        torchao CPUOffloadOptimizer(AdamW, fused, offload_gradients) over fp32 params + autocast
    torch          plain PyTorch: fp32 params, torch.optim.AdamW(fused=True), autocast bf16
    gemini         ColossalAI Gemini (placement "auto", bf16, HybridAdam) -- written from ColossalAI's
                   documented API and never run (it cannot be installed beside torch >= 2.6)
    compute        not a system: forward + backward only, bf16 weights resident, under autocast as this
                   engine computes, no optimizer, no budget cap; the measured compute part of this engine's
                   physical bound

On CUDA the GPU budget is enforced for every system (this engine included) with
``torch.cuda.set_per_process_memory_fraction(budget / total)``, set before anything is allocated, so the cap
covers everything the process allocates through PyTorch: cuBLAS workspaces, inputs, temporaries. This engine
is also given it as its own ``budget``, and its plan keeps the runtime headroom it measures (cuBLAS
workspaces, allocator rounding: ``details.headroom_bytes``) out of it, so what the plan reserves is what the
cap allows. On the CPU nothing enforces a budget (``budget_enforced: false`` in the result).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for `offload`

from offload.tools.presets import Shape, Transformer  # noqa: E402

SYSTEMS = ("offload", "offload_devopt", "zero_offload", "zero3_offload", "twinflow", "torchao", "torch", "gemini")
OURS = ("offload", "offload_devopt")
PACKAGE = {"zero_offload": "deepspeed", "zero3_offload": "deepspeed", "twinflow": "deepspeed", "torchao": "torchao",
           "gemini": "colossalai"}
DEEPSPEED = ("zero_offload", "zero3_offload", "twinflow")
RESIDENT_BYTES_PER_PARAM = {"torch": 16, "torchao": 4, "zero_offload": 2}
"""Bytes per parameter a system must keep on the GPU whatever else it does (fp32 params + grads + AdamW m, v
for plain torch; fp32 params for torchao; bf16 params for ZeRO-2): a run whose params alone exceed the budget
cannot fit, so the harness records it as skipped instead of spending GPU time on a certain OOM. Twin-Flow:
:func:`resident_bytes_per_param`."""
INIT_STD = 0.02


def resident_bytes_per_param(system: str, ratio: float | None = None) -> float | None:
    """Bytes per parameter ``system`` keeps on the GPU at least (None: nothing certain, it streams).
    Twin-Flow at ``ratio``: bf16 params (2) and the fp32 master, m and v (12) of the GPU's share 1 - r (its
    grads and buffers come on top)."""
    if system == "twinflow" and ratio is not None:
        return 2 + (1 - ratio) * 12
    return RESIDENT_BYTES_PER_PARAM.get(system)


class NotRunnable(Exception):
    """The system cannot run in this setting (a missing package, a device it does not support)."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status


# ---------------------------------------------------------------------------------------------------------
# the model, the batch, the budget


def shape_of(spec: dict) -> Shape:
    return Shape(**spec["shape"])


def retie(model: Transformer) -> None:
    """``to_empty`` gives tied parameters separate storage; tie them again."""
    if model.cfg.tied:
        model.lm_head.weight = model.wte.weight


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, gen_device: torch.device) -> None:
    """Random init, fast for billions of parameters: matrices N(0, 0.02) generated on ``gen_device`` (the
    GPU when there is one) in chunks and copied in, norm weights 1, biases 0."""
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters come once
        if p.dim() >= 2:
            flat = p.view(-1)
            for s in range(0, flat.numel(), 1 << 25):
                chunk = flat[s:s + (1 << 25)]
                chunk.copy_(torch.randn(chunk.numel(), generator=g, device=gen_device).mul_(INIT_STD))
        elif name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def build_model(spec: dict, device: torch.device, dtype: torch.dtype) -> Transformer:
    model = shape_of(spec).build("meta", dtype)
    model.to_empty(device=device)
    retie(model)
    gen = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    init_weights(model, spec["seed"], gen)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def tokens(spec: dict, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    idx = torch.randint(0, spec["shape"]["vocab"], (spec["batch"], spec["seq"]), generator=g)
    return idx.to(device)


def apply_budget(spec: dict, device: torch.device) -> bool:
    """Cap this process's CUDA allocator at the budget (what this engine's plan reserves, its measured
    headroom included); True when a cap is in force. Called before any allocation."""
    if device.type != "cuda" or not spec.get("budget_bytes") or not spec.get("cap", True):
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    if spec["budget_bytes"] >= total:
        raise NotRunnable("skipped", f"budget {spec['budget_bytes']} B is not below the GPU's {total} B")
    torch.cuda.set_per_process_memory_fraction(spec["budget_bytes"] / total, device)
    return True


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """torch.distributed for one process, as DeepSpeed and ColossalAI expect (no launcher)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


GEMINI_TORCH = "torch>=2.2.0,<=2.5.1"  # colossalai 0.5.0's requirements.txt (its newest release, checked)


def precheck(spec: dict) -> tuple[str, str] | None:
    """(status, reason) when ``spec`` certainly cannot run here, found without starting it; else None."""
    system, device = spec["system"], torch.device(spec["device"])
    package = PACKAGE.get(system)
    if package and importlib.util.find_spec(package) is None:
        reason = f"{package} is not installed in this Python ({sys.executable})"
        if system == "gemini":
            reason += (f"; ColossalAI needs {GEMINI_TORCH} and cannot be installed beside torch "
                       f"{torch.__version__}")
        return "not_installed", reason
    if system in DEEPSPEED and device.type != "cuda" and not spec.get("cpu_deepspeed"):
        return "not_runnable", ("the DeepSpeed baselines run on CUDA only in this harness (on a CPU device "
                                "DeepSpeed JIT-builds its CPU Adam first, minutes); --cpu-deepspeed tries anyway")
    if system == "gemini" and device.type != "cuda":
        return "not_runnable", "ColossalAI Gemini needs CUDA"
    return None


def need(package: str):
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise NotRunnable("not_installed", f"{package} is not installed here ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------------------------------------------------
# the systems: each returns (one training step, params, details filled after the run)


Step = Callable[[], None]


def sys_offload(spec, device, idx):
    import offload
    from offload.config import parse_bytes

    model = build_model(spec, torch.device("cpu"), torch.float32)  # the engine takes the fp32 model on the host
    opt = offload.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01)
    kw = {"bucket_bytes": parse_bytes(spec["bucket_bytes"])} if spec.get("bucket_bytes") else {}
    if spec.get("hw"):  # plan for the machine: its probe on a GPU machine (what a user is told to do)
        kw["hw"] = spec["hw"]
    engine = offload.wrap(model, opt, budget=spec["budget_bytes"], dtype=torch.bfloat16, device=device,
                          device_optimizer=spec["system"] == "offload_devopt", **kw)

    def step():
        engine.backward(engine(idx))
        engine.step()
        engine.zero_grad()

    def details():
        from offload.planning.schedule import least_traffic

        stats = engine.memory_stats()
        plan = engine._runtime.executor.plan  # not public API: the plan the runtime executes
        out = {k: stats[k] for k in ("budget_bytes", "device_peak_bytes", "device_peak_accounted_bytes",
                                     "arena_bytes", "host_pinned_bytes", "counters")}
        out["headroom_bytes"] = stats["device_parts"]["headroom"]  # measured on CUDA, kept out of the plan
        out["transient_bytes"] = stats["transient_bytes"]  # the part of it learnt from the allocator
        out["plan"] = stats["plan"]
        if plan is not None:
            t = plan.trace
            out["least_traffic"] = least_traffic(t, plan.buckets, plan.itemsize, plan.capacity_bytes)
            # The simulator's step for this plan: as planned (with --hw's figures, and the compute times of
            # compute_clock), and re-simulated with --hw's (the same model: kept for older result files).
            out["predicted_step_s"] = plan.simulated.step_s if plan.simulated is not None else None
            out["planned_with_hw"] = plan.hw_name
            if spec.get("hw"):
                from offload.planning.hw import load_hw
                from offload.planning.schedule import simulate_plan

                out["predicted_step_s_hw"] = simulate_plan(plan, load_hw(spec["hw"])).step_s
            out["traced_compute_s"] = sum(t.compute_seconds)  # the plan's compute: see compute_clock
            # "host": the first, traced step's host times; "backend": a step timed on the compute stream
            # (calibrate_compute, on for CUDA: [Note: timing compute] in offload/runtime/executor.py)
            out["compute_clock"] = t.clock
        out["compute_timing"] = stats["compute_timing"]
        out["device_optimizer"] = stats["device_optimizer"]  # issue 18: bytes per placement, the kernel used
        return out

    return step, count_params(model), details, engine.close


def sys_torch(spec, device, idx):
    model = build_model(spec, device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01, fused=True)

    def step():
        with autocast(device):
            loss = model(idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, count_params(model), dict, None


def sys_torchao(spec, device, idx):
    torchao = need("torchao")
    from torchao.optim import CPUOffloadOptimizer

    model = build_model(spec, device, torch.float32)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=spec["lr"],
                              weight_decay=0.01, fused=True)

    def step():
        with autocast(device):
            loss = model(idx)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, count_params(model), lambda: {"torchao": torchao.__version__}, None


def deepspeed_config(spec: dict, device: torch.device, stage: int, ratio: float | None = None) -> dict:
    """ZeRO-``stage`` with the optimizer offloaded; ZeRO-3 also offloads params, except with a Twin-Flow
    ``ratio`` (the fraction of the optimizer offloaded; the rest stays on the GPU with the params)."""
    pin = device.type == "cuda"
    # Buckets of 2e8 elements (400 MB in bf16) rather than DeepSpeed's default 5e8 (1 GB each), so its fixed
    # buffers take less of an 8 GiB budget. Everything else is DeepSpeed's default.
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": pin},
            "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": int(2e8),
            "allgather_bucket_size": int(2e8)}
    if ratio is not None:
        if stage != 3 or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"a Twin-Flow ratio is a fraction in [0, 1], with ZeRO-3 only; got {ratio} at "
                             f"stage {stage}")
        zero["offload_optimizer"]["ratio"] = ratio
        # DeepSpeed applies the ratio per optimizer sub-group (the first int((1 - r) x groups) stay on the GPU);
        # its default sub_group_size of 1e9 elements leaves gpt2-xl two groups, so most ratios would change
        # nothing. 1e7 elements: ~1 % steps for a model of 1B+ parameters.
        zero["sub_group_size"] = int(1e7)
    elif stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def sys_deepspeed(spec, device, idx, stage: int, ratio: float | None = None):
    deepspeed = need("deepspeed")
    single_process_env()
    cfg = deepspeed_config(spec, device, stage, ratio)
    if stage == 3:  # partition at construction, so the full model never sits on the GPU (unless Twin-Flow's)
        remote = "cpu" if ratio is None else None  # None: the partitions live on the GPU
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=remote, pin_memory=device.type == "cuda",
                                 dtype=torch.bfloat16):
            model = Transformer(shape_of(spec))
    else:
        model = build_model(spec, torch.device("cpu"), torch.bfloat16)
    params = count_params(model) if stage != 3 else sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step():
        loss = engine(idx)
        engine.backward(loss)
        engine.step()

    return step, params, lambda: {"deepspeed": deepspeed.__version__, "config": cfg}, None


def sys_gemini(spec, device, idx):
    # Written from ColossalAI's documented Booster/GeminiPlugin API; never run (see the module docstring).
    colossalai = need("colossalai")
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.nn.optimizer import HybridAdam

    single_process_env()
    colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=int(os.environ["MASTER_PORT"]))
    model = build_model(spec, torch.device("cpu"), torch.float32)
    params = count_params(model)
    booster = Booster(plugin=GeminiPlugin(placement_policy="auto", precision="bf16"))
    model, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=spec["lr"], weight_decay=0.01))

    def step():
        loss = model(idx)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()

    return step, params, lambda: {"colossalai": colossalai.__version__}, None


def sys_compute(spec, device, idx):
    """Forward + backward with bf16 weights resident: the GPU work any system's step contains."""
    model = build_model(spec, device, torch.bfloat16)

    def step():
        with autocast(device):  # as this engine computes: bf16 weights under autocast
            loss = model(idx)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step, count_params(model), dict, None


RUNNERS = {
    "offload": sys_offload, "offload_devopt": sys_offload, "torch": sys_torch, "torchao": sys_torchao,
    "gemini": sys_gemini,
    "zero_offload": lambda s, d, i: sys_deepspeed(s, d, i, stage=2),
    "zero3_offload": lambda s, d, i: sys_deepspeed(s, d, i, stage=3),
    "twinflow": lambda s, d, i: sys_deepspeed(s, d, i, stage=3, ratio=s["twinflow_ratio"]),
    "compute": sys_compute,
}


# ---------------------------------------------------------------------------------------------------------
# the run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step: Step, device: torch.device, path: Path) -> str:
    """A torch.profiler trace of one more step (after the timed ones, so it does not perturb them)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))  # a .gz suffix compresses
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    Path(str(path).replace(".json.gz", ".txt")).write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    return str(path)


def classify(e: BaseException) -> str:
    from offload.errors import BudgetTooSmallError, HostMemoryError

    if isinstance(e, NotRunnable):
        return e.status
    if isinstance(e, BudgetTooSmallError):
        return "budget_too_small"
    if isinstance(e, HostMemoryError):
        return "host_oom"
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "oom"
    return "error"


def run(spec: dict) -> dict:
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:  # set_per_process_memory_fraction wants one (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    out: dict = {"status": "error", "ok": False, "error": None, "budget_enforced": False}
    t0 = time.perf_counter()
    close = None
    try:
        pre = precheck(spec)
        if pre is not None:
            raise NotRunnable(*pre)
        out["budget_enforced"] = apply_budget(spec, device) if spec["system"] != "compute" else False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        idx = tokens(spec, device)
        step, out["params"], details, close = RUNNERS[spec["system"]](spec, device, idx)
        for _ in range(spec["warmup"]):
            step()
        sync(device)
        out["setup_s"] = time.perf_counter() - t0
        times = []
        for _ in range(spec["steps"]):
            t = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - t)
        out["step_times_s"] = times
        out["details"] = details()
        if spec.get("profile_path"):
            out["profile"] = profile_step(step, device, Path(spec["profile_path"]))
        out.update(status="ok", ok=True)
    except BaseException as e:  # noqa: BLE001 -- every failure is a result to record
        out["status"] = classify(e)
        out["error"] = f"{type(e).__name__}: {e}"
        if out["status"] in ("error", "oom"):
            out["traceback"] = traceback.format_exc()[-4000:]
    if device.type == "cuda" and torch.cuda.is_initialized():
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    elif spec["system"] in OURS and out.get("details"):
        out["peak_gpu_bytes"] = out["details"]["device_peak_bytes"]  # the CPU backend's "device", accounted
    out["total_s"] = time.perf_counter() - t0
    out["package_version"] = _version(PACKAGE.get(spec["system"]))
    if close is not None:
        with contextlib.suppress(Exception):
            close()
    return out


def _version(package: str | None) -> str | None:
    if package is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.manual_seed(spec["seed"])
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
