"""Code the tests run inside real Horovod workers, and the harness around it.

- ``launch``: starting N local Gloo workers (``run_workers``), running several scenarios in one
  launch (``run_scenarios``), reading one scenario's results (``part``).
- ``shared_tf_launch``: the one 2-worker TensorFlow launch that the TF test modules share.
- ``local_world``: a single-process lockstep stand-in for N ranks (exchange semantics only).
- ``vectors``: the seeded inputs on which the oracle, torch and TF must agree.
- one module per feature area (``torch_core``, ``tf_core``, ``schedules``, ``quantizers``, ...):
  scenario functions that return plain data for the pytest side to assert on;
  ``elastic_worker`` / ``tf_elastic_worker`` are scripts run by ``horovodrun`` elastic.

Worker processes import this package by name: ``launch`` puts tests/ on their PYTHONPATH.
"""
