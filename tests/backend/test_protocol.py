"""Both backends implement the Backend protocol (offload/backend/base.py): every member the runtime calls,
with the protocol's parameters, so that code typed against ``Backend`` runs on either."""

import inspect

import pytest
import torch

from offload.backend import Backend, CPUBackend, CUDABackend
from tests.support.fake_cuda import FakeCuda

METHODS = sorted(name for name in vars(Backend) if not name.startswith("_"))
MEMBERS = METHODS + sorted(Backend.__annotations__)  # the data members: device


def _cuda_backend():
    sim = FakeCuda()
    return CUDABackend(sim.device, api=sim)


@pytest.mark.parametrize("make", [CPUBackend, _cuda_backend], ids=["cpu", "cuda"])
def test_backend_conforms_to_the_protocol(make):
    backend = make()
    try:
        assert isinstance(backend, Backend)
        assert isinstance(backend.device, torch.device)
        for name in METHODS:
            assert hasattr(backend, name), name
            want = getattr(Backend, name)
            if isinstance(want, property):
                assert isinstance(inspect.getattr_static(backend, name), property), f"{name} is not a property"
                assert isinstance(getattr(backend, name), int)
            elif callable(want):
                # bound methods: the protocol's parameters (names, kinds, defaults) without self
                expected = inspect.signature(want.__get__(backend))
                got = inspect.signature(getattr(backend, name))
                assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
                    [(p.name, p.kind, p.default) for p in expected.parameters.values()], name
    finally:
        backend.close()


def test_the_protocol_names_what_the_runtime_calls():
    """A backend missing one member is not a Backend (the isinstance check above can fail)."""
    assert {"bind", "placeholder", "empty", "h2d", "d2h", "wait", "record", "synchronize", "compute",
            "begin_forward", "pin_host", "headroom_bytes", "peak_bytes", "total_bytes", "pinned_bytes", "close",
            "threads_alive", "device"} <= set(MEMBERS)

    class Partial:
        device = None

        def close(self) -> None: ...

    assert not isinstance(Partial(), Backend)


def test_cpu_backend_pins_nothing():
    from offload.host.arena import HostArena
    backend, arena = CPUBackend(), HostArena(1 << 20)
    backend.pin_host(arena)
    assert backend.pinned_bytes == 0
    backend.close()


def _cuda_backend_with(chaos):
    sim = FakeCuda()
    return CUDABackend(sim.device, api=sim, chaos=chaos)


@pytest.mark.parametrize("make", [lambda chaos: CPUBackend(chaos=chaos), _cuda_backend_with], ids=["cpu", "cuda"])
def test_host_lanes_carry_the_backends_chaos(make):
    """host_lane (the runtime's CPU AdamW lane) delays its items when the backend was made with chaos
    (offload.testing.chaos), like its copies; without chaos it has no delays."""
    from offload.testing.chaos import ChaosConfig
    for chaos, draws in ((None, None), (ChaosConfig(seed=3, max_delay_ms=1), 2)):
        backend = make(chaos)
        lane = backend.host_lane("cpu-adam")
        lane.submit(lambda: None).synchronize()
        assert lane.name == "offload-cpu-adam"
        assert (None if lane._before is None else lane._before.draws) == draws  # before and after the item
        lane.close()
        backend.close()
