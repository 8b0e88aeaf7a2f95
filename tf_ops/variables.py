"""State variables created while a ``tf.function`` is traced, without tracing it twice.

The front ends create their state (residuals, momenta, clocks, corrections in flight) the first
time a gradient is seen, which is usually inside the first trace of the user's training step;
they create it eagerly, under ``tf.init_scope``, as Keras creates optimizer slots. TensorFlow
still counts such a variable as created by the function, and a function whose first trace created
variables is traced once more, under the rule that it creates none, and that second trace is the
one that runs. Tracing is most of what a small model's step costs the first time, so this doubles
it. A variable created eagerly has no initializer in the graph to lift out, so creating it with
``experimental_enable_variable_lifting=False`` makes the same variable, and the first trace is the
one that runs. Variables created inside the graph (not eagerly) are left to TensorFlow's rule.
"""

from __future__ import annotations

import tensorflow as tf


def _not_lifted(next_creator, **kwargs):
    if tf.executing_eagerly():  # created eagerly (tf.init_scope): nothing for the traced function to lift
        kwargs["experimental_enable_variable_lifting"] = False
    return next_creator(**kwargs)


def created_eagerly():
    """A scope in which variables created eagerly (under ``tf.init_scope`` while a function is
    traced) do not make that function trace again; for variables made by code that is not ours
    (the wrapped Keras optimizer's slots)."""
    return tf.variable_creator_scope(_not_lifted)


def state_variable(initial_value, **kwargs) -> tf.Variable:
    """``tf.Variable(initial_value, **kwargs)`` created eagerly, also while a function is traced
    (``tf.init_scope``), without making that function trace again. ``initial_value``: the value,
    or a function that makes it, called eagerly (a tensor made by the caller inside a trace would
    be the graph's)."""
    with tf.init_scope(), created_eagerly():
        return tf.Variable(initial_value() if callable(initial_value) else initial_value, **kwargs)


__all__ = ["created_eagerly", "state_variable"]
