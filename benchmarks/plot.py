"""Results of ``vs_baselines.py`` and ``max_model.py`` -> PNG plots and a markdown table.

    python benchmarks/plot.py benchmarks/results/<date>-<gpu>/vs_baselines.json \\
        benchmarks/results/<date>-<gpu>/max_model.json --out benchmarks/results/<date>-<gpu>/

writes ``throughput_<model>.png`` (tokens/s against GPU budget, one line per system; runs that did not
work are marked at the bottom with their status), ``max_model.png`` (largest trainable params per system
and budget, with this engine's host-RAM bound) and ``results.md`` (the tables the README shows: every
figure comes from the JSON files named in it; derived ratios are computed here from those figures).
PNGs need matplotlib (``pip install -e .[bench]``); without it only ``results.md`` is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GOALS = {"zero_offload": 1.5, "zero3_offload": 1.84, "torchao": 1.2,  # issue 10: ours / baseline tokens/s
         "twinflow": 1.25}  # issue 18: ours / Twin-Flow's best ratio
BOUND_GOAL = 1.15
ORDER = ("offload", "offload_devopt", "zero_offload", "zero3_offload", "twinflow", "torchao", "torch", "gemini")


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(vs_baselines results, max_model results), each dict with its file name under ``_file``."""
    vs, mm = [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict):
            print(f"skipping {p}: not a vs_baselines.py or max_model.py result")
            continue
        data["_file"] = Path(p).name
        kind = data.get("benchmark")
        if kind == "vs_baselines" or "runs" in data:
            vs.append(data)
        if kind == "max_model" or "max_model" in data:
            mm.append(data)
        if not (kind in ("vs_baselines", "max_model") or "runs" in data or "max_model" in data):
            print(f"skipping {p}: not a vs_baselines.py or max_model.py result")
    if not (vs or mm):
        raise ValueError("none of the files is a vs_baselines.py or max_model.py result")
    return vs, mm


def gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB"


def params_str(n) -> str:
    return "-" if not n else f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def unit_of(budgets) -> tuple[float, str]:
    """Plot budgets in GiB, or MiB when they are all below 1 GiB (smoke runs)."""
    return (2**30, "GiB") if max(budgets) >= 2**30 else (2**20, "MiB")


def num(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def systems_in(runs: list[dict]) -> list[str]:
    seen = {r["system"] for r in runs}
    return [s for s in ORDER if s in seen] + sorted(seen - set(ORDER))


def machine_line(data: dict) -> str:
    m = data.get("machine", {})
    gpu = (m.get("gpu") or {}).get("name") or "no GPU (CPU device)"
    v = m.get("versions", {})
    return (f"{data['_file']}: {gpu}; {m.get('cpu')}, {m.get('logical_cpus')} CPUs, "
            f"{gib(m.get('host_ram_bytes'))} host RAM; torch {v.get('torch')}, CUDA {v.get('cuda')}, "
            f"deepspeed {v.get('deepspeed')}, torchao {v.get('torchao')}; commit {str(m.get('git_commit'))[:10]}; "
            f"{m.get('date')}" + ("; **smoke run (tiny models, not a benchmark)**" if data.get("smoke") else ""))


def label(r: dict) -> str:
    """A run's system, with Twin-Flow's ratio."""
    return r["system"] + (f" r={r['twinflow_ratio']:g}" if r.get("twinflow_ratio") is not None else "")


def case_runs(runs: list[dict], model: str, budget) -> dict[str, dict]:
    """Per system, the run of one case; for Twin-Flow's sweep, the best ratio (else its last run)."""
    by: dict[str, dict] = {}
    for r in runs:
        if r["model"] == model and r["budget_bytes"] == budget:
            kept = by.get(r["system"])
            if kept is None or not kept.get("twinflow_best"):
                by[r["system"]] = r
    return by


def vs_table(data: dict) -> list[str]:
    runs = data["runs"]
    systems = systems_in(runs)
    lines = ["| model | budget | " + " | ".join(f"{s} tokens/s" for s in systems) + " | offload step / bound |",
             "|---|---|" + "---|" * len(systems) + "---|"]
    cases = list(dict.fromkeys((r["model"], r["budget_bytes"]) for r in runs))
    for model, budget in cases:
        by = case_runs(runs, model, budget)
        cells = []
        for s in systems:
            r = by.get(s)
            cells.append("" if r is None else num(r["tokens_per_s"]) if r["ok"] else f"({r['status']})")
        o = by.get("offload") or {}
        ratio = o.get("step_over_bound")
        bound = (f"{ratio:.2f} ({(o.get('bound') or {}).get('limit')}-bound)" if ratio else "-")
        lines.append(f"| {model} | {gib(budget)} | " + " | ".join(cells) + f" | {bound} |")
    return lines


def speedups(data: dict) -> list[str]:
    """offload tokens/s over each baseline's, where both ran, against issue 10's goals."""
    runs = data["runs"]
    lines = ["| model | budget | baseline | offload / baseline | goal | met |", "|---|---|---|---|---|---|"]
    n = 0
    for o in (r for r in runs if r["system"] == "offload" and r["ok"]):
        for b in case_runs(runs, o["model"], o["budget_bytes"]).values():
            if b["system"] in ("offload", "offload_devopt"):  # ours: their own columns in the table
                continue
            goal = GOALS.get(b["system"])
            if b["ok"]:
                x = o["tokens_per_s"] / b["tokens_per_s"]
                met = "-" if goal is None else ("yes" if x >= goal else "no")
                lines.append(f"| {o['model']} | {gib(o['budget_bytes'])} | {label(b)} | {x:.2f}x | "
                             f"{'-' if goal is None else f'>= {goal}x'} | {met} |")
            else:
                lines.append(f"| {o['model']} | {gib(o['budget_bytes'])} | {label(b)} | baseline did not run "
                             f"({b['status']}) | {'-' if goal is None else f'>= {goal}x'} | - |")
            n += 1
    return lines if n else []


def failures(data: dict) -> list[str]:
    out = []
    for r in data["runs"]:
        if not r["ok"]:
            err = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
            out.append(f"- {r['model']} @ {gib(r['budget_bytes'])}, {label(r)}: **{r['status']}** {err}")
    return out


def mm_table(data: dict) -> list[str]:
    entries = data["max_model"]
    budgets = list(dict.fromkeys(m["budget_bytes"] for m in entries))
    systems = systems_in(entries)
    lines = ["| system | " + " | ".join(gib(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for s in systems:
        cells = []
        for b in budgets:
            m = next((m for m in entries if m["system"] == s and m["budget_bytes"] == b), None)
            if m is None:
                cells.append("")
            elif m["params"]:
                cells.append(f"{params_str(m['params'])} ({m['n_layer']} layers)" + (" capped" if m["capped"] else "")
                             + (" incomplete" if m["incomplete"] else ""))
            else:
                cells.append(f"none ({m['probes'][0]['status'] if m['probes'] else m.get('error')})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    b = data.get("host_ram_bound")
    if b:
        lines += ["", f"offload host-RAM bound: {gib(b['host_ram_bytes'])} / {b['bytes_per_param']:.2f} B/param = "
                      f"{params_str(b['params'])} params ({b['source']})."]
    return lines


def markdown(vs: list[dict], mm: list[dict]) -> str:
    lines = ["<!-- written by benchmarks/plot.py from the result files below; do not edit by hand -->", ""]
    for data in vs:
        s = data.get("settings", {})
        lines += [f"### Throughput at the same GPU budget ({data['_file']})", "", machine_line(data), "",
                  f"Median of {s.get('steps')} steps after {s.get('warmup')} warm-up; {s.get('dtype')}; "
                  f"activation checkpointing: {s.get('activation_checkpointing')}; budget: "
                  f"{s.get('budget_enforcement')}. A status in parentheses: the run did not work.", ""]
        lines += vs_table(data) + [""]
        sp = speedups(data)
        if sp:
            lines += ["offload's tokens/s over each baseline's (issue 10 goals):", ""] + sp + [""]
        f = failures(data)
        if f:
            lines += ["Runs that did not work:", ""] + f + [""]
    for data in mm:
        lines += [f"### Largest model trained at each GPU budget ({data['_file']})", "", machine_line(data), ""]
        lines += mm_table(data) + [""]
    return "\n".join(lines)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_throughput(data: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    runs = data["runs"]
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for budget in dict.fromkeys(r["budget_bytes"] for r in runs if r["model"] == model)
                for r in case_runs(runs, model, budget).values()]  # Twin-Flow: its best ratio
        scale, unit = unit_of([r["budget_bytes"] for r in mine])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in systems_in(mine):
            pts = sorted((r["budget_bytes"] / scale, r["tokens_per_s"]) for r in mine if r["system"] == s and r["ok"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        failed = [(r["budget_bytes"] / scale, r["system"], r["status"]) for r in mine if not r["ok"]]
        for x, s, st in failed:
            ax.plot([x], [0], marker="x", color="grey")
        ax.set_xlabel(f"GPU budget ({unit})")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{model}: throughput at the same GPU budget" + (" (smoke)" if data.get("smoke") else ""))
        ax.set_ylim(bottom=0)
        if failed:
            ax.text(0.01, 0.01, f"x: {len(failed)} runs did not work (see results.md)", transform=ax.transAxes,
                    fontsize=8, color="grey")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"throughput_{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_max_model(data: dict, out: Path, name: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = data["max_model"]
    budgets = list(dict.fromkeys(m["budget_bytes"] for m in entries))
    systems = systems_in(entries)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs, ys = [], []
        for j, b in enumerate(budgets):
            m = next((m for m in entries if m["system"] == s and m["budget_bytes"] == b), None)
            if m is not None:
                xs.append(j + i * width)
                ys.append((m["params"] or 0) / 1e9)
        ax.bar(xs, ys, width, label=s)
    bound = data.get("host_ram_bound")
    if bound:
        ax.axhline(bound["params"] / 1e9, color="black", linestyle="--", label="offload host-RAM bound")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(budgets))], [gib(b) for b in budgets])
    ax.set_xlabel("GPU budget")
    ax.set_ylabel("largest trainable model (B params)")
    ax.set_title("largest model per system" + (" (smoke)" if data.get("smoke") else ""))
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON files written by vs_baselines.py / max_model.py")
    ap.add_argument("--out", required=True, help="folder for the PNGs and results.md")
    ap.add_argument("--no-png", action="store_true", help="only the markdown table")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        vs, mm = load(args.results)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        ap.error(str(e))
    (out / "results.md").write_text(markdown(vs, mm) + "\n")
    print(f"wrote {out / 'results.md'}")
    if args.no_png:
        return 0
    if not have_matplotlib():
        print("matplotlib is not installed: no PNGs (pip install -e '.[bench]'); results.md is complete")
        return 0
    for data in vs:
        for p in plot_throughput(data, out):
            print(f"wrote {p}")
    for k, data in enumerate(mm):
        print(f"wrote {plot_max_model(data, out, 'max_model.png' if k == 0 else f'max_model_{k}.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
