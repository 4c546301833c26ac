"""Shared test setup: the example's GPT importable as `gpt`, tests/support/models.py as `models`, fixed seeds, and the
`device` fixture that runs a test on the CPU backend and (marked `gpu`, skipped without CUDA) on CUDA."""

import functools
import os
import random

import pytest
import torch

# The `hf` tests build transformers models from configs: nothing may be downloaded, ever.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


# The CPU backend's copies all go through their lane threads in the test suite ([Note: inline copies] in
# offload/backend/cpu.py): a copy that runs late on its thread is what exposes a missing wait as wrong numbers,
# and the thread-count checks (leaks, faults, close) count those threads. Users get the default, "inline";
# tests/backend/test_inline_copies.py trains in that mode against plain torch.
os.environ.setdefault("OFFLOAD_CPU_COPIES", "lanes")

# [Note: the suite's intra-op threads] The reference and the engine run in this process with the same intra-op thread
# count, so results do not depend on it. The suite runs with one (SUITE_THREADS): the test models' ops are so small
# that torch's OpenMP threads meeting at every op cost far more than they share, worst beside the engine's copy and
# optimizer threads on a 2-core machine (under load ~2.2-3.8, two threads against one: test_numerics.py 150 s of wall
# against 32 s; test_integrations_hf.py, test_hf.py, test_training.py and test_recompute.py 144 s against 45-48 s;
# engine-bound files with tiny models about the same, within the load's noise). What one thread stops exercising is
# torch's pool (and the fused C++ AdamW, which takes torch's count on the AdamW lane) running beside the engine's
# threads; tests about threads keep that, at THREADED_THREADS: those marked `intra_op_threads` (all of tests/host/,
# test_chaos.py, test_leaks.py and the tests of the lanes' threads) and every `gpu` test (its timings and the host
# AdamW's speed are measured as a user's run would have them).
SUITE_THREADS = 1
THREADED_THREADS = min(4, os.cpu_count() or 1)
torch.set_num_threads(SUITE_THREADS)


@pytest.fixture(autouse=True)
def intra_op_threads(request):
    """torch's intra-op thread count for this test: [Note: the suite's intra-op threads]."""
    wanted = request.node.get_closest_marker("intra_op_threads") or request.node.get_closest_marker("gpu")
    threads = THREADED_THREADS if wanted else SUITE_THREADS
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    yield
    if torch.get_num_threads() != SUITE_THREADS:
        torch.set_num_threads(SUITE_THREADS)


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Every test starts from the same global RNG state, whatever ran before it. Test models and batches
    use their own generators anyway (tests/support/models.py); this catches anything that does not."""
    random.seed(0)
    torch.manual_seed(0)


@functools.cache
def _warm_cuda() -> None:
    """Create, before any engine measures its device peak, what the process keeps for good on first use: the
    CUDA context and cuBLAS/cuBLASLt workspaces (per thread and stream, so one forward on this thread and one
    backward on autograd's device thread)."""
    layer = torch.nn.Linear(8, 8, device="cuda")
    layer(torch.randn(4, 8, device="cuda", requires_grad=True)).sum().backward()
    torch.cuda.synchronize()


@pytest.fixture
def cuda_warm():
    """For GPU tests that measure device memory: see _warm_cuda. The allocator's peak is reset too: an engine
    never resets it (it is process-wide) but measures its peak from its own base, which an earlier test's
    larger peak would otherwise dominate (see [Note: peaks] in offload/backend/cuda.py)."""
    _warm_cuda()
    torch.cuda.reset_peak_memory_stats()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The device a test trains on: the CPU backend, or CUDA (marked `gpu`; skipped without CUDA). On CUDA
    TF32 is off and cuDNN deterministic, so fp32 means fp32 for the reference and the engine alike."""
    if request.param == "cpu":
        yield torch.device("cpu")
        return
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default; a test that changed it must restore it
    # Matmuls are fp32 (IEEE) by default already; cuDNN convolutions default to TF32. Only the one legacy flag
    # is set: mixing it with the newer fp32_precision API makes torch raise.
    flags = (torch.backends.cudnn, "allow_tf32"), (torch.backends.cudnn, "benchmark"), \
        (torch.backends.cudnn, "deterministic")
    saved = [getattr(obj, name) for obj, name in flags]
    for (obj, name), value in zip(flags, (False, False, True)):
        setattr(obj, name, value)
    _warm_cuda()
    torch.cuda.reset_peak_memory_stats()  # as cuda_warm does
    try:
        yield torch.device("cuda", torch.cuda.current_device())
    finally:
        for (obj, name), value in zip(flags, saved):
            setattr(obj, name, value)


# -- the GPU run (benchmarks/gpu_check.sh) ------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, every `gpu` test goes to one worker (xdist's `loadgroup`), so GPU tests run one at a
    time and their timings and device peaks are not disturbed by each other; the CPU tests spread over the rest."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.xdist_group("gpu"))


_GPU_LOG = {"path": None}


def pytest_configure(config):
    # Written where the reports are gathered: by the controller under xdist (its workers report to it), else here.
    if not hasattr(config, "workerinput"):
        _GPU_LOG["path"] = os.environ.get("OFFLOAD_GPU_LOG")


def pytest_runtest_logreport(report):
    """With OFFLOAD_GPU_LOG set (gpu_check.sh sets it), each `gpu` test's outcome, time and printed figures are
    appended to that file: the GPU tests' own log, also when they ran on an xdist worker (this hook runs where
    the reports are gathered, and a report's keywords carry its markers)."""
    path = _GPU_LOG["path"]
    if not path or "gpu" not in report.keywords:
        return
    if report.when != "call" and report.passed:
        return  # setup and teardown that passed say nothing
    lines = [f"{report.outcome.upper():8s} {report.nodeid} ({report.when}, {report.duration:.2f} s)"]
    if report.skipped and isinstance(report.longrepr, tuple):
        lines.append(f"    reason: {report.longrepr[2]}")
    if report.capstdout:
        lines += ["    " + line for line in report.capstdout.rstrip().splitlines()]
    if report.failed:
        lines += ["    " + line for line in str(report.longrepr).splitlines()[-30:]]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
