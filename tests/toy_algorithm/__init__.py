"""A toy algorithm added the way every algorithm is: its oracle module (which declares it), one
PyTorch module and one TensorFlow module -- and nothing else (``tests/test_toy_algorithm.py``)."""
