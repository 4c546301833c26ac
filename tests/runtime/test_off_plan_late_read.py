"""A known limit, pinned (found with tests/MUTATIONS.md's N6, branch ``dpn6``): a step that leaves its plan and
reads a weight inside the backward after that weight's bucket was updated reads the updated weight, where torch
reads the weight before the step. On the plan such a read is held for ([Note: streamed weights read after their
update] in runtime/device_optim.py: ``GradPipeline``'s held updates, chosen from the plan's trace); a read the
plan did not foresee is not, and off plan the bucket is fetched again from the host copy the update rewrote."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload


class LateRead(nn.Module):
    """``b.weight`` read detached before ``b`` runs, only while ``late`` (a data-dependent branch): in backward
    that read comes after ``b``'s grads are complete."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a0, self.a, self.b, self.c = (nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 4)
        for m in (self.a0, self.a, self.b, self.c, self.out):
            nn.init.normal_(m.weight, std=0.2, generator=g)
        self.late = False

    def forward(self, x):
        h = self.a0(x).tanh()
        if self.late:
            h = F.linear(h, self.b.weight.detach())
        h = self.b(self.a(h).tanh()).tanh()
        return self.out(self.c(h).tanh())


def test_an_off_plan_read_after_the_update_reads_the_weights_torch_reads():
    """Fp32, the bitwise AdamW, overlapped updates, 1.2x the weights as budget (buckets streamed): the fourth step
    alone takes the late read, so it departs from its plan and its backward fetches ``b``'s bucket again after
    ``b``'s update. Losses bit for bit torch's up to that step; from the next one they are not (1.7061436 against
    1.7062106 when found): xfail while the limit stands, a failure once it is fixed (then drop the xfail)."""
    torch.manual_seed(0)
    model = LateRead()
    ref = copy.deepcopy(model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    engine = offload.wrap(model, opt, budget=int(1.2 * nbytes), device="cpu", bucket_bytes=nbytes // 10)
    losses: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(6):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
            model.late = ref.late = i == 3
            for forward, o, out in ((engine, opt, losses[0]), (ref, ref_opt, losses[1])):
                loss = (forward(x) - y).square().mean()
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss.item())
        counters = engine.memory_stats()["counters"]
        plan = engine.memory_stats()["plan"]
    finally:
        engine.close()
    assert counters["plan_departures"] >= 1 and plan["streamed_buckets"] > 0, (counters, plan)  # the case is on
    assert losses[0][:4] == losses[1][:4]  # the steps before the off-plan read's effect: torch's, bit for bit
    if losses[0] != losses[1]:
        pytest.xfail(f"known limit: an off-plan read after the update reads the updated weights ({losses[0][4]!r} "
                     f"against torch's {losses[1][4]!r})")
    raise AssertionError("the off-plan late read now trains as torch: the limit is fixed, drop this xfail and say so "
                         "in the [Note]s that state it (device_optim.py, node_share.py)")
