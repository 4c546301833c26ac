"""The command line, driven as a subprocess."""

import json
import subprocess
import sys


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "offload", *args], capture_output=True, text=True, timeout=timeout)


def test_probe_without_cuda_says_pcie_was_not_measured(tmp_path):
    out = tmp_path / "probe.json"
    r = _run("probe", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "CPU AdamW" in r.stdout
    data = json.loads(out.read_text())
    assert data["cpu_adam_params_per_s"] > 0 and data["host_bytes_per_s"] > 0
    assert "collectives" not in data  # no process group: nothing about collectives (issue 20)
    from offload.host.cpu_adam import KERNEL_AVAILABLE
    assert data["cpu_adam_impl"].startswith("fused C++") == KERNEL_AVAILABLE  # the engine's own update
    if not data["cuda"]:
        assert "not measured" in r.stdout and data["pcie"] is None
        assert data["hardware_model"]["measured"] is False
    from offload.planning.hw import load_hw
    assert load_hw(out).adam_params_per_s == data["cpu_adam_params_per_s"]


def test_unknown_command_is_a_usage_error():
    r = _run("bogus")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_probe_times_both_update_paths():
    import pytest

    from offload.errors import KernelUnavailableError
    from offload.host.cpu_adam import KERNEL_AVAILABLE
    from offload.tools.probe import cpu_adam_params_per_s
    assert cpu_adam_params_per_s(1 << 14, repeat=1, fused=False) > 0
    if KERNEL_AVAILABLE:
        assert cpu_adam_params_per_s(1 << 14, repeat=1, fused=True) > 0
    else:
        with pytest.raises(KernelUnavailableError, match="kernel"):
            cpu_adam_params_per_s(1 << 14, repeat=1, fused=True)


def test_probe_refuses_fused_without_the_kernel(monkeypatch):
    import pytest

    import offload.tools.probe
    from offload.errors import KernelUnavailableError
    monkeypatch.setattr(offload.tools.probe, "KERNEL_AVAILABLE", False)
    with pytest.raises(KernelUnavailableError, match="fused=False"):
        offload.tools.probe.cpu_adam_params_per_s(1 << 14, repeat=1, fused=True)


def test_probe_suggests_the_bucket_size_auto_picks_with_its_hardware_model(monkeypatch):
    """Issue 18: the probe's suggested bucket size is the one ``bucket_bytes="auto"`` picks from the hardware model
    the probe writes (a model large enough that the 1/8-of-the-weights cap does not bind), on the curve, not the
    nearest measured size above it (which the pcie4 preset's 4 MiB point was, for 2.54 MiB)."""
    import offload.tools.probe as probe
    from offload.planning.buckets import ParamSpec, auto_bucket_bytes
    from offload.planning.hw import PRESETS
    monkeypatch.setattr(probe, "cpu_adam_params_per_s", lambda: 1e9)  # the measurements play no part here
    monkeypatch.setattr(probe, "host_bytes_per_s", lambda: 1e10)
    result = probe.probe()
    hw = probe.hardware_from_probe(result)
    big = [ParamSpec(2**30, 0)] * 4
    assert result["bucket_bytes_hint"] == auto_bucket_bytes(big, 2, hw) == auto_bucket_bytes(big, 4, hw)
    for preset in PRESETS.values():
        assert probe.suggested_bucket_bytes(preset) == auto_bucket_bytes(big, 2, preset)
    if not result["cuda"]:
        assert result["bucket_bytes_hint"] < PRESETS["pcie4"].bucket_bytes_hint()
