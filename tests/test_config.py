"""Configuration parsing and validation."""

import dataclasses
import math

import pytest
import torch

import offload
from offload import OffloadConfig, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("64MiB", 64 * 2**20), ("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("512KiB", 512 * 1024),
    ("1048576", 1048576), (" 2 gib ", 2 * 2**30), ("3M", 3 * 2**20), (4096, 4096), ("1e3", 1000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "", "GiB", "-1GiB", "1.2.3MiB", "0", 0, -5, math.nan, math.inf, 1.5,
                                 # beyond any float: int(float("1e400")) was an OverflowError (issue 21, 2.9)
                                 "1e400", "1e400GiB", "1e309", "9e307TiB", "inf", "-inf", "nan", "infinity",
                                 "-1e400", "1e-400", "0.4", -math.inf,
                                 # finite but beyond int64, which the C++ core's sizes are
                                 "1e300", "8388608TiB", "9223372036854775808", 2**63, float(2**64)])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError) as e:
        parse_bytes(bad, "budget")
    assert "budget" in str(e.value)


def test_parse_bytes_largest():
    assert parse_bytes(2**63 - 1) == parse_bytes("9223372036854775807") == 2**63 - 1


@pytest.mark.parametrize("bad", [True, None, [1], torch.tensor(3)])
def test_parse_bytes_rejects_types(bad):
    with pytest.raises(TypeError):
        parse_bytes(bad)


def test_config_normalises_and_is_frozen():
    c = OffloadConfig(budget="1MiB", device="cpu", bucket_bytes="64KiB")
    assert c.budget == 2**20 and c.bucket_bytes == 2**16 and c.device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.budget = 3


def test_config_resolves_optimizer_overlap_by_dtype():
    assert OffloadConfig(budget="1GiB").overlap_optimizer is True
    assert OffloadConfig(budget="1GiB", dtype=torch.bfloat16).overlap_optimizer is True
    half = OffloadConfig(budget="1GiB", dtype=torch.float16)
    assert half.overlap_optimizer is False and half.loss_scale == offload.LossScaleConfig()
    assert OffloadConfig(budget="1GiB", overlap_optimizer=False).loss_scale is None
    # a loss scale with another dtype: its updates unscale and may skip, so they wait for step() (overlapped
    # updates never unscaled: bf16 trained on grads 1024x too large, silently)
    scaled = OffloadConfig(budget="1GiB", dtype=torch.bfloat16, loss_scale=offload.LossScaleConfig())
    assert scaled.overlap_optimizer is False


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="not supported"):
        OffloadConfig(budget="1GiB", dtype=torch.float64)
    with pytest.raises(ValueError, match="float16"):
        OffloadConfig(budget="1GiB", dtype=torch.float16, overlap_optimizer=True)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(ValueError, match="cannot be used with loss_scale"):
            OffloadConfig(budget="1GiB", dtype=dtype, overlap_optimizer=True, loss_scale=offload.LossScaleConfig())
    with pytest.raises(TypeError, match="LossScaleConfig"):
        OffloadConfig(budget="1GiB", dtype=torch.float16, loss_scale=2.0)
    with pytest.raises(ValueError, match="backoff"):
        offload.LossScaleConfig(backoff_factor=2.0)
    with pytest.raises(TypeError):
        OffloadConfig(budget="1GiB", dtype="float32")
    with pytest.raises(ValueError, match="cpu or cuda"):
        OffloadConfig(budget="1GiB", device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="is_available"):
            OffloadConfig(budget="1GiB", device="cuda")


def test_default_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert OffloadConfig(budget=1024).device.type == expected


def test_format_bytes():
    assert offload.format_bytes(1536) == "1.50 KiB"
    assert offload.format_bytes(12) == "12 B"


def test_config_hw_takes_a_model_a_preset_or_a_probe_file(tmp_path):
    import json
    from dataclasses import replace

    from offload.planning.hw import PRESETS
    assert OffloadConfig(budget="1GiB").hw is None  # the scheduler's default (pcie4)
    assert OffloadConfig(budget="1GiB", hw="pcie5").hw == PRESETS["pcie5"]
    measured = replace(PRESETS["pcie4"], name="probe (test)", adam_params_per_s=1.5e8, measured=True)
    assert OffloadConfig(budget="1GiB", hw=measured).hw is measured
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"hardware_model": measured.to_dict()}))
    assert OffloadConfig(budget="1GiB", hw=path).hw == measured
    assert OffloadConfig(budget="1GiB", hw=str(path)).hw == measured
    with pytest.raises(ValueError, match="pcie4"):
        OffloadConfig(budget="1GiB", hw="pcie9")
    with pytest.raises(ValueError, match="offload probe"):
        (tmp_path / "bad.json").write_text("{}")
        OffloadConfig(budget="1GiB", hw=tmp_path / "bad.json")
    with pytest.raises(TypeError, match="HardwareModel"):
        OffloadConfig(budget="1GiB", hw=3)


def test_chaos_is_no_engine_option():
    """Chaos mode is test support (offload.testing.chaos), turned on through the backend factory
    (``offload.backend.make_backend(device, chaos=...)``): no config field, no top-level name."""
    from torch import nn
    assert "chaos" not in OffloadConfig.field_names()
    assert not hasattr(offload, "ChaosConfig") and "ChaosConfig" not in offload.__all__
    with pytest.raises(TypeError, match="chaos"):
        OffloadConfig(budget="1GiB", chaos=None)
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="unknown option"):
        offload.wrap(model, offload.AdamW(model.parameters()), budget="1MiB", device="cpu", chaos=None)
