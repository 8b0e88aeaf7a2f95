"""A toy algorithm added the way every algorithm is: its oracle module (which declares it), one
PyTorch module and one TensorFlow module -- and nothing else. Copied into the three family folders
(``hvdcompress/reference/``, ``torch_ops/compressors/``, ``tf_ops/compressors/``) they are found
and registered with no other edit (``tests/test_contract.py`` checks this on a copy of the tree);
the tests here import the oracle module first, since this folder is not discovered."""
