"""The hardware half of the cost model (pure data): how fast bytes move and how fast the CPU updates.

A :class:`HardwareModel` holds the host-to-device and device-to-host bandwidth *curves* (bandwidth against
transfer size, pinned memory), how much each direction keeps while the other one is busy, the CPU AdamW
throughput, the host memory bandwidth, and a device roofline (FLOP/s, memory bytes/s) used only where
compute times have to be estimated rather than measured (``offload report``, the scheduling benchmark).
The other half of the cost model, the compute time of each traced event, comes with the trace.

Presets (``pcie3``, ``pcie4``, ``pcie5``) are *nominal* figures for planning without a GPU: the link's
usual pinned bandwidth with a fixed per-copy latency, a GPU of that generation at an assumed effective
throughput, a server-class host. They are assumptions, labelled as such (``measured=False``). The device
AdamW rate (a bucket whose optimizer state stays on the device) is a memory-bound model on top of them
(:data:`DEVICE_ADAM_BYTES_PER_PARAM` at the assumed memory bandwidth), not a measurement either.
``offload probe`` measures this machine and writes a JSON file that :func:`load_hw` reads back.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

Curve = tuple[tuple[int, float], ...]  # (transfer bytes, bytes/s), sizes strictly increasing

PROBE_SIZES = tuple(1024 * 4**k for k in range(10))  # 1 KiB ... 256 MiB

DEVICE_ADAM_BYTES_PER_PARAM = 28
"""Device memory bytes one fused AdamW pass touches per parameter (issue 18): it reads the fp32 master, m
and v (12) and the 16-bit grad (2), and writes master, m, v (12) and the 16-bit weight (2). At the
device's effective memory bandwidth that gives the device AdamW's rate: a roofline *model* (a memory-bound
elementwise kernel at the same effective bandwidth the compute estimates use), not a measurement."""


def latency_curve(peak_bytes_per_s: float, latency_s: float, sizes=PROBE_SIZES) -> Curve:
    """A link with a fixed cost per copy: ``bandwidth(n) = n / (latency + n / peak)``."""
    return tuple((n, n / (latency_s + n / peak_bytes_per_s)) for n in sizes)


@dataclass(frozen=True)
class HardwareModel:
    """One machine, as the scheduler and the simulator see it."""

    name: str
    h2d: Curve
    """Host-to-device bandwidth against copy size (pinned host memory)."""
    d2h: Curve
    """Device-to-host bandwidth against copy size."""
    duplex_factor: float
    """Fraction of its own bandwidth a direction keeps while the other direction is copying too."""
    adam_params_per_s: float
    """Parameters the CPU AdamW updates per second (fp32 master, grad, m, v, and the low-precision copy)."""
    host_bytes_per_s: float
    """Host memory bandwidth (a large copy, read + write counted)."""
    device_flops_per_s: float
    """Effective device throughput, used only to *estimate* compute times where none were measured."""
    device_bytes_per_s: float
    """Effective device memory bandwidth, the roofline's other side for the same estimates."""
    measured: bool = False
    """True when the figures come from ``offload probe`` on a real machine."""
    notes: str = ""
    device_adam_params_per_s: float = 0.0
    """Parameters a fused AdamW *on the device* updates per second (a bucket whose optimizer state the plan
    keeps on the device). 0: derived from ``device_bytes_per_s`` by :data:`DEVICE_ADAM_BYTES_PER_PARAM`, a
    model of a memory-bound one-pass kernel, not a measurement (``offload probe`` has no GPU kernel to time)."""

    def __post_init__(self) -> None:
        for name in ("h2d", "d2h"):
            curve = getattr(self, name)
            if not curve or any(n <= 0 or bw <= 0 for n, bw in curve):
                raise ValueError(f"HardwareModel.{name} needs (bytes > 0, bytes/s > 0) points; got {curve!r}")
            if any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
                raise ValueError(f"HardwareModel.{name} sizes must be strictly increasing")
            object.__setattr__(self, name, tuple((int(n), float(bw)) for n, bw in curve))
        if not 0 < self.duplex_factor <= 1:
            raise ValueError(f"duplex_factor must be in (0, 1]; got {self.duplex_factor}")
        for name in ("adam_params_per_s", "host_bytes_per_s", "device_flops_per_s", "device_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareModel.{name} must be positive; got {getattr(self, name)!r}")
        if not self.device_adam_params_per_s >= 0:
            raise ValueError("HardwareModel.device_adam_params_per_s must be >= 0 (0: derived from "
                             f"device_bytes_per_s); got {self.device_adam_params_per_s!r}")

    # -- transfers ------------------------------------------------------------------------------------

    def h2d_seconds(self, nbytes: int) -> float:
        return _seconds(self.h2d, nbytes)

    def d2h_seconds(self, nbytes: int) -> float:
        return _seconds(self.d2h, nbytes)

    @property
    def peak_h2d(self) -> float:
        return max(bw for _, bw in self.h2d)

    @property
    def peak_d2h(self) -> float:
        return max(bw for _, bw in self.d2h)

    def adam_seconds(self, numel: int) -> float:
        return numel / self.adam_params_per_s

    @property
    def device_adam_rate(self) -> float:
        """Parameters per second of the device AdamW: the field where set, else the memory-bound model
        ``device_bytes_per_s / DEVICE_ADAM_BYTES_PER_PARAM``."""
        return self.device_adam_params_per_s or self.device_bytes_per_s / DEVICE_ADAM_BYTES_PER_PARAM

    def device_adam_seconds(self, numel: int) -> float:
        return numel / self.device_adam_rate

    def bytes_reaching(self, fraction: float = 0.9) -> int:
        """The smallest copy size whose host-to-device bandwidth reaches ``fraction`` of the peak *on the
        curve* (interpolated between its points as :meth:`h2d_seconds` does, not only at measured sizes)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
        target = fraction * self.peak_h2d
        k = next(i for i, (_, bw) in enumerate(self.h2d) if bw >= target)
        if k == 0:
            return self.h2d[0][0]  # below the first point a copy costs at least that point's time
        (n0, bw0), (n1, bw1) = self.h2d[k - 1], self.h2d[k]
        w = (target - bw0) / (bw1 - bw0)  # bandwidth is linear in log(size) between two points
        n = min(n1, max(n0 + 1, math.ceil(math.exp(math.log(n0) + w * (math.log(n1) - math.log(n0))))))
        while n > n0 + 1 and (n - 1) / self.h2d_seconds(n - 1) >= target:  # float rounding: step down
            n -= 1
        while n < n1 and n / self.h2d_seconds(n) < target:  # or up
            n += 1
        return n

    def bucket_bytes_hint(self, fraction: float = 0.9) -> int:
        """The smallest measured copy size reaching ``fraction`` of peak host-to-device bandwidth."""
        peak = self.peak_h2d
        return next(n for n, bw in self.h2d if bw >= fraction * peak)

    # -- files ----------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = asdict(self)
        d["h2d"] = [list(p) for p in self.h2d]
        d["d2h"] = [list(p) for p in self.d2h]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareModel":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        missing = set(cls.__dataclass_fields__) - set(known) - {"measured", "notes", "device_adam_params_per_s"}
        if missing:
            raise ValueError(f"hardware description lacks {sorted(missing)}")
        known["h2d"] = tuple(tuple(p) for p in known["h2d"])
        known["d2h"] = tuple(tuple(p) for p in known["d2h"])
        return cls(**known)

    def with_(self, **changes) -> "HardwareModel":
        return replace(self, **changes)


@functools.lru_cache(maxsize=1 << 14)  # pure; the scheduler asks for the same few bucket sizes many times
def _seconds(curve: Curve, nbytes: int) -> float:
    """Copy time of ``nbytes``: bandwidth interpolated linearly in log(size), clamped at the curve's ends
    (below the smallest point the per-copy time of that point is a floor: a copy never gets cheaper)."""
    if nbytes <= 0:
        return 0.0
    sizes = [n for n, _ in curve]
    k = bisect.bisect_left(sizes, nbytes)
    if k == 0:
        n0, bw0 = curve[0]
        return max(n0 / bw0, nbytes / bw0) if nbytes < n0 else nbytes / bw0
    if k == len(curve):
        return nbytes / curve[-1][1]
    (n0, bw0), (n1, bw1) = curve[k - 1], curve[k]
    w = (math.log(nbytes) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return nbytes / (bw0 + w * (bw1 - bw0))


def _preset(name, peak, latency, duplex, adam, host, flops, mem, gpu) -> HardwareModel:
    curve = latency_curve(peak, latency)
    return HardwareModel(
        name=name, h2d=curve, d2h=curve, duplex_factor=duplex, adam_params_per_s=adam, host_bytes_per_s=host,
        device_flops_per_s=flops, device_bytes_per_s=mem, measured=False,
        device_adam_params_per_s=mem / DEVICE_ADAM_BYTES_PER_PARAM,
        notes=(f"nominal preset, not measured: PCIe x16 at {peak / 1e9:.0f} GB/s pinned with {latency * 1e6:.0f} us "
               f"per copy, {gpu} at an assumed {flops / 1e12:.0f} TFLOP/s effective, CPU AdamW "
               f"{adam / 1e9:.1f} G params/s; device AdamW modelled at {mem / 1e12:.1f} TB/s effective / "
               f"{DEVICE_ADAM_BYTES_PER_PARAM} B per param = {mem / DEVICE_ADAM_BYTES_PER_PARAM / 1e9:.0f} G params/s"))


PRESETS: dict[str, HardwareModel] = {
    "pcie3": _preset("pcie3", 12e9, 10e-6, 0.85, 1.0e9, 60e9, 60e12, 0.8e12, "a V100-class GPU"),
    "pcie4": _preset("pcie4", 25e9, 10e-6, 0.85, 2.0e9, 120e9, 150e12, 1.5e12, "an A100-class GPU"),
    "pcie5": _preset("pcie5", 50e9, 8e-6, 0.85, 3.0e9, 200e9, 400e12, 3.0e12, "an H100-class GPU"),
}


def load_hw(spec: str | Path | HardwareModel) -> HardwareModel:
    """A preset name (``pcie3``/``pcie4``/``pcie5``), or the path of a JSON file written by ``offload probe``."""
    if isinstance(spec, HardwareModel):
        return spec
    key = str(spec).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown hardware {spec!r}: use one of {sorted(PRESETS)} or a JSON file written by "
                         "`offload probe --json FILE`")
    try:
        data = json.loads(path.read_text())
        return HardwareModel.from_dict(data.get("hardware_model", data))
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a hardware description written by `offload probe`: {e}") from e
