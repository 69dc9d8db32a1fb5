"""Small Keras graphs covering the structures per-layer scaling must handle.

Each builder returns `(model, inputs, targets)`; it builds under the current
dtype policy, from a fixed seed, so float32 and mixed_float16 twins share
their initial weights.
"""

import numpy as np
import keras
from keras import layers


def _data(shapes, seed=0, ints=None):
    rng = np.random.default_rng(seed)
    if ints:
        return rng.integers(1, ints, shapes).astype("int32")
    return rng.standard_normal(shapes).astype("float32")


def sequential():
    model = keras.Sequential(
        [keras.Input((12,)), layers.Dense(16, activation="tanh"), layers.Dense(16), layers.Dense(3)]
    )
    return model, _data((32, 12)), _data((32, 3), 1)


def residual():
    x = keras.Input((12,))
    h = layers.Dense(16, activation="relu")(x)
    r = layers.Dense(16)(h)
    h = layers.Add()([h, r])  # fork at h: Dense and Add consume it
    h = layers.Activation("relu")(h)
    return keras.Model(x, layers.Dense(2)(h)), _data((32, 12)), _data((32, 2), 1)


def shared_and_concat():
    x = keras.Input((10,))
    shared = layers.Dense(10, activation="tanh")
    a = shared(x)
    b = shared(a)  # the same layer twice: its weight gradient sums both calls
    h = layers.Concatenate()([a, b, x])
    return keras.Model(x, layers.Dense(4)(h)), _data((32, 10)), _data((32, 4), 1)


def multi_io():
    xa, xb = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = layers.Concatenate()([layers.Dense(8)(xa), layers.Dense(8)(xb)])
    h = layers.Dense(8, activation="relu")(h)
    out1 = layers.Dense(2, name="first")(h)
    out2 = layers.Dense(1, name="second")(layers.Multiply()([h, h]))
    model = keras.Model({"a": xa, "b": xb}, {"first": out1, "second": out2})
    inputs = {"a": _data((32, 6)), "b": _data((32, 4), 2)}
    return model, inputs, {"first": _data((32, 2), 3), "second": _data((32, 1), 4)}


def nested():
    inner_seq = keras.Sequential([keras.Input((8,)), layers.Dense(8, activation="relu"), layers.Dense(8)])
    y = keras.Input((8,))
    inner_fn = keras.Model(y, layers.Dense(8, activation="tanh")(y))
    x = keras.Input((8,))
    h = inner_seq(x)
    h = inner_fn(h)
    h = inner_fn(layers.Add()([h, x]))  # a nested model called twice
    return keras.Model(x, layers.Dense(2)(h)), _data((32, 8)), _data((32, 2), 1)


def convolutional():
    x = keras.Input((16, 16, 3))
    h = layers.Conv2D(8, 3, padding="same")(x)
    h = layers.BatchNormalization()(h)
    h = layers.Activation("relu")(h)
    h = layers.Dropout(0.2, seed=1)(h)
    h = layers.Reshape((16, 16 * 8))(h)
    h = layers.Conv1D(8, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, layers.Dense(5)(h)), _data((8, 16, 16, 3)), _data((8, 5), 1)


def transformer():
    tokens = keras.Input((12,), dtype="int32")
    h = layers.Embedding(50, 16)(tokens)
    a = layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = layers.LayerNormalization()(layers.Add()([h, a]))
    f = layers.Dense(32, activation="relu")(h)
    f = layers.Dense(16)(f)
    h = layers.LayerNormalization()(layers.Add()([h, f]))
    out = layers.Dense(50)(h)
    return keras.Model(tokens, out), _data((8, 12), ints=50), _data((8, 12, 50), 1)


FAMILIES = {
    "sequential": sequential,
    "residual": residual,
    "shared_and_concat": shared_and_concat,
    "multi_io": multi_io,
    "nested": nested,
    "convolutional": convolutional,
    "transformer": transformer,
}


def build(family, policy, seed=0):
    """Builds `family` under `policy` from `seed`; restores the policy."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        return FAMILIES[family]()
    finally:
        keras.mixed_precision.set_global_policy(previous)
