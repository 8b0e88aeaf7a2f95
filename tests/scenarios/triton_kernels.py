"""The Triton kernels' cases, run in a process of their own (``tests/test_triton_kernels.py``).

    python triton_kernels.py CASE_ID ...      # from tests/, prints {case id: "ok" | why not} as JSON

A process of its own because loading Triton's library after Horovod's TensorFlow ops (which
``tests/conftest.py`` imports) crashes the process; here triton is imported first, with
``TRITON_INTERPRET=1`` so that the kernels run on CPU tensors. Every case runs simulated ranks
for two steps through the compressor's real dispatch (CPU tensors sent down the CUDA branch by
``set_triton(force=True)``, the compiled CPU kernels off) against ``hvdcompress.reference``:
payload bytes, results and state bit for bit, and checks that the Triton kernels served every
exchange (or, for the layouts they leave to the torch ops, none).

A case is (id, spec, shape, members, gradients, the least number of exchanges per rank the
kernels serve over the two steps); the table is plain data, so the test module reads the ids
without importing triton.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

MERGED = (("a", (13,), 0), ("b", (1,), 13), ("c", (3, 370), 14))  # 1,124 entries: bytes and buckets split

QUANT = ["signsgd", "efsignsgd", "efsignsgd:residual=false", "onebit:scope=tensor", "terngrad",
         "terngrad:bucket=7,seed=3", "terngrad:residual=true", "qsgd", "qsgd:levels=1,bucket=0",
         "qsgd:levels=3,bucket=5,seed=11", "qsgd:levels=127,bucket=512,residual=true", "qsgd:levels=20,bucket=9",
         "efsignsgd:momentum=0.9", "onebit:scope=tensor,momentum=0.9,nesterov=true"]


def _cases():
    out = []
    for text in QUANT:  # 1 entry, a partial byte, a 2-D tensor of 407
        for shape in ((1,), (7,), (37, 11)):
            out.append((f"{text}|{shape}", text, shape, (), "t", 2))
    for text in ["signsgd", "qsgd:levels=20,bucket=0", "terngrad:residual=true"]:  # 2 programs, the last partial
        out.append((f"{text}|1030|blocks", text, (1030,), (), "t", 2))
    for text in ["signsgd", "efsignsgd", "onebit:scope=tensor", "terngrad:bucket=40", "qsgd:levels=5,bucket=10"]:
        out.append((f"{text}|merged", text, (1124,), MERGED, "t", 2))
    for text in ["efsignsgd", "onebit:scope=tensor", "terngrad:bucket=8", "qsgd:residual=true"]:
        out.append((f"{text}|zeros", text, (300,), (), "zeros", 2))
    for text in ["signsgd", "efsignsgd", "onebit:scope=tensor,momentum=0.9", "terngrad", "terngrad:bucket=64",
                 "qsgd:bucket=64", "qsgd:levels=2,bucket=0,residual=true"]:
        out.append((f"{text}|nonfinite", text, (1003,), (), "nonfinite", 2))
    for text in ["terngrad:share_scale=true"]:  # left to the torch ops, still the oracle
        out.append((f"{text}|torch-ops", text, (37, 11), (), "t", 0))
    # onebit's default scope: a (pos, neg) pair per column; tiles of rows x columns, several
    # column blocks and row chunks, a 1-D tensor (one column), merged members
    for text, shape, members, kind in [("onebit", (37, 11), (), "t"), ("onebit", (300, 40), (), "t"),
                                       ("onebit", (7,), (), "t"), ("onebit", (1030,), (), "t"),
                                       ("onebit:momentum=0.9", (300, 40), (), "nonfinite"),
                                       ("onebit", (20, 15), (), "zeros"), ("onebit", (1124,), MERGED, "t")]:
        out.append((f"{text}|{shape}|columns|{kind}", text, shape, members, kind, 2))
    out.append(("qsgd|switched-off", "qsgd", (37, 11), (), "off", 0))
    # top-k (>= 4,096 entries: smaller ones take one torch topk): exact, ties toward the lower index
    for text, shape, kind, served in [("topk:ratio=0.01", (5000,), "t", 2),
                                      ("topk:ratio=0.05,residual=false", (6001,), "t", 2),
                                      ("topk:ratio=0.01", (4500,), "nan", 2), ("topk:ratio=0.0002", (5000,), "t", 1),
                                      ("topk:ratio=0.01", (4200,), "zeros", 0), ("topk:ratio=0.02", (6000,), "ties", 2),
                                      ("topk:ratio=0.003,residual=false", (40000,), "t", 2)]:
        out.append((f"{text}|{shape[0]}|{kind}", text, shape, (), kind, served))
    for text, shape, kind in [("threshold:threshold=0.5", (37, 11), "t"),
                              ("threshold:threshold=1.5,residual=false", (1030,), "nan"),
                              ("threshold:threshold=0.5", (300,), "zeros")]:
        out.append((f"{text}|{shape}|{kind}", text, shape, (), kind, 2))
    dgc = ",warmup_epochs=0,min_sparse_numel=256"  # 2-D tensors: DGC sends 1-D ones dense
    for text, shape, kind in [("dgc:ratio=0.01", (37, 11), "t"), ("dgc:ratio=0.01", (50, 100), "t"),
                              ("dgc:ratio=0.0003", (60, 50), "t"), ("dgc:ratio=0.02,nesterov=true", (40, 50), "t"),
                              ("dgc:ratio=0.02,momentum_correction=false", (40, 50), "t"),
                              ("dgc:ratio=0.02,momentum_masking=false,sample_ratio=0.05", (40, 50), "t"),
                              ("dgc:ratio=0.01", (60, 50), "nan"), ("dgc:ratio=0.01", (30, 10), "zeros")]:
        # zeros: the update is served, the selection left to the torch ops
        out.append((f"{text + dgc}|{shape}|{kind}", text + dgc, shape, (), kind, 2))
    # the count sketch: its atomic adds run in the interpreter one program after another, in index order
    for text, shape, kind in [("sketch:ratio=0.01", (60, 50), "t"), ("sketch:ratio=0.01,rows=3,p2=2", (5000,), "t"),
                              ("sketch:k=1,rows=4,cols=200", (2000,), "t"),
                              ("sketch:ratio=0.01,rows=1,cols=300", (2000,), "t"),
                              ("sketch:ratio=0.01,rows=7", (3000,), "nan"), ("sketch:ratio=0.01", (2000,), "zeros")]:
        out.append((f"{text}|{shape}|{kind}", text, shape, (), kind, 2))
    # what one warm exchange launches (Triton, torch ops) and where it waits (host syncs): the
    # cost the kernels were built to, counted by torch_ops.gpu.census (world of one, 3 steps)
    for text, counts in CENSUS.items():
        out.append((f"census|{text}", text, (64, 100), (), "census", counts))
    return out


CENSUS = {"signsgd": (2, 0, 0), "efsignsgd": (3, 0, 0), "onebit": (3, 0, 0), "onebit:scope=tensor": (3, 0, 0),
          "terngrad": (3, 0, 0), "qsgd:levels=127,bucket=512": (3, 0, 0), "topk:ratio=0.01": (3, 8, 1),
          "dgc:ratio=0.01,warmup_epochs=0,min_sparse_numel=256": (3, 11, 1)}
CASES = {c[0]: c for c in _cases()}


def run_census(case) -> str:
    """"ok", or the census when (Triton launches, torch ops, host syncs) differ from the case's."""
    import torch

    from hvdcompress import parse_spec
    from torch_ops import gpu
    from torch_ops.compressors import ExchangeContext, build_compressor
    from torch_ops.gpu.census import Census

    def world_of_one(ex):  # each collective returns its input: no op of the test's own is counted
        reqs = next(ex)
        while True:
            try:
                reqs = ex.send(tuple(q.tensor for q in reqs))
            except StopIteration:
                return

    cid, text, shape, _, _, want = case
    comp = build_compressor(parse_spec(text))
    gen = torch.Generator().manual_seed(3)
    state = {}
    gpu.set_triton(True, force=True)
    try:
        for step in range(3):
            x = torch.randn(shape, generator=gen).reshape(-1)
            ex = comp.exchange(x, ExchangeContext("layer.w", step, 1, 1.0, state, shape, 0, 0))
            if step < 2:
                world_of_one(ex)
                continue
            with Census() as c:
                world_of_one(ex)
    finally:
        gpu.set_triton(True, force=False)
    got = c.summary()
    have = (got["triton"], got["torch_ops"], got["syncs"])
    return "ok" if have == tuple(want) else f"(triton, torch ops, syncs) {have}, expected {tuple(want)}: {got}"


def _grads(text, shape, kind, world=2, steps=2):
    import numpy as np
    g = np.random.default_rng(zlib.crc32(f"{text}|{shape}|{kind}".encode()))
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world):
            v = np.round(g.standard_t(3, size=shape), 3).astype(np.float32)
            if kind == "zeros":
                v[...] = 0.0
            if kind == "ties":  # many equal magnitudes at the k-th largest: the tie rule decides
                v = np.round(v, 1).astype(np.float32)
            flat = v.reshape(-1)
            flat[:3] = 0.0
            if kind in ("nonfinite", "nan"):  # nan: no inf (the sparsifiers' residual is 0 where
                flat[[4, 7]] = np.nan             # an inf was sent, the oracle's inf - inf NaN)
            if kind == "nonfinite":
                flat[8] = np.inf
            step.append(v)
        if kind == "nonfinite":
            step[1].reshape(-1)[-1] = -np.inf
        out.append(step)
    return out


def _tap(gen, sink):
    rounds = []
    sink.append(rounds)
    reqs = next(gen)
    while True:
        rounds.append([r.tensor.clone().numpy() for r in reqs])
        result = yield reqs
        try:
            reqs = gen.send(result)
        except StopIteration as stop:
            return stop.value


def run_case(case) -> str:
    """"ok", or what differs from the oracle."""
    if case[4] == "census":
        return run_census(case)
    import numpy as np
    import torch

    from hvdcompress import parse_spec
    from hvdcompress.reference import Member, simulate
    from scenarios.local_world import run_lockstep
    from torch_ops import gpu
    from torch_ops.compressors import ExchangeContext, build_compressor
    from torch_ops.gpu import quant, select, sketch

    cid, text, shape, members, kind, served = case
    members = tuple(Member(n, s, o) for n, s, o in members)
    world, key = 2, "layer.w"
    spec = parse_spec(text)
    comp = build_compressor(spec)
    o_states = [{} for _ in range(world)]
    t_states = [{} for _ in range(world)]
    jobs = []
    hooks = [(quant, "plan", lambda got: got is not None), (select, "at_least", lambda got: True),
             (select, "topk", lambda got: got is not None), (select, "add_and_topk", lambda got: got[1] is not None),
             (select, "accumulate_and_select", lambda got: got[0]), (sketch, "plan", lambda got: got is not None)]
    saved = [getattr(mod, name) for mod, name, _ in hooks]

    def counting(fn, served_by):
        def call(*args, **kw):
            got = fn(*args, **kw)
            jobs.append(served_by(got))
            return got
        return call

    for (mod, name, served_by), fn in zip(hooks, saved):
        setattr(mod, name, counting(fn, served_by))
    if text.startswith(("dgc", "sketch")):  # counted as the update (one per exchange), not the candidates
        select.at_least = saved[1]
    total = 0
    gpu.set_triton(kind != "off", force=kind != "off")
    try:
        for step, grads in enumerate(_grads(text, shape, kind, world)):
            jobs.clear()
            want, _, want_sent = simulate(spec, grads, o_states, key=key, step=step, shape=shape, members=members)
            sent = []
            gens = [_tap(comp.exchange(torch.from_numpy(g.reshape(-1).copy()),
                                       ExchangeContext(key, step, world, 1.0 / world, st, shape, 0, r, members)), sent)
                    for r, (g, st) in enumerate(zip(grads, t_states))]
            results, _ = run_lockstep(gens)
            total += sum(jobs)
            for r in range(world):
                label = f"step={step} rank={r}"
                for w_round, g_round in zip(want_sent[r], sent[r]):
                    for w, g in zip(w_round, g_round):
                        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
                            bad = np.flatnonzero(g.reshape(-1).view(np.uint8) != w.reshape(-1).view(np.uint8))
                            return f"{label}: payload differs at bytes {bad[:8].tolist()} of {w.nbytes}"
                got = results[r].numpy()
                if not np.array_equal(got, want, equal_nan=True) or got.dtype != want.dtype:
                    return f"{label}: result differs at {np.flatnonzero(got != want)[:8].tolist()}"
                for name, arr in o_states[r].items():
                    mine = t_states[r][name].numpy().reshape(arr.shape)
                    if not np.array_equal(mine, arr, equal_nan=True):
                        return f"{label}: state {name} differs at {np.flatnonzero(mine != arr)[:8].tolist()}"
        exact = text.split(":")[0] not in ("topk", "threshold", "dgc", "sketch")
        if (total != served * world) if exact or served == 0 else (total < served * world):
            return f"the Triton kernels served {total} exchanges (of {2 * world}), expected {served * world}"
        return "ok"
    finally:
        for (mod, name, _), fn in zip(hooks, saved):
            setattr(mod, name, fn)
        gpu.set_triton(True, force=False)


def main(ids) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401  -- before anything loads other native libraries
    import warnings

    from torch_ops.compressors import native

    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's NaN arithmetic in the oracle
    native.set_torch_only(True)
    out = {}
    for cid in ids:
        try:
            out[cid] = run_case(CASES[cid])
        except Exception as e:  # reported per case
            out[cid] = f"{type(e).__name__}: {e}"
    print("RESULTS " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
