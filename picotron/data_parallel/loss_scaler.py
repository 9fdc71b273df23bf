"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training").

fp16 cannot represent gradients below ~6e-8, so the loss is multiplied by a large scale
before backward and the gradients divided by it before the step. When some gradient
overflows (inf/NaN), the step is skipped and the scale halved; after `window` good steps in a
row it is doubled again, so it hovers just below the overflow point. bf16 and fp32 have fp32's
range and need none of this: the scale stays 1.
"""


class DynamicLossScaler:
    def __init__(self, enabled: bool, initial_scale: float, window: int):
        self.enabled, self.window = enabled, window
        self.scale = float(initial_scale) if enabled else 1.0
        self.good_steps, self.skipped_steps = 0, 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.scale *= 2
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled:
            self.scale, self.good_steps = state["scale"], state["good_steps"]
            self.skipped_steps = state["skipped_steps"]
