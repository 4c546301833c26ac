"""Dynamic loss scaling for float16: the rules of ``torch.amp.GradScaler``, on a plain float."""

from __future__ import annotations

from ..config import LossScaleConfig


class LossScaler:
    """The loss is multiplied by ``scale`` before backward. A step whose grads hold an inf or NaN is
    skipped and the scale shrinks by ``backoff_factor``; ``growth_interval`` clean steps in a row grow it by
    ``growth_factor``. Scales stay powers of two with the default factors, so unscaling is exact."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.init_scale)
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        c = self.config
        if found_inf:
            self.scale *= c.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == c.growth_interval:
            self.scale *= c.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
