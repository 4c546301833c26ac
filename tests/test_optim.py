"""offload.AdamW's own refusals, each a specific OffloadError: fused=True without the C++ kernel, and one
optimizer bound to a second engine."""

import pytest
from torch import nn

import offload.optim
from offload.errors import KernelUnavailableError, OptimizerBoundError


def test_fused_without_the_kernel_is_kernel_unavailable(monkeypatch):
    monkeypatch.setattr(offload.optim, "KERNEL_AVAILABLE", False)
    with pytest.raises(KernelUnavailableError, match="fused=None"):
        offload.optim.AdamW(nn.Linear(2, 2).parameters(), fused=True)


def test_binding_twice_is_optimizer_bound():
    opt = offload.optim.AdamW(nn.Linear(2, 2).parameters())
    opt._bind(object())  # what offload.wrap does
    with pytest.raises(OptimizerBoundError, match="one optimizer per engine"):
        opt._bind(object())
    opt._unbind()
    opt._bind(object())  # free again once unbound
