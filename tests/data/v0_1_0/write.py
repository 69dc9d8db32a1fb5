"""Wrote this folder at 7ad1688 (0.1.0, each scalar of the optimizer's state
a variable of its own): a `.keras` file and a TensorFlow checkpoint per mode,
and `saved.json`, what they hold. test_serialization loads them with the
current version.

    git checkout 7ad1688 && PYTHONPATH=. python tests/data/v0_1_0/write.py tests/data/v0_1_0
"""
import json, os, sys
import numpy as np
import keras, tensorflow as tf
import tf_adaptive_scale as tas
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
keras.mixed_precision.set_global_policy("mixed_float16")
record = {}
for mode in ("adaptive", "per_layer"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(1, dtype="float32", name="head")])
    if mode == "per_layer":
        model = tas.instrument(model)
    opt = tas.AdaptiveLossScaleOptimizer(keras.optimizers.Adam(1e-3), scaling=mode, update_every=2,
                                         clipnorm=1.0)
    model.compile(opt, "mse", jit_compile=True)
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    y = (x.sum(1, keepdims=True) * 1e3).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    model.save(os.path.join(out, f"{mode}.keras"))
    tf.train.Checkpoint(model=model, optimizer=opt).write(os.path.join(out, f"{mode}_checkpoint"))
    record[mode] = {
        "version": tas.__version__,
        "weights": [w.tolist() for w in model.get_weights()],
        "optimizer": {v.path: np.asarray(v.numpy()).tolist() for v in opt.variables},
        "declared": [s.name for s in opt.declared_state()],
    }
json.dump(record, open(os.path.join(out, "saved.json"), "w"))
print({m: len(r["optimizer"]) for m, r in record.items()})
