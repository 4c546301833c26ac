"""The parent side of the baseline benchmarks: run one system in a child process (``bench_systems.py``)
with a timeout, keep its peak host RSS (``wait4``'s rusage, which survives an OOM kill), its log and its
result; describe the machine (GPU, driver, versions, host RAM, the exact command)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
CHILD = HERE / "bench_systems.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_systems import PACKAGE, precheck, resident_bytes_per_param  # noqa: E402
from common import cpu_model  # noqa: E402

from offload.config import format_bytes  # noqa: E402

LOG_TAIL = 3000  # characters of a failed child's output kept in the result


def run_child(spec: dict, timeout_s: float, log_path: Path | None = None) -> dict:
    """Run ``spec`` in a fresh Python process; always returns a result (status ``crashed`` or ``timeout``
    when the child could not write one). ``peak_host_bytes`` is the child's own peak RSS."""
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as d:
        result_path, log = Path(d) / "result.json", Path(d) / "log.txt"
        t0 = time.perf_counter()
        with open(log, "wb") as logf:
            proc = subprocess.Popen([sys.executable, str(CHILD), json.dumps(spec), str(result_path)],
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = threading.Event()

            def kill():
                timed_out.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: DeepSpeed's build jobs go too
                except ProcessLookupError:
                    pass

            timer = threading.Timer(timeout_s, kill)
            timer.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, log_path)
        if result_path.exists():
            out = json.loads(result_path.read_text())
        else:
            rc = proc.returncode
            how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            out = {"ok": False, "status": "timeout" if timed_out.is_set() else "crashed",
                   "error": (f"timed out after {timeout_s:.0f} s" if timed_out.is_set()
                             else f"the child process ended without a result ({how})")}
        out["peak_host_bytes"] = usage.ru_maxrss * 1024  # Linux reports KiB
        out["wall_s"] = wall
        if not out.get("ok"):
            out["log_tail"] = text[-LOG_TAIL:]
        return out


def not_startable(spec: dict, params: int, skip_cannot_fit: bool = True) -> dict | None:
    """A result for a run that is certain not to work, without starting a process: its package is missing,
    it does not run on this device, or (``skip_cannot_fit``) its resident params alone exceed the budget."""
    pre = precheck(spec)
    if pre is not None:
        return {"ok": False, "status": pre[0], "error": pre[1]}
    reason = (cannot_fit(spec["system"], params, spec.get("budget_bytes"), spec.get("twinflow_ratio"))
              if skip_cannot_fit else None)
    return {"ok": False, "status": "skipped", "error": reason} if reason else None


def cannot_fit(system: str, params: int, budget: int | None, ratio: float | None = None) -> str | None:
    """The reason a run certainly cannot fit the budget (its resident params alone exceed it), else None.
    ``ratio``: Twin-Flow's offloaded fraction (system "twinflow")."""
    per = resident_bytes_per_param(system, ratio)
    if per is None or budget is None or per * params <= budget:
        return None
    what = f"{system} at ratio {ratio}" if system == "twinflow" else system
    return (f"cannot fit: {what} keeps {per:g} B/param on the GPU, {format_bytes(per * params)} for "
            f"{params:,} params > budget {format_bytes(budget)}; not run")


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("offload", *sorted(set(PACKAGE.values())), "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def machine() -> dict:
    """The machine this ran on: CPU, RAM, GPU, driver, PCIe link, versions, commit, load, command."""
    vm = psutil.virtual_memory()
    info = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": cpu_model(), "logical_cpus": os.cpu_count(), "host_ram_bytes": vm.total,
        "host_ram_available_bytes": vm.available, "kernel": platform.release(),
        "load_average": list(os.getloadavg()), "versions": versions(),
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain")),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        # the host threads the CPU AdamW lane runs on (torch's count) and what sets them or their idling
        "torch_threads": torch.get_num_threads(),
        "omp_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ},
        "gpu": None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_bytes": p.total_memory, "count": torch.cuda.device_count(),
                       "nvidia_smi": _nvidia_smi()}
    return info


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=HERE, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nvidia_smi() -> str | None:
    q = "name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None


def size_label(n: int) -> str:
    """A budget for file names: 8GiB, 768KiB, 1000B."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n % 2**k == 0:
            return f"{n >> k}{unit}"
    return f"{n}B"


def gib(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def write_json(path: str | None, payload: dict) -> None:
    """Write atomically (the suite rewrites its file after every run, so a kill leaves a readable one)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, p)
