"""Floor 5, step: the optimizer and one step of it.

`AdaptiveLossScaleOptimizer` (`optimizer`), the object that owns everything
that differs by mode (`scale_step`: one global scale, or per layer), the
step's state (`step_state`), measured statistics (`measurement`), gradient
accumulation (`gradient_window`, `accumulation_model`, `loss_normaliser`),
layer names, the tf-keras API and stock checkpoints.
"""
