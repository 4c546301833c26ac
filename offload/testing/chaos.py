"""Chaos mode: seeded random delays on the engine's copy and optimizer lanes, to shake out ordering bugs.

A missing wait is a race: it gives wrong numbers only when the copy it should have waited for happens to
be late. On a quiet machine copies are rarely late, so such a bug passes every test and shows up on a
busy GPU. Chaos mode makes lateness the norm: each lane (the CPU backend's host-to-device and
device-to-host copy threads, and the CPU AdamW thread) sleeps a random time before and after every item
it runs, before the event that marks the item's end is set; on the CUDA backend, ``torch.cuda._sleep``
kernels are put on the copy streams before and after every copy. Every result must stay bit-identical to
a run without chaos (tests/runtime/test_chaos.py checks it on every test model).

Delays are drawn from one ``random.Random`` per lane, seeded from ``(seed, lane name)``, so the sequence
of delays a lane draws is the same from run to run (the interleaving with the compute thread is still up
to the OS scheduler, which is the point).
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ChaosConfig:
    """Random delays around every copy and optimizer update (see the module docstring). For testing only:
    it slows training down by design."""

    seed: int = 0
    """Seeds each lane's delays (with the lane's name), so runs draw the same delays."""
    max_delay_ms: float = 2.0
    """Each delay is uniform in [0, max_delay_ms] milliseconds."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"ChaosConfig.seed must be an int; got {self.seed!r}")
        if isinstance(self.max_delay_ms, bool) or not isinstance(self.max_delay_ms, (int, float)) \
                or not math.isfinite(self.max_delay_ms) or not 0 < self.max_delay_ms <= 1000:
            raise ValueError(f"ChaosConfig.max_delay_ms must be a number of milliseconds in (0, 1000]; "
                             f"got {self.max_delay_ms!r}")


class ChaosDelay:
    """The delays of one lane: each call draws the next one (in seconds). ``sleep()`` also sleeps it.

    ``draws`` and ``slept_s`` count what was done, so a test can tell chaos was really on."""

    def __init__(self, config: ChaosConfig, lane: str) -> None:
        self._rng = random.Random(f"offload-chaos:{config.seed}:{lane}")  # str seeds hash the same in every run
        self._max_s = config.max_delay_ms / 1000.0
        self._lock = threading.Lock()  # a lane is one thread, but the CUDA backend draws from the caller's
        self.draws = 0
        self.slept_s = 0.0

    def draw(self) -> float:
        with self._lock:
            delay = self._rng.uniform(0.0, self._max_s)
            self.draws += 1
            self.slept_s += delay
        return delay

    def sleep(self) -> None:
        time.sleep(self.draw())

    __call__ = sleep


def chaos_delay(config: ChaosConfig | None, lane: str) -> ChaosDelay | None:
    """The delays for ``lane``, or None when chaos is off."""
    return None if config is None else ChaosDelay(config, lane)
