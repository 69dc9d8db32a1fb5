"""Subprocess body for tests/test_fit_accumulation.py (not a test module):
accumulation with a masked loss under a two-replica `MirroredStrategy`
against one device's step on the whole window. Prints one JSON object."""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Before anything initialises the TensorFlow runtime.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from helpers import masked_sequence_model, padded_sequences  # noqa: E402
from test_fit_accumulation import BATCH, LR  # noqa: E402

import tf_adaptive_scale as tas  # noqa: E402

K = 4
LOSS = "sparse_categorical_crossentropy"


def flat_change(model, start):
    return np.concatenate([(w - s).ravel() for w, s in zip(model.get_weights(), start)])


def relative_error(update, reference):
    return float(np.linalg.norm(update - reference) / np.linalg.norm(reference))


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = padded_sequences(BATCH * K)
    single = masked_sequence_model()
    start = single.get_weights()
    single.compile(keras.optimizers.SGD(LR), loss=LOSS)
    single.fit(x, y, batch_size=BATCH * K, shuffle=False, verbose=0)
    reference = flat_change(single, start)
    results = {}
    for wrap in (False, True):
        with strategy.scope():
            model = masked_sequence_model()
            model.set_weights(start)
            trained = tas.exact_accumulation(model) if wrap else model
            trained.compile(tas.AdaptiveLossScaleOptimizer(
                keras.optimizers.SGD(LR), scaling="none", accumulation_steps=K), loss=LOSS)
        trained.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        results["fit_wrapped" if wrap else "fit_plain"] = relative_error(
            flat_change(model, start), reference)
    with strategy.scope():
        model = masked_sequence_model()
        model.set_weights(start)
        optimizer = tas.AdaptiveLossScaleOptimizer(keras.optimizers.SGD(LR), scaling="none")
    step = tas.make_train_step(model, LOSS, optimizer, accumulation_steps=K,
                               strategy=strategy, jit_compile=False)
    step(x, y)
    results["make_train_step"] = relative_error(flat_change(model, start), reference)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
