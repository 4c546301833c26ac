"""``offload probe`` under torch.distributed: the collectives timed per size over the default group, and the
ring model of ``offload/planning/collectives.py`` fitted to them (issue 20).

[Note: probing the collectives]
When ``torch.distributed`` is initialised, every rank of the group runs :func:`measure_collectives` (the probe
calls it first): for each size (64 KiB ... 256 MiB by default, the largest dropped where a rank lacks the
memory; every rank keeps the sizes every rank can hold, agreed by an all-reduce MIN), each kind
(``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``; the ``*_single`` names where torch
has them, as the runtime calls them) is called once untimed, then ``repeat`` times, each after a barrier
(an all-reduce of one element on the same side, so that both sides time alike). Each rank times its own
call (``perf_counter`` around it, after a device synchronise on CUDA); what a collective costs is the
slowest rank's time, so the samples are all-reduced with MAX over the ranks, sample by sample, and the
median over the repeats is kept. Two sides are timed, each where the group has one:

* ``nccl``: CUDA tensors, where the group's CUDA backend is NCCL (``backend="nccl"`` or
  ``"cpu:gloo,cuda:nccl"``), what the runtime's device reduce-scatter and weight gather use;
* ``gloo``: CPU tensors, where the group's CPU backend is gloo, what the runtime's host path uses.

The model fitted per kind is [Note: the alpha-beta ring model]'s ``t = k (p - 1) a + k (p - 1) / p * S / B``
with ``k = 1`` for an all-gather or NCCL's reduce-scatter and ``k = 2`` for an all-reduce and for gloo's
reduce-scatter (an all-reduce in ProcessGroupGloo, [Note: gloo's collectives]). The fit is a *relative*
least squares (each equation divided by its measured time, so 64 KiB counts as much as 256 MiB) with
``a >= 0`` and ``B > 0``; ``link`` is one (a, B) fitted to the three kinds at once, the :class:`Link` the
cost model uses (one link serves all three). Each fit carries its largest relative error over the points it
was fitted to: the honest width of the model on this machine. The buffers are float32 (gloo's reductions
cost CPU time per element, so a bfloat16 reduction of the same bytes can differ).

Every rank must call it (it issues collectives); a rank that does not, or dies, makes the others raise
:class:`DistributedError` after at most the group's ``timeout`` (a peer that dies mid-collective may be
seen at once; one that never joins, or hangs, at the timeout: tested, 10 s), never hang for ever. The
measurements describe the group they ran on: ``p`` ranks on ``nodes`` nodes (``nodes`` from torchrun's
``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` where set, else unknown). A fit made on one node is an intra-node
link; :func:`measured_links` turns it into the :class:`Link` that ``offload report`` uses, and another
world size is then an extrapolation in the ring model.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..config import format_bytes
from ..errors import DistributedError
from ..planning.collectives import Link

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
COLLECTIVE_SIZES = tuple((64 << 10) << (2 * i) for i in range(7))  # 64 KiB, 256 KiB, ... 256 MiB
"""The buffer sizes timed: the whole buffer (an all-gather's output, a reduce-scatter's input)."""
_DTYPE = torch.float32
# what the runtime calls (offload/runtime/device_collectives.py): torch 2.13 names the single-tensor collectives
# *_single (the *_tensor names warn); older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_PEAK_BUFFERS = 3  # gloo's reduce-scatter holds its input, a clone of it and the output chunk: ~2.5 buffers


@dataclass(frozen=True)
class RingFit:
    """``(a, B)`` of the ring model fitted to measured times, and its largest relative error on them."""

    latency_s: float
    bytes_per_s: float
    max_rel_error: float

    def seconds(self, steps: float, wire_bytes: float) -> float:
        """The model's time for ``steps`` ring steps moving ``wire_bytes`` per rank (see :func:`ring_terms`)."""
        return steps * self.latency_s + wire_bytes / self.bytes_per_s

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s, "max_rel_error": self.max_rel_error}


def ring_terms(kind: str, backend: str, nbytes: int, ranks: int) -> tuple[float, float]:
    """``(steps, bytes)`` of one ``kind`` collective of a ``nbytes`` buffer over ``ranks`` ranks in the ring
    model: ``t = steps * a + bytes / B`` ([Note: probing the collectives])."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: use one of {KINDS}")
    k = 2 if kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo") else 1
    return k * (ranks - 1), k * (ranks - 1) / ranks * nbytes


def fit_ring(points: Sequence[tuple[float, float, float]]) -> RingFit:
    """Fit ``t = steps * a + bytes / B`` to ``(steps, bytes, seconds)`` points: relative least squares with
    ``a >= 0``, ``B > 0``. Raises ``ValueError`` when the times do not grow with the bytes (no bandwidth to
    fit: sizes too small, or too noisy) or with fewer than two points of different bytes."""
    rows = [(s / t, w / t) for s, w, t in points if t > 0]
    if len(rows) != len(points) or len(rows) < 2:
        raise ValueError(f"fit_ring needs two or more points with positive times; got {list(points)}")
    saa = sum(r[0] * r[0] for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] * r[1] for r in rows)
    sa1 = sum(r[0] for r in rows)
    sb1 = sum(r[1] for r in rows)
    det = saa * sbb - sab * sab
    a, inv_b = -1.0, -1.0
    if det > 1e-12 * saa * sbb:  # the normal equations of min sum (a x + b y - 1)^2
        a, inv_b = (sa1 * sbb - sb1 * sab) / det, (saa * sb1 - sab * sa1) / det
    if not (a >= 0 and inv_b > 0):  # the constrained optimum lies on an edge: a = 0, or 1/B = 0 (no bandwidth)

        def residual(x: float, y: float) -> float:
            return sum((x * r[0] + y * r[1] - 1) ** 2 for r in rows)
        a, inv_b = 0.0, sb1 / sbb
        if residual(0.0, inv_b) >= residual(sa1 / saa, 0.0):
            raise ValueError("the times do not grow with the bytes moved: no bandwidth to fit (use larger sizes)")
    err = max(abs(s * a + w * inv_b - t) / t for s, w, t in points)
    return RingFit(a, 1.0 / inv_b, err)


def nodes_from_env(world: int) -> int | None:
    """Nodes of a torchrun job (``WORLD_SIZE / LOCAL_WORLD_SIZE``) when they describe a group of ``world``
    ranks; else None (not known)."""
    try:
        total, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if total != world or local < 1 or total % local:
        return None
    return total // local


def machine() -> dict:
    """What the measurements ran on (rank 0's host)."""
    out = {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "load_average_1m": os.getloadavg()[0], "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    if torch.cuda.is_available():  # pragma: no cover - needs CUDA
        out["device"] = torch.cuda.get_device_name()
    return out


def group_sides(group=None) -> dict[str, torch.device]:
    """The sides of ``group`` the probe times: ``{"nccl": cuda device, "gloo": cpu}``, each where it has one."""
    config = dict(part.split(":", 1) for part in str(dist.get_backend_config(group)).split(",") if ":" in part)
    if not config:  # a single backend named without devices
        name = str(dist.get_backend(group))
        config = {"cpu": name} if name == "gloo" else {"cuda": name}
    sides = {}
    if config.get("cuda") == "nccl" and torch.cuda.is_available():  # pragma: no cover - needs CUDA
        sides["nccl"] = torch.device("cuda", torch.cuda.current_device())
    if config.get("cpu") == "gloo":
        sides["gloo"] = torch.device("cpu")
    return sides


def _group_timeout_s(group, device: torch.device) -> float | None:
    try:  # private, best effort: said in the error when known
        pg: Any = group if group is not None else dist.group.WORLD
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - only a message's detail
        return None


class _Side:
    """One side of the group (a backend and its device): the calls, timed."""

    def __init__(self, backend: str, device: torch.device, group, rank: int, world: int):
        self.backend, self.device, self.group, self.rank, self.world = backend, device, group, rank, world
        self.where = "start"
        self.timeout_s = _group_timeout_s(group, device)

    def call(self, what: str, fn: Callable[[], object]) -> None:
        self.where = what
        try:
            fn()
            self.sync()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError, DistBackendError, ...
            bound = f"{self.timeout_s:.0f} s" if self.timeout_s is not None else "the group's timeout"
            raise DistributedError(
                f"offload probe: rank {self.rank}'s {self.backend} {what} over {self.world} ranks failed: {e}. "
                "Every rank of the group must run the probe; another rank raised, exited or hangs (a collective "
                f"waits at most {bound}, the group's timeout). The group cannot be used any more") from e

    def sync(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.device)

    def agree(self, values: torch.Tensor, op, what: str) -> torch.Tensor:
        """``values`` reduced with ``op`` over the ranks (on this side's device)."""
        t = values.to(self.device)
        self.call(what, lambda: dist.all_reduce(t, op=op, group=self.group))
        return t.cpu()

    def free_bytes(self) -> int:
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            return torch.cuda.mem_get_info(self.device)[0]
        import psutil
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))  # ranks sharing this host's RAM
        return psutil.virtual_memory().available // max(1, local)

    def ops(self, kind: str, numel: int) -> Callable[[], object]:
        chunk = numel // self.world
        if kind == "all_gather":
            src, dst = torch.ones(chunk, dtype=_DTYPE, device=self.device), torch.empty(numel, dtype=_DTYPE,
                                                                                           device=self.device)
            return lambda: _all_gather(dst, src, group=self.group)
        if kind == "reduce_scatter":
            src, dst = torch.ones(numel, dtype=_DTYPE, device=self.device), torch.empty(chunk, dtype=_DTYPE,
                                                                                          device=self.device)
            return lambda: _reduce_scatter(dst, src, group=self.group)
        buf = torch.ones(numel, dtype=_DTYPE, device=self.device)
        return lambda: dist.all_reduce(buf, group=self.group)

    def time(self, kind: str, nbytes: int, repeat: int) -> list[float]:
        """This rank's seconds for ``repeat`` calls of ``kind`` on ``nbytes``, each after a barrier."""
        what = f"{kind} of {format_bytes(nbytes)}"
        op = self.ops(kind, nbytes // _DTYPE.itemsize)
        token = torch.zeros(1, device=self.device)
        self.call(what, op)  # warm-up (connections, NCCL's channels, allocations)
        out = []
        for _ in range(repeat):
            self.call(f"barrier before the {what}", lambda: dist.all_reduce(token, group=self.group))
            t0 = time.perf_counter()
            self.call(what, op)
            out.append(time.perf_counter() - t0)
        return out


def _sizes_for(side: _Side, sizes: Sequence[int]) -> tuple[list[int], int]:
    """The sizes every rank can hold (rounded down to whole float32 chunks per rank), and the cap agreed."""
    quantum = side.world * _DTYPE.itemsize
    mine = torch.tensor([side.free_bytes() // (2 * _PEAK_BUFFERS)], dtype=torch.int64)  # half the free memory
    cap = int(side.agree(mine, dist.ReduceOp.MIN, "agreement on the sizes").item())
    kept = sorted({n // quantum * quantum for n in sizes if quantum <= n <= cap})
    return kept, cap


def _measure_side(side: _Side, sizes: Sequence[int], repeat: int, progress: Callable[[str], None]) -> dict:
    kept, cap = _sizes_for(side, sizes)
    out: dict = {"device": side.device.type, "dtype": str(_DTYPE).removeprefix("torch."), "repeat": repeat,
                 "sizes": kept, "dropped_sizes": sorted(n for n in sizes if n > cap),
                 "seconds": {}, "fits": {}, "fit_errors": {}}
    samples = torch.zeros(len(KINDS), len(kept), repeat, dtype=torch.float64)
    for j, n in enumerate(kept):
        progress(f"{side.backend} collectives, {format_bytes(n)}")
        for i, kind in enumerate(KINDS):
            samples[i, j] = torch.tensor(side.time(kind, n, repeat), dtype=torch.float64)
    # the slowest rank's time, sample by sample
    slowest = side.agree(samples, dist.ReduceOp.MAX, "exchange of the timings")
    points: dict[str, list[tuple[float, float, float]]] = {}
    for i, kind in enumerate(KINDS):
        secs = [statistics.median(slowest[i, j].tolist()) for j in range(len(kept))]
        out["seconds"][kind] = secs
        points[kind] = [(*ring_terms(kind, side.backend, n, side.world), t) for n, t in zip(kept, secs)]
    points["link"] = [p for kind in KINDS for p in points[kind]]
    for key, pts in points.items():
        try:
            out["fits"][key] = fit_ring(pts).to_dict()
        except ValueError as e:
            out["fits"][key] = None
            out["fit_errors"][key] = str(e)
    return out


def measure_collectives(group=None, sizes: Sequence[int] = COLLECTIVE_SIZES, repeat: int = 5,
                        nodes: int | None = None, progress: Callable[[str], None] = lambda msg: None) -> dict | None:
    """Time the collectives over ``group`` (default: the default group) on each side it has, and fit the ring
    model ([Note: probing the collectives]). None when ``torch.distributed`` is not initialised. Collective:
    every rank of the group must call it, with the same arguments; every rank gets the same figures.
    ``nodes``: the nodes the group spans, if known (default: from torchrun's environment)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1; got {repeat!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    entry: dict = {"measured": False, "world_size": world, "rank": rank,
                   "nodes": nodes if nodes is not None else nodes_from_env(world), "machine": machine(),
                   "backends": {}, "not_measured": {}}
    if world == 1:
        entry["note"] = "a group of one rank: no collective to measure"
        return entry
    sides = group_sides(group)
    if "nccl" not in sides:
        entry["not_measured"]["nccl"] = ("no CUDA device" if not torch.cuda.is_available() else
                                         "the group has no NCCL side (init with backend=\"cpu:gloo,cuda:nccl\" and "
                                         "one GPU per rank: offload probe under torchrun does so when every local "
                                         "rank has a GPU)")
    if "gloo" not in sides:
        entry["not_measured"]["gloo"] = "the group has no gloo side (init with backend=\"cpu:gloo,cuda:nccl\")"
    for backend, device in sides.items():
        entry["backends"][backend] = _measure_side(_Side(backend, device, group, rank, world), sizes, repeat, progress)
    entry["measured"] = bool(entry["backends"])
    entry["calls"] = [_all_gather.__name__, _reduce_scatter.__name__, "all_reduce"]
    entry["method"] = ("per size and kind: one untimed call, then `repeat` calls each after a barrier; each rank's "
                       "perf_counter time, the max over ranks per call, the median over calls; fits: relative least "
                       "squares of the ring model, max_rel_error over the sizes fitted")
    return entry


# -- offload report: the measured links ---------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredLinks:
    """The links a probe JSON's ``collectives`` entry gives the cost model: ``nccl`` (the intra-node link of
    NCCL's ring) and ``gloo`` (gloo's hop between the ranks of a node), each None where not measured or not
    usable; ``world``: the ranks they were measured on; ``notes``: why a measurement is not used."""

    nccl: Link | None
    gloo: Link | None
    world: int
    notes: tuple[str, ...] = ()


def link_from_fit(backend: str, side: dict, world: int, where: dict) -> Link:
    """The :class:`Link` of one side's ``link`` fit, its source saying what was measured, where and how well."""
    fit = side["fits"]["link"]
    sizes = side["sizes"]
    source = (f"MEASURED by offload probe on {where.get('host', '?')} ({where.get('platform', '?')}): {backend} "
              f"over {world} ranks on one node, {side['dtype']} buffers of {format_bytes(sizes[0])} to "
              f"{format_bytes(sizes[-1])}, the slowest rank's time, median of {side['repeat']}; ring model fitted to "
              f"all-gather, reduce-scatter and all-reduce at once: a = {fit['latency_s'] * 1e6:.1f} us, "
              f"B = {fit['bytes_per_s'] / 1e9:.3g} GB/s, max relative error {fit['max_rel_error']:.0%}")
    if backend == "nccl":  # pragma: no cover - written by a CUDA probe; built by hand in the tests
        source += "; whether it shares the host's PCIe link is not measured (taken as not)"
    return Link(f"{backend}-measured", float(fit["bytes_per_s"]), float(fit["latency_s"]), source=source)


def measured_links(data: dict) -> MeasuredLinks:
    """The links of a probe JSON (``offload probe --json``) with a ``collectives`` entry: a side's fit is an
    intra-node link when it was measured on one node; on several (or an unknown number of) nodes it fits the
    whole hierarchy at once and is not used (a note says so). ``ValueError`` when the entry is malformed."""
    coll = data.get("collectives")
    if not coll or not coll.get("measured"):
        note = (coll or {}).get("note", "no collectives were measured")
        return MeasuredLinks(None, None, 0, (f"the probe JSON's collectives: {note}; nominal presets used",))
    try:
        world, nodes, where = int(coll["world_size"]), coll.get("nodes"), coll.get("machine", {})
        links: dict[str, Link] = {}
        notes = []
        for backend, side in coll["backends"].items():
            if side["fits"].get("link") is None:
                why = side.get("fit_errors", {}).get("link", "no fit")
                notes.append(f"{backend} measured but not fitted ({why}): its nominal preset is used")
            elif nodes != 1:
                notes.append(f"{backend} was measured on {nodes or 'an unknown number of'} nodes: its fit mixes the "
                             "links inside and across nodes, so it is not used (probe one node under torchrun, "
                             "which sets LOCAL_WORLD_SIZE); its nominal preset is used")
            else:
                links[backend] = link_from_fit(backend, side, world, where)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"the probe JSON's collectives entry is malformed ({type(e).__name__}: {e})") from e
    return MeasuredLinks(links.get("nccl"), links.get("gloo"), world, tuple(notes))


def link_origins(links: dict[str, str], measured: MeasuredLinks | None, gpus_per_node: int,
                 intra_given: bool) -> dict:
    """For ``offload report --gpus``: which of the report's ``links`` (name -> source) are measured and which
    nominal presets, and what to say about them (a measured link used for another number of ranks than it
    was measured on is extrapolated in the ring model)."""
    used = {x.name: x for x in (measured.nccl, measured.gloo) if x is not None} if measured else {}
    origin = {name: "measured by offload probe" if name in used else "nominal preset" for name in links}
    notes = list(measured.notes) if measured else []
    if measured is not None and measured.nccl is not None and intra_given:
        notes.append("--intra was given: it is used instead of the NCCL link the probe measured")
    for name in links:
        if name in used and measured is not None and gpus_per_node != measured.world:
            notes.append(f"{name} was measured on {measured.world} ranks and is used for {gpus_per_node} ranks a "
                         "node: extrapolated in the ring model, not measured")
    return {"link_origin": origin, "link_notes": notes}


def links_of_hw(spec: str) -> MeasuredLinks | None:
    """``offload report --hw``: the measured links of a probe JSON with a ``collectives`` entry; None for a
    preset name or a JSON without one (the report is then what it was: nominal presets)."""
    import json
    from pathlib import Path

    path = Path(spec)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(data, dict) or "collectives" not in data:
        return None
    return measured_links(data)
