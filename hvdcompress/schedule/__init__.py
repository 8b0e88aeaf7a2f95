"""The layer-merging scheduler: pure functions over tensor sizes and timings (no torch, no TF).

``costmodel`` (the alpha-beta link fits and per-algorithm compression costs), ``timeline`` (the
backward/exchange overlap model of one step), ``search`` (partitions of the backward order into
merge groups), ``planner`` (schedule strings, ``Workload`` and ``Plan``), ``groups`` (which
tensors may share one exchange), ``tuning`` (measured validation of candidate plans),
``scaling`` (predicted step time and efficiency at larger world sizes, ``python -m
hvdcompress.schedule.scaling``) and ``twolevel`` (two link classes, intra-node and inter-node:
the per-hop cost of flat, hierarchical and two-level exchanges, the route chosen per group).
The backends run the plans: ``torch_ops/scheduling.py``, ``tf_ops/grouping.py``.
"""
