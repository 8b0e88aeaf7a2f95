"""Horovod's Keras callbacks, handed the Keras 2 backend.

``horovod.tensorflow.keras.callbacks`` (0.28.1) passes ``from keras import backend`` to its
implementations. Where Keras 3 is installed next to tf-keras (as TensorFlow 2.18 pulls it in),
that is Keras 3's backend, which lacks ``constant`` / ``get_value`` / ``set_value``: the
``MetricAverageCallback`` then fails at the first epoch end and the learning-rate callbacks at
their first update. These subclasses are Horovod's callbacks unchanged, except that they use
``tf.keras.backend`` -- tf-keras's (Keras 2) backend when ``TF_USE_LEGACY_KERAS=1``, the one the
rest of the training script uses. Same names, same arguments.
"""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow.keras import callbacks as _hvd


class _Keras2Backend:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = tf.keras.backend


class BroadcastGlobalVariablesCallback(_Keras2Backend, _hvd.BroadcastGlobalVariablesCallback):
    __doc__ = _hvd.BroadcastGlobalVariablesCallback.__doc__


class MetricAverageCallback(_Keras2Backend, _hvd.MetricAverageCallback):
    __doc__ = _hvd.MetricAverageCallback.__doc__


class LearningRateScheduleCallback(_Keras2Backend, _hvd.LearningRateScheduleCallback):
    __doc__ = _hvd.LearningRateScheduleCallback.__doc__


class LearningRateWarmupCallback(_Keras2Backend, _hvd.LearningRateWarmupCallback):
    __doc__ = _hvd.LearningRateWarmupCallback.__doc__
