"""TensorFlow 2 / Keras backend of hvdcompress (the TF compressors and wrappers come with the
TensorFlow issue). Import TensorFlow with ``TF_USE_LEGACY_KERAS=1`` set: Horovod's Keras layer
needs Keras 2 (tf-keras)."""
