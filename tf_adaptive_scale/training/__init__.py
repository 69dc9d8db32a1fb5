"""Floor 6, training: what a user runs a model through.

`instrument` places the per-layer boundaries on a model; `train_step` builds
compiled train steps for custom loops (TensorFlow).
"""
