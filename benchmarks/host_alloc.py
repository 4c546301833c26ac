"""Host memory for fp32 masters and Adam state: bytes reserved for bytes requested, time to allocate and
back 8 GiB, and OS allocations per step in steady state.

* Bucket mix: the host regions the engine asks for (fp32 master, bf16 copy, grad, m and v of every bucket;
  ``offload.planning.buckets.host_layout``) for ``offload.tools.presets`` models (BERT-large, GPT-2 1.5B = gpt2-xl, GPT-3
  6.7B) built on the meta device and bucketed at 32 MiB of bf16.
  ``offload``: one exact-size arena (cpp/pinned_arena), created for real where the machine has the RAM.
  ``pow2_rule``: what a per-request allocator that rounds up to a power of two reserves (torch's
  CachingHostAllocator behind ``torch.empty(pin_memory=True)``), computed from that rule.
  ``torch_pinned``: ``torch.empty(pin_memory=True)`` per region, measured only on a machine with CUDA.
* 8 GiB: map + back the pages, with a write per page or madvise(MADV_POPULATE_WRITE), on all cores or one,
  against ``torch.empty(...).fill_(0)`` (pageable: no pinning here without a GPU); each variant several
  times, interleaved; alloc_s is the fastest round, all rounds are recorded.
* Steady state: a training step's worth of allocate/release per bucket, 100 steps after a warm-up; OS
  allocations counted as entries of /proc/self/maps that appeared or changed (mmap, munmap, brk all show).

    python benchmarks/host_alloc.py --json benchmarks/results/cpu-<date>/host_alloc.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from common import describe, machine, print_table, write_json  # noqa: E402
from offload.host.arena import HostArena  # noqa: E402
from rich.console import Console  # noqa: E402

from offload.planning.buckets import ParamSpec, host_layout, make_buckets  # noqa: E402
from offload.tools.presets import MODELS  # noqa: E402

GiB = 1 << 30
BUCKET_BYTES = 32 << 20
RAM_HEADROOM = 1.25  # run an allocation only when 1.25x its size is available


def bucket_regions(model: str) -> tuple[list[tuple[int, int]], int]:
    """The host regions the engine requests for ``model`` trained in bf16 (per bucket an fp32 master, its
    bf16 copy, its bf16 grad, and fp32 m and v), as (offset, size) in ``host_layout``'s arena, and that
    arena's size."""
    params = list(MODELS[model].build("meta").parameters())
    specs = [ParamSpec(p.numel(), 0) for p in params]
    buckets = make_buckets(specs, list(range(len(params))), BUCKET_BYTES, 2)
    layout = host_layout(buckets, lowp_itemsize=2)
    regions = []
    for b in buckets:
        regions.append((layout.master[b.index], b.numel * 4))
        regions.append((layout.lowp[b.index], b.numel * 2))
        regions.append((layout.grad[b.index], b.trainable_numel * layout.grad_itemsize))
        for field in (layout.exp_avg, layout.exp_avg_sq):
            regions.append((field[b.index], b.trainable_numel * 4))
    return [r for r in regions if r[1] > 0], layout.total_bytes


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def maps() -> set[str]:
    return set(Path("/proc/self/maps").read_text().splitlines())


def steady_state_os_allocs(arena: HostArena, sizes: list[int], steps: int = 100) -> int:
    """Allocate and release one buffer per bucket-sized request each step (as a step's grad staging would);
    count memory-map entries that appear or change over ``steps`` steps after a warm-up of 5."""

    def step():
        offsets = [arena.allocate(s, 64) for s in sizes]
        for off in offsets:
            arena.release(off)

    for _ in range(5):
        step()
    before = maps()
    for _ in range(steps):
        step()
    return len(maps() - before)


def enough_ram(nbytes: int) -> tuple[bool, str]:
    avail = psutil.virtual_memory().available
    if nbytes * RAM_HEADROOM > avail:
        return False, f"needs {nbytes / GiB:.1f} GiB, {avail / GiB:.1f} GiB available"
    return True, ""


def mix_cases(model: str) -> list[dict]:
    regions, layout_bytes = bucket_regions(model)
    # A step's transient buffers come on top: grad staging for the 4 largest regions in flight.
    staging = sorted(size for _, size in regions)[-4:]
    sizes = [size for _, size in regions] + staging
    requested = sum(sizes)
    base = {"name": f"{model} bucket mix ({len(regions)} regions + {len(staging)} staging)",
            "requested_bytes": requested}
    out = [{**base, "impl": "pow2_rule", "reserved_bytes": sum(next_pow2(s) for s in sizes), "alloc_s": None,
            "steady_os_allocs": None, "status": "computed",
            "note": "each request rounded up to a power of two (torch's CachingHostAllocator rule)"}]
    out.append({**base, "impl": "torch_pinned", "reserved_bytes": None, "alloc_s": None, "steady_os_allocs": None,
                "status": "not run", "reason": "no CUDA device here: pinned allocation needs one"
                if not torch.cuda.is_available() else "this script does not measure it yet"})
    # The engine's arena: every region at its host_layout offset (64-byte aligned), plus room for the
    # staging buffers, which each step allocates and releases.
    arena_bytes = layout_bytes + sum(-(-s // 64) * 64 for s in staging)
    ok, why = enough_ram(arena_bytes)
    if not ok:
        out.append({**base, "impl": "offload", "reserved_bytes": None, "alloc_s": None, "steady_os_allocs": None,
                    "status": "not run", "reason": why})
        return out
    t0 = time.perf_counter()
    arena = HostArena(arena_bytes)
    alloc_s = time.perf_counter() - t0
    for offset, size in regions:
        arena.reserve(offset, size)
    steady = steady_state_os_allocs(arena, staging)
    out.append({**base, "impl": "offload", "reserved_bytes": arena.reserved_bytes, "alloc_s": round(alloc_s, 3),
                "steady_os_allocs": steady, "status": "ok", "touch_method": arena.touch_method,
                "arena_bytes": arena_bytes})
    del arena
    gc.collect()
    return out


def big_cases(nbytes: int, threads: int, rounds: int) -> list[dict]:
    """Map + back ``nbytes``, each variant ``rounds`` times, rounds interleaved (in a VM the first touch of
    guest memory the hypervisor has not backed yet is much slower than a later one: the times vary with
    what ran before, and the rounds show it)."""
    ok, why = enough_ram(nbytes)
    gib = f"{nbytes / GiB:.0f} GiB"
    variants = {f"{gib}, write, {threads} threads": ("offload", threads, False),
                f"{gib}, populate, {threads} threads": ("offload", threads, True),
                f"{gib}, write, 1 thread": ("offload", 1, False),
                f"{gib}, populate, 1 thread": ("offload", 1, True),
                f"{gib}, torch.empty + fill_(0), {torch.get_num_threads()} threads": ("torch_empty", 0, False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    methods: dict[str, str] = {}
    for _ in range(rounds if ok else 0):
        for name, (impl, t, populate) in variants.items():
            t0 = time.perf_counter()
            if impl == "offload":
                arena = HostArena(nbytes, t, populate=populate)
                times[name].append(time.perf_counter() - t0)
                methods[name] = arena.touch_method
                del arena
            else:
                x = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
                times[name].append(time.perf_counter() - t0)
                del x
            gc.collect()
    out = []
    for name, (impl, t, populate) in variants.items():
        case = {"name": name, "impl": impl, "requested_bytes": nbytes, "steady_os_allocs": None}
        if not ok:
            out.append({**case, "reserved_bytes": None, "alloc_s": None, "status": "not run", "reason": why})
            continue
        reserved = -(-nbytes // (2 << 20)) * (2 << 20) if impl == "offload" else nbytes
        out.append({**case, "reserved_bytes": reserved, "alloc_s": round(min(times[name]), 3), "status": "ok",
                    "alloc_s_rounds": [round(x, 3) for x in times[name]],
                    **({"touch_method": methods[name], "touch_threads": t} if impl == "offload" else
                       {"note": "pageable memory; torch's pinned allocation needs CUDA"})})
    out.append({"name": f"{gib}, torch.empty(pin_memory=True)", "impl": "torch_pinned", "requested_bytes": nbytes,
                "reserved_bytes": None, "alloc_s": None, "steady_os_allocs": None, "status": "not run",
                "reason": "no CUDA device here: pinned allocation needs one"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default="bert-large,gpt2-xl,gpt3-6.7b", help="offload.tools.presets names")
    ap.add_argument("--big-gib", type=float, default=8.0, help="size of the allocate+touch case")
    ap.add_argument("--threads", type=int, default=0, help="touch threads (0: every core)")
    ap.add_argument("--rounds", type=int, default=3, help="times each 8 GiB variant runs (alloc_s: the fastest)")
    args = ap.parse_args()
    console = Console(width=150)
    info = machine()
    describe(console, info)
    threads = args.threads or psutil.cpu_count(logical=True) or 1
    cases = []
    for model in args.models.split(","):
        cases.extend(mix_cases(model))
    cases.extend(big_cases(int(args.big_gib * GiB), threads, args.rounds))

    rows = []
    for c in cases:
        ratio = f"{c['reserved_bytes'] / c['requested_bytes']:.4f}" if c.get("reserved_bytes") else ""
        rows.append([c["name"], c["impl"], f"{c['requested_bytes'] / GiB:.3f}",
                     f"{c['reserved_bytes'] / GiB:.3f}" if c.get("reserved_bytes") else "", ratio,
                     "" if c["alloc_s"] is None else f"{c['alloc_s']:.2f}" + (
                         f" ({', '.join(f'{x:.2f}' for x in c['alloc_s_rounds'])})" if "alloc_s_rounds" in c else ""),
                     "" if c["steady_os_allocs"] is None else c["steady_os_allocs"],
                     c["status"] if c["status"] != "not run" else f"not run: {c['reason']}"])
    print_table("Host allocation", ["name", "impl", "requested GiB", "reserved GiB", "reserved/requested",
                                    "alloc+touch s (rounds)", "steady OS allocs/100 steps", "status"], rows, console)
    write_json(args.json, {"benchmark": "host_alloc", "machine": info, "load_average_after": machine()["load_average"],
                           "settings": {"bucket_bytes": BUCKET_BYTES, "touch_threads": threads,
                                        "big_bytes": int(args.big_gib * GiB), "rounds": args.rounds},
                           "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
