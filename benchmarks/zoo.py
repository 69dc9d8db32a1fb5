"""The benchmarks' models, each family defined once.

Every script takes its models from here: an MLP, a CNN, a U-Net, a
transformer encoder, `keras.applications` networks, the attenuated MLP of
`per_layer.py` and the kernel census's two models. Where the scripts' own
copies differed, the difference is a parameter, so each script builds
exactly the model it built before (same layers in the same order, shapes,
names and, from the same seed, initial weights).

Builders build under the current dtype policy. Initial weights come from
Keras's global seed, drawn layer by layer as the layers are constructed:
seed first (`keras.utils.set_random_seed`) for reproducible weights.

Layer names: `names=None` leaves them to Keras (`dense_3`, ...); a dict
maps a builder's roles (listed in each docstring) to templates, e.g.
`{"dense": "dense_{i}", "logits": "logits"}`; a role the dict leaves out is
named by Keras. `*_NAMES` below are the names `per_layer.py` and
`startup_and_recovery.py` print.

Only Keras and NumPy are imported: `gpu_check.py` runs where TensorFlow is
not installed.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

CLASSES = 10

MLP_NAMES = {"dense": "dense_{i}", "logits": "logits", "float32": "head_f32"}
CNN_NAMES = {"conv": "conv_{i}", "pool": "pool_{i}", "gap": "gap", "dense": "dense_{i}",
             "logits": "logits", "map": "conv_out", "float32": "head_f32"}
UNET_NAMES = {"conv": "{block}_conv", "norm": "{block}_bn", "relu": "{block}_relu",
              "down": "down{level}", "up": "up{level}", "skip": "skip{level}",
              "map": "head_conv", "float32": "head_f32"}
TRANSFORMER_NAMES = {
    "embedding": "embed", "attention": "attn_{i}", "add_attention": "add_a{i}",
    "norm_attention": "ln_a{i}", "ffn_in": "ff_in_{i}", "ffn_out": "ff_out_{i}",
    "add_ffn": "add_f{i}", "norm_ffn": "ln_f{i}", "logits": "logits", "float32": "head_f32",
}


def _name(names, role, **fields):
    template = (names or {}).get(role)
    return None if template is None else template.format(**fields)


def _float32(names):
    """The output layer in float32, as the mixed-precision guide recommends."""
    return layers.Activation("linear", dtype="float32", name=_name(names, "float32"))


def _dense(widths, outputs, activation, names):
    """Dense layers of `widths` (`activation`) and a linear Dense(`outputs`)."""
    stack = [layers.Dense(w, activation=activation, name=_name(names, "dense", i=i))
             for i, w in enumerate(widths)]
    return stack + [layers.Dense(outputs, name=_name(names, "logits"))]


def _stack(input_shape, stack, float32_output, sequential, names, name):
    """`keras.Sequential` of `stack` (and a float32 output layer) or the same
    layers chained Functionally. (The layers are constructed before they
    are called: their initial weights are drawn in the order of `stack`
    either way.)"""
    if float32_output:
        stack = stack + [_float32(names)]
    if sequential:
        return keras.Sequential([keras.Input(input_shape)] + stack, name=name)
    x = h = keras.Input(input_shape)
    for layer in stack:
        h = layer(h)
    return keras.Model(x, h, name=name)


# ------------------------------------------------------------- families


def mlp(inputs=512, widths=(1024, 1024), outputs=CLASSES, activation="relu",
        float32_output=False, sequential=False, names=None, name=None):
    """Dense layers of `widths` (`activation`) on `inputs` features and a
    linear Dense(`outputs`). Roles: `dense` ({i}), `logits`, `float32`.

    step_cost's is the default (512-1024-1024-10); replicas_cost's has 256
    inputs; per_layer's (64-256-256-256-10) and startup_and_recovery's
    (32-64-64-10) are named (`MLP_NAMES`) with a float32 output; the kernel
    census's (`census_mlp`) is a `keras.Sequential`."""
    stack = _dense(widths, outputs, activation, names)
    return _stack((inputs,), stack, float32_output, sequential, names, name)


def cnn(input_shape=(16, 16, 8), filters=(32, 32, 32), activation="relu", pool_after=(),
        hidden=(64,), outputs=CLASSES, head="classes", float32_output=False,
        sequential=False, names=None, name=None):
    """3x3 `same` convolutions of `filters` (`activation`: one for all, or
    one per convolution), a 2x2 max pooling after each index in
    `pool_after`; then `head="classes"`: global average pooling, Dense
    layers of `hidden` (ReLU) and a linear Dense(`outputs`); or
    `head="map"`: a 1x1 convolution to one channel. Roles: `conv` ({i}),
    `pool` ({i}), `gap`, `dense` ({i}), `logits`, `map`, `float32`.

    step_cost's is the default (16x16x8, 3 x 32, Dense(64)); per_layer's
    (32x32x3, 16-16-pool-32-pool-32, no hidden Dense) and
    startup_and_recovery's (16x16x3, 3 x 16, `head="map"`) are named with a
    float32 output; the census's `conv_net` is a `keras.Sequential` whose
    last convolution is linear."""
    if isinstance(activation, str) or activation is None:
        activation = (activation,) * len(filters)
    stack, pools = [], 0
    for i, (width, act) in enumerate(zip(filters, activation, strict=True)):
        stack.append(layers.Conv2D(width, 3, padding="same", activation=act,
                                   name=_name(names, "conv", i=i)))
        if i in pool_after:
            stack.append(layers.MaxPooling2D(name=_name(names, "pool", i=pools)))
            pools += 1
    if head == "map":
        stack.append(layers.Conv2D(1, 1, name=_name(names, "map")))
    else:
        stack.append(layers.GlobalAveragePooling2D(name=_name(names, "gap")))
        stack += _dense(hidden, outputs, "relu", names)
    return _stack(tuple(input_shape), stack, float32_output, sequential, names, name)


def unet(input_shape=(32, 32, 3), widths=(16, 32), bottom=64, batch_norm=False,
         upsample="transpose", head="classes", outputs=CLASSES, names=None, name=None):
    """A U-Net: per level a 3x3 convolution block of `widths` kept as the
    skip and a 2x2 max pooling, a block of `bottom` channels, then per level
    up a 2x upsampling (`"transpose"`: a stride-2 Conv2DTranspose to the
    level's width; `"nearest"`: UpSampling2D), the skip concatenated and a
    block of the level's width. A block is a ReLU convolution, or with
    `batch_norm` a linear convolution, BatchNormalization and ReLU. Head
    `"classes"`: global average pooling and Dense(`outputs`) (to share the
    classification batches); `"map"`: a 1x1 convolution to one channel and a
    float32 output. Roles: `conv`, `norm`, `relu` ({block}: enc1, enc2, ...,
    bottom, ..., dec1), `down`, `up`, `skip` ({level}), `map`, `float32`.

    step_cost's is the default; gpu_check's has widths 8, 16, bottom 32 and
    `head="map"`, its 1x1 convolution named "head"; per_layer's is that with
    `batch_norm`, `upsample="nearest"` and `UNET_NAMES`."""

    def block(h, channels, label):
        if not batch_norm:
            return layers.Conv2D(channels, 3, padding="same", activation="relu",
                                 name=_name(names, "conv", block=label))(h)
        h = layers.Conv2D(channels, 3, padding="same", name=_name(names, "conv", block=label))(h)
        h = layers.BatchNormalization(name=_name(names, "norm", block=label))(h)
        return layers.Activation("relu", name=_name(names, "relu", block=label))(h)

    x = keras.Input(tuple(input_shape))
    skips, h = [], x
    for level, channels in enumerate(widths, start=1):
        h = block(h, channels, f"enc{level}")
        skips.append(h)
        h = layers.MaxPooling2D(name=_name(names, "down", level=level))(h)
    h = block(h, bottom, "bottom")
    for level in range(len(widths), 0, -1):
        channels, skip = widths[level - 1], skips[level - 1]
        if upsample == "transpose":
            h = layers.Conv2DTranspose(channels, 2, strides=2,
                                       name=_name(names, "up", level=level))(h)
        else:
            h = layers.UpSampling2D(name=_name(names, "up", level=level))(h)
        h = layers.Concatenate(name=_name(names, "skip", level=level))([h, skip])
        h = block(h, channels, f"dec{level}")
    if head == "map":
        h = layers.Conv2D(1, 1, name=_name(names, "map"))(h)
        h = _float32(names)(h)
    else:
        h = layers.GlobalAveragePooling2D()(h)
        h = layers.Dense(outputs)(h)
    return keras.Model(x, h, name=name)


def transformer(tokens=64, width=64, blocks=2, heads=4, vocab=1000, ffn=4,
                activation="gelu", outputs=CLASSES, per_token=False, causal=False,
                embed_dim=None, float32_output=False, names=None, name=None):
    """A transformer encoder on `tokens` token ids: an Embedding(`vocab`,
    `embed_dim` or `width`) (projected to `width` by a bias-free Dense where
    `embed_dim` differs), `blocks` post-norm blocks of MultiHeadAttention
    (`heads` heads of `width // heads`, `causal` mask or none) and a
    feed-forward of `ffn * width` units (`activation`); then either global
    average pooling and Dense(`outputs`), or (`per_token`) Dense(`outputs`)
    at every token. Roles: `embedding`, `projection`, `attention`,
    `add_attention`, `norm_attention`, `ffn_in`, `ffn_out`, `add_ffn`,
    `norm_ffn` ({i}: the block), `logits`, `float32`.

    step_cost's is the default (10 classes); gpu_check's step family has 4
    blocks of 8 heads and 1000 classes; gpu_check's token model, per_layer's
    (2x feed-forward, ReLU) and sparse_embedding's (causal, its own
    embedding width) predict per token, each with its own names."""
    x = keras.Input((tokens,), dtype="int32")
    h = layers.Embedding(vocab, embed_dim or width, name=_name(names, "embedding"))(x)
    if embed_dim is not None and embed_dim != width:
        h = layers.Dense(width, use_bias=False, name=_name(names, "projection"))(h)
    for i in range(blocks):
        attention = layers.MultiHeadAttention(heads, width // heads,
                                              name=_name(names, "attention", i=i))
        a = attention(h, h, use_causal_mask=True) if causal else attention(h, h)
        h = layers.LayerNormalization(name=_name(names, "norm_attention", i=i))(
            layers.Add(name=_name(names, "add_attention", i=i))([h, a]))
        f = layers.Dense(ffn * width, activation=activation, name=_name(names, "ffn_in", i=i))(h)
        f = layers.Dense(width, name=_name(names, "ffn_out", i=i))(f)
        h = layers.LayerNormalization(name=_name(names, "norm_ffn", i=i))(
            layers.Add(name=_name(names, "add_ffn", i=i))([h, f]))
    if not per_token:
        h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dense(outputs, name=_name(names, "logits"))(h)
    if float32_output:
        h = _float32(names)(h)
    return keras.Model(x, h, name=name)


def application(architecture, size=32, classes=CLASSES):
    """`keras.applications.<architecture>` with `weights=None` (no download)
    on `size` x `size` x 3 inputs, `classes` logits."""
    return getattr(keras.applications, architecture)(
        weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None)


@keras.saving.register_keras_serializable(package="per_layer_benchmark")
class Attenuate(layers.Layer):
    """Identity forward; the backward multiplies the gradient by `factor`.

    Computes in float32 (its output is float32), so the attenuated gradient
    is exact until the float16 layer below casts it.
    """

    def __init__(self, factor=2.0**-30, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.factor = float(factor)

    def call(self, x):
        factor = self.factor

        @ops.custom_gradient
        def attenuate(x):
            def backward(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                return upstream * ops.cast(factor, upstream.dtype)

            return ops.copy(x), backward

        return attenuate(x)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def attenuated_mlp(factor=2.0**-30):
    """per_layer's (a): 8 Dense(64, tanh) on 32 features with `Attenuate`
    after the 4th, a Dense(8) and a float32 output (`MLP_NAMES`)."""
    x = keras.Input((32,))
    h = x
    for i in range(4):
        h = layers.Dense(64, activation="tanh", name=f"dense_{i}")(h)
    h = Attenuate(factor, name="attenuate")(h)
    for i in range(4, 7):
        h = layers.Dense(64, activation="tanh", name=f"dense_{i}")(h)
    h = layers.Dense(8, name="dense_7")(h)
    return keras.Model(x, _float32(MLP_NAMES)(h), name="attenuated_mlp")


# ------------------------------------------- the step-time families


def batch_for(model, shape, seed):
    """A classification batch `(x, y)` of `shape` for `model`: token ids
    below 1000 for an int32 input, standard-normal values otherwise, and
    `CLASSES` labels."""
    rng = np.random.default_rng(seed)
    if model.inputs[0].dtype == "int32":
        x = rng.integers(0, 1000, shape).astype("int32")
    else:
        x = rng.standard_normal(shape).astype("float32")
    return x, rng.integers(0, CLASSES, shape[0]).astype("int32")


# name: () -> (model, batch shape); step_cost's families, timed by
# step_cost, per_layer_ablation, first_step, monitor_cost and profile_step.
FAMILIES = {
    "mlp": lambda: (mlp(), (128, 512)),
    "cnn": lambda: (cnn(), (64, 16, 16, 8)),
    "unet": lambda: (unet(), (8, 32, 32, 3)),
    "transformer": lambda: (transformer(), (16, 64)),
    "resnet50": lambda: (application("ResNet50"), (8, 32, 32, 3)),
    "mobilenetv2": lambda: (application("MobileNetV2"), (16, 32, 32, 3)),
}


# ------------------------------------------- the kernel census's models


def census_mlp(depth, width=64):
    """The kernel census's MLP: `depth` ReLU layers of `width` units and a
    10-unit head (a `keras.Sequential`), under mixed_float16 from seed 0,
    with a batch of 32 and mse targets: `(model, x, y)`."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = mlp(width, (width,) * depth, sequential=True)
    x = np.random.default_rng(0).standard_normal((32, width)).astype("float32")
    return model, x, np.ones((32, 10), "float32")


def conv_net():
    """The kernel census's CNN (a small `keras.Sequential`: two 8-channel
    convolutions, the second linear, and a Dense(2)), a batch and mse
    targets: `(model, x, y)`. Under the current policy and seed."""
    model = cnn((8, 8, 4), (8, 8), activation=("relu", None), hidden=(), outputs=2,
                sequential=True)
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 4)).astype("float32")
    return model, x, np.ones((4, 2), "float32")
