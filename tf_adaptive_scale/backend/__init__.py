"""Floor 1, backend: what differs between Keras backends and what Keras keeps private.

TensorFlow and JAX bridges (`backends`, `tensorflow_graph`), `tf.distribute`
plumbing (`distribution`), conditionals that assign variables (`branching`),
sparse gradients kept sparse (`sparse_gradients`) and every private Keras API
the package reads (`keras_internals`). Imports nothing else of the package.
"""
