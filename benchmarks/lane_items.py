"""The fixed cost of one CPU-lane item (issue 17's hot path, issue 18's CPU-AdamW wall): what one grad-ring
piece costs the engine's CPU lane besides the AdamW kernel on its elements.

The H200 traces (benchmarks/results/2026-11-27-h200/analysis.md, finding 1) put 128-205 us on every lane item
beyond its AdamW; this script measures that cost on the CPU backend, with the lane a *thread* (the CPU backend's
``inline_copies`` would run updates on the calling thread; the CUDA backend never does), in two settings:

    engine  a real engine trains an MLP of ``--depth`` x Linear(``--width``, ``--width``) (bf16 compute, every
            bucket resident) with ring pieces monkeypatched down to ``--piece-bytes`` (floor and cap of [Note:
            ring pieces scale with the model]), so each bucket crosses in many pieces. Every piece's update is
            one lane item; from the lane's own time stamps (``HostEvent.started/finished``, as the timeline
            export reads them) an item's lane time is ``finished[k] - finished[k-1]`` for the items that were
            queued, and whose grad copy was done, before the lane finished the item before: the lane never
            waited for them (the "queued items" of analysis.md). Split into the part before the update starts
            (hand-off and waits) and the update call itself.
    harness the same engine after training; the runtime's own ``GradPipeline._submit_update`` is called for every
            piece of every bucket with its grads ready (a completed event), ``--rounds`` times, while the main
            thread only submits, then drains: the lane's time per item with no waiting at all.

and, on the calling thread, the parts an item is made of (each timed alone, median of ``--repeats`` blocks):
the C++ AdamW on a piece's elements (``adamw_step_at``), ``HostState.update`` on one piece, an empty lane item
with two completed waits (hand-off: ``SimpleQueue``, ``HostEvent``, the thread), and the submitting side
(``_submit_update`` per piece, on the thread that runs backward: autograd's on a GPU).

    fixed cost per item = lane time per item - AdamW kernel time for its elements

Thread count: ``--threads`` (default 1) is ``torch.set_num_threads``, which the kernel's OpenMP region uses: on
this 2-core machine shared with other processes a 2-thread region waits for a core other processes hold.
The OpenMP region's start and join on a many-core host (analysis.md's 24-82 us, est.) is therefore not in
these numbers.

    PYTHONPATH=. python benchmarks/lane_items.py --json benchmarks/results/cpu-<date>/lane_items.json
    PYTHONPATH=. python benchmarks/lane_items.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["OFFLOAD_CPU_COPIES"] = "lanes"  # every copy and update on its lane's thread, as on CUDA
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, machine, print_table, write_json  # noqa: E402
from rich.console import Console  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402
import offload.host.state  # noqa: E402
import offload.planning.buckets  # noqa: E402
from offload.backend.base import DONE, HostEvent  # noqa: E402
from offload.host.cpu_adam import adamw_step_at  # noqa: E402


def build(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def small_pieces(piece_bytes: int) -> None:
    """Ring pieces of ``piece_bytes`` whatever the model's size (as tests/runtime/test_chunked_staging.py does)."""
    offload.host.state.GRAD_RING_CHUNK_BYTES = piece_bytes
    offload.planning.buckets.GRAD_RING_CHUNK_MAX_BYTES = piece_bytes


def queued_items(entries) -> list[dict]:
    """The lane's update items of one step, each with its grad copy's event (logged just before it)."""
    items, last_d2h = [], None
    for lane, _b, _n, issued, event in entries:
        if lane == "d2h":
            last_d2h = event
        elif lane == "cpu_adam":
            items.append({"issued": issued, "ev": event, "d2h": last_d2h})
            last_d2h = None
    out = []
    for prev, item in zip(items, items[1:]):
        ev, free = item["ev"], prev["ev"].finished
        if ev.started is None or free is None:
            continue
        d2h_done = item["d2h"].finished if item["d2h"] is not None and item["d2h"].finished is not None else 0.0
        if item["issued"] <= free and d2h_done <= free:  # the lane never waited for it
            out.append({"total": ev.finished - free, "before": ev.started - free, "update": ev.finished - ev.started})
    return out


class DeviceLikeEvent:
    """``--device-waits``: a copy's event as the CPU lane sees a CUDA event (emulated): not a :class:`HostEvent`,
    and its ``synchronize`` releases and retakes the GIL (``time.sleep(0)``) as torch's ``Event.synchronize``
    does around ``cudaEventSynchronize``, even when the copy is long done; ``query`` keeps the GIL, as torch's."""

    __slots__ = ("inner",)

    def __init__(self, inner: HostEvent) -> None:
        self.inner = inner

    def synchronize(self) -> None:
        time.sleep(0)
        self.inner.synchronize()

    def query(self) -> bool:
        return self.inner.query()

    @property
    def started(self):
        return self.inner.started

    @property
    def finished(self):
        return self.inner.finished


def device_like_waits(backend) -> None:
    h2d, d2h = backend.h2d, backend.d2h
    backend.h2d = lambda dst, src, waits=(): DeviceLikeEvent(h2d(dst, src, waits))
    backend.d2h = lambda dst, src, waits=(): DeviceLikeEvent(d2h(dst, src, waits))


def engine_mode(args, console: Console) -> tuple[dict, object, object]:
    model = build(args.depth, args.width)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = offload.wrap(model, opt, budget=4 * nbytes, bucket_bytes=2 * args.width * args.width * 2,
                          dtype=torch.bfloat16, device="cpu")
    if args.device_waits:
        device_like_waits(engine._runtime.ctx.backend)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    per_step, seen = [], []

    def step() -> None:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        per_step.append(time.perf_counter() - t0)
        engine._runtime.wait_for_updates()
        entries = list(engine._runtime.ctx.lane_log.last_step[2])
        seen.append(sum(1 for e in entries if e[0] == "cpu_adam"))
        per_item = queued_items(entries)
        if per_item:
            per_step[-1] = (per_step[-1], per_item)
    items = [it for s in per_step if isinstance(s, tuple) for it in s[1]]
    host = engine._runtime.slots.hosted()
    result = {
        "items_per_step": statistics.median(seen), "queued_items": len(items),
        "piece_numel": host.chunk, "step_ms": 1e3 * statistics.median(s[0] if isinstance(s, tuple) else s
                                                                      for s in per_step),
        "item_us": _us(items, "total"), "before_update_us": _us(items, "before"), "update_us": _us(items, "update"),
    }
    return result, engine, opt


def _us(items: list[dict], key: str) -> float | None:
    return 1e6 * statistics.median(it[key] for it in items) if items else None


def pieces_of(host) -> list[tuple[int, frozenset, int, int]]:
    out = []
    for bucket in host.buckets:
        if not bucket.trainable_numel:
            continue
        ps = frozenset(p for run in bucket.runs for p in run.params)
        out += [(bucket.index, ps, lo, hi) for lo, hi in host.chunks(bucket.index, False)]
    return out


def harness_mode(args, engine) -> dict:
    rt = engine._runtime
    grads_pipe, host, lane = rt.grads, rt.slots.hosted(), rt.ctx.cpu
    pieces = pieces_of(host)
    grads_pipe.hparams = rt.ctx.optimizer.hparams()
    zeros = torch.zeros(max(hi - lo for _, _, lo, hi in pieces), dtype=torch.bfloat16)
    ready = HostEvent(done=True)
    events, submit = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for b, ps, lo, hi in pieces:
            grads_pipe._submit_update(b, ps, ready, grads=zeros[: hi - lo], span=(lo, hi))
            events.append(rt.slots.adam_event[b])
        submit.append((time.perf_counter() - t0) / len(pieces))
        lane.drain()
    gaps = [b.finished - a.finished for a, b in zip(events, events[1:]) if b.started >= a.finished]
    rt.ctx.lane_log.entries.clear()
    return {"items": len(events), "item_us": 1e6 * statistics.median(gaps),
            "submit_us": 1e6 * statistics.median(submit)}


def parts(args, engine) -> dict:
    """Each part of an item alone, on the calling thread (medians over ``--repeats`` blocks)."""
    rt = engine._runtime
    host = rt.slots.hosted()
    b, ps, lo, hi = next(p for p in pieces_of(host) if p[3] - p[2] == host.chunk)
    n = hi - lo
    grads = torch.zeros(n, dtype=torch.bfloat16)
    hp = rt.ctx.optimizer.hparams()
    lr, b1, b2, eps, wd = hp[0]
    master, m, v, lowp = host.master[b], host.exp_avg[b], host.exp_avg_sq[b], host.lowp[b]
    lane = rt.ctx.backend.host_lane("parts")
    done = HostEvent(done=True)

    def block(fn, count: int = 200) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - t0) / count

    def empty_items(count: int = 200) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            lane.submit(_noop, (done, DONE))
        lane.drain()
        return (time.perf_counter() - t0) / count

    kernel = lambda: adamw_step_at(master, grads, m, v, lo, 0, n, lowp, step=2, lr=lr, beta1=b1, beta2=b2,  # noqa: E731
                                   eps=eps, weight_decay=wd)
    update = lambda: host.update(b, ps, hp, (), grads, (lo, hi))  # noqa: E731 - not the bucket's last piece
    out: dict[str, list[float]] = {"kernel_us": [], "update_us": [], "empty_item_us": []}
    with torch.no_grad():
        for _ in range(args.repeats):
            out["kernel_us"].append(block(kernel))
            out["update_us"].append(block(update))
            out["empty_item_us"].append(empty_items())
    lane.close()
    res = {k: 1e6 * statistics.median(v) for k, v in out.items()}
    res["update_python_us"] = res["update_us"] - res["kernel_us"]
    res["piece_numel"] = n
    return res


def _noop() -> None:
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--piece-bytes", type=int, default=16384, help="ring piece size (bytes of bf16 grads)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device-waits", action="store_true",
                    help="copies' events behave as CUDA events do for the lane (emulated: DeviceLikeEvent)")
    ap.add_argument("--label", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: the harness, not the figures")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.smoke:
        args.depth, args.width, args.warmup, args.steps, args.rounds, args.repeats = 2, 128, 2, 2, 1, 1
        args.piece_bytes = 4096
    torch.set_num_threads(args.threads)
    console = Console()
    info = machine()
    describe(console, info)
    console.print(f"offload from {offload.__file__}; copies' events: "
                  f"{'device-like (emulated)' if args.device_waits else 'host events'}")
    small_pieces(args.piece_bytes)
    eng, engine, _opt = engine_mode(args, console)
    try:
        har = harness_mode(args, engine)
        prt = parts(args, engine)
    finally:
        engine.close()
    kernel = prt["kernel_us"]
    rows = [
        ["engine (backward running)", eng["queued_items"], f"{eng['item_us']:.1f}" if eng["item_us"] else "-",
         f"{eng['item_us'] - kernel:.1f}" if eng["item_us"] else "-",
         f"hand-off+waits {eng['before_update_us']:.1f}, update call {eng['update_us']:.1f}"],
        ["harness (lane only)", har["items"], f"{har['item_us']:.1f}", f"{har['item_us'] - kernel:.1f}",
         f"submit side {har['submit_us']:.1f} per piece"],
    ]
    print_table(f"CPU lane items: pieces of {prt['piece_numel']} bf16 grads ({args.label or 'this tree'})",
                ["setting", "items", "lane us/item", "fixed us/item", "note"], rows, console)
    print_table("parts, each alone on the calling thread (us)", ["part", "us"],
                [[k, f"{v:.2f}" if isinstance(v, float) else v] for k, v in prt.items()], console)
    info_after = machine()
    console.print(f"load average after: {' '.join(f'{x:.2f}' for x in info_after['load_average'])}")
    write_json(args.json, {
        "benchmark": "lane_items", "label": args.label, "offload": offload.__file__, "args": vars(args), "machine": info,
        "load_average_after": info_after["load_average"], "engine": eng, "harness": har, "parts": prt,
        "fixed_us": {"engine": eng["item_us"] - kernel if eng["item_us"] else None,
                     "harness": har["item_us"] - kernel},
    })


if __name__ == "__main__":
    main()
