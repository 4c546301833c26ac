"""Bad input gets a clear error, raised before anything is half-done."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import offload


def _mlp(n=8, width=32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        offload.wrap(lambda x: x, offload.AdamW([nn.Parameter(torch.ones(1))]), budget="1MiB")


def test_empty_model():
    class Empty(nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(ValueError):  # torch refuses an optimizer with no params; the engine a model with none
        offload.wrap(Empty(), offload.AdamW([nn.Parameter(torch.ones(1))]), budget="1MiB", device="cpu")


@pytest.mark.parametrize("budget", ["12 parsecs", 0, -1, float("nan"), "", "1.5 floppies", "1e400", "1e400GiB",
                                    float("inf"), "-8GiB"])
def test_bad_budget(budget):
    m = _mlp()
    with pytest.raises(ValueError) as e:
        offload.wrap(m, offload.AdamW(m.parameters()), budget=budget, device="cpu")
    assert "budget" in str(e.value)


def test_missing_budget_and_unknown_option():
    m = _mlp()
    with pytest.raises(TypeError, match="budget"):
        offload.wrap(m, offload.AdamW(m.parameters()), device="cpu")
    with pytest.raises(TypeError, match="unknown option"):
        offload.wrap(m, offload.AdamW(m.parameters()), budget="1MiB", buget="2MiB")


def test_wrong_optimizer():
    m = _mlp()
    with pytest.raises(TypeError, match="offload.AdamW"):
        offload.wrap(m, torch.optim.AdamW(m.parameters()), budget="1MiB", device="cpu")


def test_optimizer_must_cover_trainable_params_only_of_this_model():
    m, other = _mlp(), _mlp()
    with pytest.raises(ValueError, match="not in the optimizer"):
        offload.wrap(m, offload.AdamW(list(m.parameters())[:2]), budget="1MiB", device="cpu")
    with pytest.raises(ValueError, match="not in the model"):
        offload.wrap(m, offload.AdamW(list(m.parameters()) + list(other.parameters())), budget="1MiB", device="cpu")


def test_wrapping_twice():
    m = _mlp()
    engine = offload.wrap(m, offload.AdamW(m.parameters()), budget="1MiB", device="cpu")
    with pytest.raises(RuntimeError, match="already wrapped"):
        offload.wrap(m, offload.AdamW(m.parameters()), budget="1MiB", device="cpu")
    with pytest.raises(RuntimeError, match="already wrapped"):  # a part of it, too
        offload.wrap(m[0], offload.AdamW(m[0].parameters()), budget="1MiB", device="cpu")
    engine.close()


def test_same_optimizer_twice():
    m1, m2 = _mlp(), _mlp()
    opt = offload.AdamW(m1.parameters())
    offload.wrap(m1, opt, budget="1MiB", device="cpu")
    with pytest.raises(RuntimeError, match="already bound|not in the model"):
        offload.wrap(m2, opt, budget="1MiB", device="cpu")


def test_bad_hyperparameters():
    m = _mlp()
    with pytest.raises(ValueError, match="learning rate"):
        offload.AdamW(m.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        offload.AdamW(m.parameters(), betas=(0.9, 1.0))


def test_budget_too_small_leaves_model_intact():
    m = _mlp()
    before = copy.deepcopy(m.state_dict())
    engine = offload.wrap(m, offload.AdamW(m.parameters()), budget="2KiB", device="cpu")
    with pytest.raises(offload.BudgetTooSmallError) as e:
        engine(torch.randn(2, 32))
    err = e.value
    assert err.min_budget_bytes > 2048 and err.budget_bytes == 2048
    assert "Try budget>=" in str(err) and err.breakdown
    for name, value in m.state_dict().items():  # nothing was moved or lost
        assert torch.equal(value, before[name])
    assert engine.memory_stats()["host_pinned_bytes"] == 0  # host arena never allocated
    engine.close()
    # the minimum it named really is enough
    engine = offload.wrap(m, offload.AdamW(m.parameters()), budget=err.min_budget_bytes, device="cpu")
    engine(torch.randn(2, 32)).sum().backward()
    engine.step()
    assert engine.memory_stats()["device_peak_bytes"] <= err.min_budget_bytes


def test_host_ram_too_small(monkeypatch):
    import offload.host.state as host
    m = _mlp()
    engine = offload.wrap(m, offload.AdamW(m.parameters()), budget="1MiB", device="cpu")
    monkeypatch.setattr(host.psutil, "virtual_memory", lambda: SimpleNamespace(available=1000))
    with pytest.raises(offload.HostMemoryError, match="host arena needs"):
        engine(torch.randn(2, 32))
    assert engine.memory_stats()["host_pinned_bytes"] == 0
    monkeypatch.undo()
    engine(torch.randn(2, 32)).sum().backward()  # usable once RAM is there
    engine.step()


def test_params_must_start_on_cpu_and_be_fp32():
    m = _mlp()
    m[0].weight = nn.Parameter(m[0].weight.detach().to(torch.float64))
    with pytest.raises(TypeError, match="float32"):
        offload.wrap(m, offload.AdamW(m.parameters()), budget="1MiB", device="cpu")
    q = _mlp()
    q[0].weight = nn.Parameter(torch.zeros(32, 32, device="meta"))
    with pytest.raises(ValueError, match="on the CPU"):
        offload.wrap(q, offload.AdamW(q.parameters()), budget="1MiB", device="cpu")

