"""Floor 4, per layer: one scale per layer, inside the backward pass.

The boundaries that scale a layer's gradient and the table of their scales
(`gradient_scale`), the per-layer observation of one step (`layer_scaling`) and
the two compiled programs of a per-layer step, measuring and plain
(`step_programs`).
"""
