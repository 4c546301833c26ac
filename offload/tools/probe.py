"""``offload probe``: measure this machine for the cost model.

On CUDA: the pinned host-to-device and device-to-host bandwidth curve (1 KiB ... 256 MiB), each direction
alone and both at once (which gives the duplex factor). Everywhere: the CPU AdamW throughput (the engine's
own update: the fused C++ kernel when it is built, else torch ops, on flat fp32 buffers writing a bf16 copy,
as a bf16 engine's update does) and the host memory bandwidth. Without CUDA the PCIe figures
are not measured: the hardware model written then carries the ``pcie4`` preset's link, and says so.
Under torch.distributed (a group of two or more ranks), first the collectives over the group, on every rank
(``offload/tools/probe_collectives.py``, [Note: probing the collectives]).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..errors import KernelUnavailableError
from ..host.cpu_adam import KERNEL_AVAILABLE, adamw_step, kernel_info
from ..optim import adamw_
from ..planning.buckets import AUTO_LINK_FRACTION
from ..planning.hw import PRESETS, PROBE_SIZES, HardwareModel
from .probe_collectives import COLLECTIVE_SIZES, measure_collectives


def _best_of(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_adam_params_per_s(numel: int = 1 << 26, repeat: int = 3, fused: bool = KERNEL_AVAILABLE) -> float:
    """Parameters per second of the engine's host update on flat buffers: fp32 master, grad, m, v and a bf16
    copy written. ``fused``: the C++ kernel (``HostState.update``'s default), else the torch path (six
    passes, then the bf16 rounding).

    The default size (64 Mi parameters, 1.1 GiB of buffers) is far beyond any last-level cache, as a real
    step is: its masters and moments are touched once per step. With 4 Mi (64 MiB, the default until
    2026-11-27) the first GPU run's Xeon (16 vCPUs) measured 8.9e9 parameters/s, a rate that put the bound
    of gpt2-xl's step at 0.15 s while the step took 0.64 s (benchmarks/results/2026-11-27-h200)."""
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    lowp = torch.empty(numel, dtype=torch.bfloat16)
    step = iter(range(1, 1 << 30))
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def kernel() -> None:
        adamw_step(p, g, m, v, step=next(step), **hp, lowp_out=lowp)

    def plain() -> None:
        adamw_(p, g, m, v, next(step), **hp)
        lowp.copy_(p)

    if fused and not KERNEL_AVAILABLE:
        raise KernelUnavailableError("fused=True needs the C++ AdamW kernel, which this build of offload._C lacks "
                                     "(offload.host.cpu_adam.KERNEL_AVAILABLE is False): rebuild offload "
                                     "(pip install -e .) or use fused=False")
    return numel / _best_of(kernel if fused else plain, repeat)


def host_bytes_per_s(nbytes: int = 1 << 28, repeat: int = 3) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), repeat)  # read + write


def pcie_curves(sizes=PROBE_SIZES, repeat: int = 5) -> dict:  # pragma: no cover - needs CUDA
    """Per size: H2D and D2H bytes/s alone, and each while the other direction copies too."""
    dev = torch.device("cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"sizes": list(sizes), "h2d": [], "d2h": [], "h2d_duplex": [], "d2h_duplex": []}
    for n in sizes:
        host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(n, dtype=torch.uint8, device=dev)
        dev_b = torch.empty(n, dtype=torch.uint8, device=dev)

        def timed(stream, copy):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                copy()
                end.record(stream)
            return start, end

        samples = {k: [] for k in ("h2d", "d2h", "h2d_duplex", "d2h_duplex")}
        for _ in range(repeat + 1):
            for key, stream, copy in (("h2d", up, lambda: dev_a.copy_(host_a, non_blocking=True)),
                                      ("d2h", down, lambda: host_b.copy_(dev_b, non_blocking=True))):
                s, e = timed(stream, copy)
                torch.cuda.synchronize()
                samples[key].append(s.elapsed_time(e) / 1e3)
            s1, e1 = timed(up, lambda: dev_a.copy_(host_a, non_blocking=True))
            s2, e2 = timed(down, lambda: host_b.copy_(dev_b, non_blocking=True))
            torch.cuda.synchronize()
            samples["h2d_duplex"].append(s1.elapsed_time(e1) / 1e3)
            samples["d2h_duplex"].append(s2.elapsed_time(e2) / 1e3)
        for key, vals in samples.items():
            out[key].append(n / statistics.median(vals[1:]))
    return out


def probe(progress: Callable[[str], None] = lambda msg: None, group=None,
          collective_sizes: Sequence[int] = COLLECTIVE_SIZES) -> dict:
    """Measure what this machine allows; return a JSON-ready dict with a ``hardware_model`` entry.

    When ``torch.distributed`` is initialised (and ``group`` is not False), this is **collective**: every rank
    of ``group`` (default: the default group) must call it. All time the collectives first (the result's
    ``collectives`` entry, [Note: probing the collectives]; a rank that does not take part makes the others
    raise ``DistributedError`` within the group's timeout); then rank 0 alone measures the rest, while the
    others return ``{"rank": r, "collectives": ...}`` at once (so that they do not load the machine rank 0
    measures). Without a group the result has no ``collectives`` key."""
    coll = measure_collectives(group, collective_sizes, progress=progress) if group is not False else None
    if coll is not None and coll["rank"] != 0:
        return {"rank": coll["rank"], "collectives": coll}
    result: dict = {"cuda": torch.cuda.is_available()}
    progress("CPU AdamW throughput")
    adam = cpu_adam_params_per_s()
    progress("host memory bandwidth")
    host = host_bytes_per_s()
    info = kernel_info()
    impl = f"fused C++ ({info['isa']}, {'OpenMP' if info['openmp'] else 'serial'})" if info["available"] else "torch ops"
    result.update(cpu_adam_params_per_s=adam, cpu_adam_impl=impl, cpu_adam_threads=torch.get_num_threads(),
                  host_bytes_per_s=host)
    base = PRESETS["pcie4"]
    if result["cuda"]:  # pragma: no cover - needs CUDA
        progress("PCIe bandwidth curve")
        curves = pcie_curves()
        result["pcie"] = curves
        pairs = list(zip(curves["h2d"], curves["h2d_duplex"]))
        duplex = min(1.0, max(0.05, pairs[-1][1] / pairs[-1][0]))
        model = replace(base, name=f"probe ({torch.cuda.get_device_name()})",
                        h2d=tuple(zip(curves["sizes"], curves["h2d"])), d2h=tuple(zip(curves["sizes"], curves["d2h"])),
                        duplex_factor=duplex, adam_params_per_s=adam, host_bytes_per_s=host, measured=True,
                        notes="PCIe, CPU AdamW and host bandwidth measured by offload probe; device roofline "
                              "from the pcie4 preset (not measured)")
    else:
        result["pcie"] = None
        model = replace(base, name="probe (no CUDA)", adam_params_per_s=adam, host_bytes_per_s=host, measured=False,
                        notes="no CUDA: PCIe NOT measured (pcie4 preset link); CPU AdamW and host bandwidth measured")
    result["hardware_model"] = model.to_dict()
    result["bucket_bytes_hint"] = suggested_bucket_bytes(model)
    if coll is not None:
        result["collectives"] = coll
    return result


def suggested_bucket_bytes(model: HardwareModel) -> int:
    """The bucket size ``bucket_bytes="auto"`` picks with this hardware model for a model large enough that
    its cap (1/8 of the weights) does not bind: the smallest copy reaching 90 % of the host-to-device peak on
    the curve (issue 18: the same point, not the nearest measured size above it)."""
    return model.bytes_reaching(AUTO_LINK_FRACTION)


def hardware_from_probe(result: dict) -> HardwareModel:
    return HardwareModel.from_dict(result["hardware_model"])
