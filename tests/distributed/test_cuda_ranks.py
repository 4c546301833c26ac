"""Data parallel on CUDA with one GPU (issue 20): two spawned ranks share cuda:0, against one process.

[Note: data parallel on one GPU]
A lease lends ONE GPU, and NCCL refuses two ranks on one device, so the data-parallel path had never run on
CUDA. Two processes may still share cuda:0, each an engine on the CUDA backend, in a gloo group:

- ``grad_reduce="host"``: every collective on host tensors, as in production, with the node's shared host copy
  (a /dev/shm mapping that the CUDA backend pins with cudaHostRegister: [Note: one host copy per node]) and
  with each rank's own copy (``share_host_copy=False``).
- ``grad_reduce="device"``: the device groups are gloo instead of NCCL (``DeviceGroup.CUDA_BACKEND``, set in
  the spawned ranks only: workers.py's ``_one_gpu``). gloo moves CUDA tensors through pinned host buffers on
  streams of its own, ordered after the issuing stream (the backend's collective streams) and before it again;
  its reduce-scatter is an all-reduce of a copy of the slot. So this runs the device path's CUDA side for real:
  the collective streams and their events, the CPU lane's thread issuing the weights' all-gathers, the gather
  buffers ([Note: weights gathered on the device]), the resident buckets' refresh in their slots ([Note:
  resident weights gathered in their slots]), with real CUDA ordering. What it does not run: NCCL itself
  (its kernels, its communicators, two of them active at once), and the sums' own bits (gloo adds on the host).

The same test body runs on the CPU backend (its non-``gpu`` variant, in the default run), so only the device
differs. fp32, two ranks: bit for bit the reference (workers.py ``reference``), whose grads are computed on the
same device and whose AdamW runs on the CPU, as the engine's. Each rank's device peak within its budget (on CUDA
64 MiB for the plan plus the headroom the rank's backend measures: tests/support/budgets.py); the
collectives' tensors were on the device the mode says. Bounded: a 2.6k-parameter model, four steps (the traced
one, planned ones, fast ones), ranks killed after ``RANKS_TIMEOUT_S``; about 10-20 s a test on the GPU machine
(two processes importing torch and making a CUDA context each; not measured yet: no lease has run them).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_data_parallel import _assert_host_bytes, _assert_weights, _ok
from tests.distributed.test_device_reduce import _assert_device_path
from tests.distributed.workers import Case, reference, run_ranks

MODES = {
    "host-shared": {"grad_reduce": "host"},
    "host-own": {"grad_reduce": "host", "share_host_copy": False},
    "device-shared": {"grad_reduce": "device"},
    "device-gathered": {"grad_reduce": "device", "share_host_copy": False},
}
BUDGET = 64 << 20  # for the plan (each rank adds its CUDA headroom: workers.py): every bucket resident
# the ranks' whole run (spawn, imports, CUDA context, four steps); gpu_lease.sh gives each test 75 s and the
# four CUDA ones 120 s in all (DP_TEST_DEADLINE)
RANKS_TIMEOUT_S = {"cpu": 120.0, "cuda": 60.0}
# the default run keeps one CPU variant (~12 s on two cores); the others are the CUDA variants' body on the CPU,
# covered by test_data_parallel.py and test_device_reduce.py as well: -m slow
SLOW_ON_CPU = ("host-shared", "host-own", "device-shared")


def _cases():
    for mode in MODES:  # conftest's `device` fixture, given its device: the CUDA one marked `gpu`, skipped without
        yield pytest.param("cuda", mode, marks=pytest.mark.gpu, id=f"cuda-{mode}")
    for mode in MODES:
        yield pytest.param("cpu", mode, marks=[pytest.mark.slow] if mode in SLOW_ON_CPU else [], id=f"cpu-{mode}")


@pytest.mark.parametrize(("device", "mode"), list(_cases()), indirect=["device"])
def test_two_ranks_on_one_device_equal_one_process(tmp_path, device, mode):
    """fp32, four steps: bit for bit the ranks' summed grads in plain PyTorch on this device; each rank's device
    peak within the budget; the collectives' tensors where the mode puts them (the device path's reduce-scatters
    and all-gathers, the refresh's among them, on the device; the host path's all on the host)."""
    case = Case(world=2, steps=4, device=device.type, extra={**MODES[mode], "budget": BUDGET})
    results = _ok(run_ranks(case, tmp_path, timeout_s=RANKS_TIMEOUT_S[device.type]))
    exact = reference(case, emulate_ranks=True)
    on_device = MODES[mode]["grad_reduce"] == "device"
    for r in results:
        diff = max(float((r["weights"][k] - v).abs().max()) for k, v in exact["weights"].items())
        print(f"rank {r['rank']} {mode} on {device.type}: device peak {r['device_peak_bytes']} B (budget "
              f"{r['budget_bytes']} B: {BUDGET} for the plan + the CUDA headroom), "
              f"host {r['host_bytes']} B + shared {r['host_shared_bytes']} B, max |diff| {diff:.3g}, "
              f"collectives {r['collective_devices']}")
        assert r["backend"] == ("CUDABackend" if device.type == "cuda" else "CPUBackend"), r["backend"]
        assert 0 < r["device_peak_bytes"] <= r["budget_bytes"]
        kinds = {kind for _, kind in r["collective_devices"]}
        if on_device:  # the grads' sums, the refresh's gathers (and, with own copies, the weights') on the device
            assert ("_reduce_scatter", device.type) in r["collective_devices"], r["collective_devices"]
            assert ("_all_gather", device.type) in r["collective_devices"], r["collective_devices"]
            _assert_device_path(r, case, 4, r["budget_bytes"])
        else:  # every collective on host tensors; each rank 1/N of the host state
            assert kinds == {"cpu"}, r["collective_devices"]
            assert r["counters"]["refresh_gathers"] == 0
            _assert_host_bytes(r, case.world, accumulate=False, shared="share_host_copy" not in MODES[mode])
    for r in results:  # last, so that a numerics failure does not hide the checks above (max |diff| printed)
        _assert_weights(r["weights"], exact["weights"])


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu),
                                    pytest.param("cpu", marks=pytest.mark.slow)], indirect=True)
def test_bfloat16_on_one_device_reduced_on_the_device_is_the_host_path(tmp_path, device):
    """bf16 with the fused AdamW, as users train: the device path's sums (gloo's, of the bf16 slots) are the host
    path's (gloo's, of the bf16 grads copied to the host), two addends, one rounding either way: the two paths
    train the very same model, bit for bit (test_device_reduce.py's bf16 test, on this device)."""
    runs = {}
    for mode in ("host", "device"):
        case = Case(world=2, dtype=torch.bfloat16, fused=True, device=device.type,
                    extra={"grad_reduce": mode, "budget": BUDGET})
        runs[mode] = _ok(run_ranks(case, tmp_path / mode, timeout_s=RANKS_TIMEOUT_S[device.type]))
    for host, dev in zip(runs["host"], runs["device"]):
        print(f"rank {host['rank']} bf16 on {device.type}: device peak {dev['device_peak_bytes']} B (budget "
              f"{dev['budget_bytes']} B), host path's {host['device_peak_bytes']} B")
        assert dev["backend"] == host["backend"] == ("CUDABackend" if device.type == "cuda" else "CPUBackend")
        assert ("_reduce_scatter", device.type) in dev["collective_devices"], dev["collective_devices"]
        _assert_device_path(dev, case, 2, dev["budget_bytes"])
        assert 0 < host["device_peak_bytes"] <= host["budget_bytes"]
        _assert_weights(dev["weights"], host["weights"])
        _assert_weights(dev["weights"], runs["device"][0]["weights"])
