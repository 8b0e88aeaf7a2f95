"""Fidelity under AdamW: every registered spec on the character-level transformer LM of
benchmarks/diloco_wan.py (its model, corpus, dense pretraining and cosine schedule, imported from
there), final held-out loss and bytes per step next to dense and next to each worker alone.

    # the measurement (4 workers; see docs/fidelity.md, "AdamW", for the duration)
    python benchmarks/fidelity_adam.py --workers 4 --seeds 0 1 2
    # a smoke run (tiny model, a handful of steps; the figures mean nothing)
    python benchmarks/fidelity_adam.py --quick --workers 2 --steps 6 --pretrain-steps 2 --seeds 0 \\
        --configs none alone topk onebitadam topkadam --out /tmp/fidelity-adam-smoke

``--front`` picks how the workers exchange: ``horovod`` (the default, described below), ``ddp``
(torch DDP with ``hvdcompress.ddp.comm_hook`` on torch.distributed gloo, no Horovod; DDP's buckets
are the hook's units) or ``keras`` (the same architecture in Keras, ``hvdcompress.keras`` on Horovod
TensorFlow); each front trains its own dense start. Bytes are also counted after the first
``--onebitadam-warmup`` of the steps (``bytes_per_step_after_warmup``: the steady state).

One launch of ``--workers`` loopback workers (one thread each). Every worker first trains the
common starting point (``--pretrain-steps`` of dense synchronous AdamW, as diloco_wan's
``pretrain``), then runs one *phase* per (method, setting, seed), each from that starting point
with a fresh AdamW (lr from the sweep, weight decay 0.1, betas 0.9/0.95; the lr follows
diloco_wan's cosine: 5% warm-up, decay to 10%) for ``--steps`` steps on the rank's own random
windows of the training text (seed ``1000 * (rank + 1) + 7919 * seed``), then checks that every
rank holds the same parameters and evaluates the held-out next-character loss.

Methods (``--configs``; all by default): ``alone`` (AdamW without any exchange: each worker
trains on its own data; its loss is the mean over ranks) and every registered spec through the
PyTorch ``DistributedOptimizer`` (Horovod, schedule ``layerwise``: every tensor compressed on its
own, as in the papers) at its setting in ``SETTINGS`` (``{ratio}``: swept over ``--ratios``;
``{warmup}``: the frozen-variance Adams' dense warm-up, ``--onebitadam-warmup`` of the
steps; a spec without an entry runs with its defaults; ``VARIANTS``, e.g. ``topkadam-bf16``: other
settings of a registered spec, each a name of its own, run only when named). Specs that keep SGD's momentum in their
memory run with ``momentum=0`` (AdamW keeps its own); ``onebitadam`` and ``topkadam`` take AdamW over; ``dgc`` warns (its rule
under Adam, docs/fidelity.md).

Sweep: with the first seed, every setting x every learning rate of ``--lrs``; the one with the
lowest final loss (mean over ranks) is the method's own and the other seeds run at it. Figures:
``final_loss`` (mean over seeds at the method's own setting), ``bytes_per_step`` (payload bytes a
worker handed to the collectives per step, counted by the communicator, warm-ups included),
``loss_vs_dense_pct``, ``fewer_bytes_than_dense``, ``better_than_alone``. Written to
``<out>.json`` and ``<out>.md`` after the launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

from diloco_wan import MODEL, QUICK_MODEL, counting, lr_schedule, pretrain

# Under AdamW: momentum-keeping specs get momentum 0 (AdamW keeps its own). In run order: dense first.
SETTINGS = {
    "none": "none",
    "alone": None,  # no exchange
    "fp16": "fp16",
    "bf16": "bf16",
    "onebitadam": "onebitadam:warmup_steps={warmup}",
    "topkadam": "topkadam:ratio={ratio},warmup_steps={warmup}",
    "topk": "topk:ratio={ratio}",
    "gtopk": "gtopk:ratio={ratio}",
    "randomk": "randomk:ratio={ratio}",
    "threshold": "threshold:threshold=0.001",
    "dgc": "dgc:ratio={ratio},momentum=0,warmup_epochs=0",
    "sketch": "sketch:ratio={ratio},momentum=0",
    "sparseloco": "sparseloco:ratio={ratio}",
    "signsgd": "signsgd",
    "efsignsgd": "efsignsgd",
    "onebit": "onebit",
    "terngrad": "terngrad",
    "qsgd": "qsgd:levels=7,bucket=512",
    "powersgd": "powersgd:rank=2",
    "qsgdadam": "qsgdadam:warmup_steps={warmup}",
}
# Other settings of registered specs, each a name of its own; run only when named in --configs.
VARIANTS = {
    # (levels 1 and 7 on 512-entry buckets, measured before the spec refused them, diverged: docs/fidelity.md)
    "qsgdadam-l31": "qsgdadam:levels=31,bucket=512,warmup_steps={warmup}",
    "onebitadam-bf16": "onebitadam:warmup_steps={warmup},warmup_codec=bf16",
    "topkadam-bf16": "topkadam:ratio={ratio},warmup_steps={warmup},warmup_codec=bf16",
    "topkadam-0.005-bf16": "topkadam:ratio=0.005,warmup_steps={warmup},warmup_codec=bf16",
}
TEST_ONLY = {"toysign"}


def configs() -> dict:
    """Method name -> its spec template (None: each worker alone), every registered spec included."""
    from hvdcompress.registry import registered

    names = [n for n in registered() if n not in TEST_ONLY]
    out = {n: s for n, s in SETTINGS.items() if n == "alone" or n in names}
    out.update({n: n for n in sorted(names) if n not in out})
    out.update({n: s for n, s in VARIANTS.items() if s.split(":")[0] in names})
    return out


def settings(template, ratios, warmup):
    """The spec strings a template stands for (one per swept ratio)."""
    if template is None:
        return [None]
    if "{ratio}" in template:
        return [template.format(ratio=r, warmup=warmup) for r in ratios]
    return [template.format(warmup=warmup)]


# -- fronts: how a worker exchanges ---------------------------------------------------------------
# Each front builds the model, trains one phase and answers rank, the identical-parameters check and
# the mean over ranks. "horovod": PyTorch ``DistributedOptimizer`` on Horovod (the measurement);
# "ddp": torch's DistributedDataParallel with ``hvdcompress.ddp.comm_hook`` (torch.distributed gloo,
# no Horovod); "keras": ``hvdcompress.keras.DistributedOptimizer`` on Horovod TensorFlow, the same
# architecture written in Keras. Bytes: the Horovod front counts what the communicator is handed; the
# other two read the exchange's own count (``stats.total_bytes``, the same payload sizes).
ADAM_TAKEOVER = ("onebitadam", "topkadam", "qsgdadam")  # replace AdamW's update: Keras wraps SGD(momentum=0) for them


class TorchFront:
    """The PyTorch fronts' common part: the char LM, the training loop, the checks."""

    def __init__(self, cfg):
        import torch

        torch.set_num_threads(1)
        self.cfg = cfg

    def model(self, start_state):
        import torch

        from hvdcompress.bench.example_models import CharTransformer

        dims = self.cfg["model"]
        torch.manual_seed(0)
        model = CharTransformer(width=dims["width"], layers=dims["layers"], heads=dims["heads"],
                                context=dims["context"])
        if start_state is not None:
            model.load_state_dict(start_state)
        return model

    def train(self, model, spec, lr, schedule, steps, stream_seed):
        """``steps`` AdamW steps (lr factor ``schedule(step)``) through this front's exchange of
        ``spec`` (None: no exchange); (bytes sent before the warm-up ends, bytes sent in all)."""
        import torch

        from hvdcompress.bench.example_models import char_batches

        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, schedule)
        ex = self.exchange(model, inner, spec)
        batches = char_batches(self.text.train, self.cfg["batch"], self.cfg["model"]["context"],
                               seed=1000 * (self.rank() + 1) + stream_seed)
        warm, in_warmup = warmup_steps(self.cfg), 0
        for step in range(steps):
            if step == warm:
                in_warmup = ex.sent()
            x, y = next(batches)
            ex.zero_grad()
            logits = ex.forward(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            ex.step()
            scheduler.step()
        sent = ex.sent()
        ex.finish()
        return in_warmup, sent

    def phase(self, start_state, spec, lr, seed):
        import torch

        from hvdcompress.bench.example_models import char_eval_loss

        model = self.model(start_state)
        in_warmup, sent = self.train(model, spec, lr, lr_schedule("cosine", self.cfg["steps"]), self.cfg["steps"],
                                     7919 * seed)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = self.gather(flat, f"check.{spec}.{lr}.{seed}")
        identical = bool(all(torch.equal(rows[0], r) for r in rows)) if spec is not None else None
        loss = char_eval_loss(model, self.text.test, self.cfg["model"]["context"], windows=self.cfg["eval_windows"])
        return result(self.cfg, self.mean(loss, f"loss.{spec}.{lr}.{seed}"), loss, in_warmup, sent, identical)


class _Exchange:
    """One phase's optimizer step through a front: forward, zero_grad, step, bytes sent, finish."""

    def __init__(self, forward, opt, sent=lambda: 0, finish=lambda: None):
        self.forward, self.zero_grad, self.step, self.sent, self.finish = forward, opt.zero_grad, opt.step, sent, finish


class HorovodFront(TorchFront):
    def __init__(self, cfg):
        import hvdcompress.torch as hvc

        super().__init__(cfg)
        hvc.init()
        self.hvc = hvc

    def rank(self):
        return self.hvc.rank()

    def start(self):
        return pretrain(self.cfg, self.text)

    def exchange(self, model, inner, spec):
        from torch_ops.collectives import Communicator

        if spec is None:
            return _Exchange(model, inner)
        transport = counting(Communicator)
        opt = self.hvc.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=spec,
                                            transport=transport, schedule="layerwise")
        opt.set_epoch(1000)  # past any density warm-up: the density asked for is the one measured
        return _Exchange(model, opt, lambda: transport.payload_bytes, opt.flush)

    def gather(self, flat, name):
        return self.hvc.allgather(flat[None], name=name)

    def mean(self, value, name):
        import torch

        return float(self.hvc.allreduce(torch.tensor([value], dtype=torch.float64), name=name, op=self.hvc.Average)[0])

    def close(self):
        self.hvc.shutdown()


class DDPFront(TorchFront):
    def __init__(self, cfg):
        import torch.distributed as dist

        super().__init__(cfg)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = os.path.join(os.path.dirname(cfg["out"]), "ddp-store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["HOROVOD_RANK"]),
                                world_size=int(os.environ["HOROVOD_SIZE"]))
        self.dist = dist

    def rank(self):
        return self.dist.get_rank()

    def start(self):
        """The common start as ``diloco_wan.pretrain``'s (dense synchronous AdamW, constant lr, the
        seed-0 model, a stream of its own per rank), through DDP's hook."""
        model = self.model(None)
        self.train(model, "none", self.cfg["lr"], lambda s: 1.0, self.cfg["pretrain_steps"], 500)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def exchange(self, model, inner, spec):
        from torch.nn.parallel import DistributedDataParallel

        import hvdcompress.ddp

        if spec is None:
            return _Exchange(model, inner)
        ddp = DistributedDataParallel(model)
        state, hook = hvdcompress.ddp.comm_hook(spec, model=ddp, optimizer=inner)
        ddp.register_comm_hook(state, hook)
        state.set_epoch(1000)
        return _Exchange(ddp, inner, lambda: state.stats.total_bytes)

    def gather(self, flat, name):
        import torch

        rows = [torch.empty_like(flat) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(rows, flat)
        return rows

    def mean(self, value, name):
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t[0]) / self.dist.get_world_size()

    def close(self):
        self.dist.destroy_process_group()


class KerasFront:
    """The char LM in Keras (pre-norm blocks of causal multi-head attention and a 4x GELU MLP, learned
    positions, output tied to the embedding: ``CharTransformer``'s architecture), trained with
    ``train_on_batch``. AdamW is Keras's (epsilon added to the uncorrected RMS, as Keras does);
    ``onebitadam``/``topkadam`` wrap Keras SGD(momentum=0, weight_decay=0.1) with AdamW's constants in
    the spec (docs/fidelity.md, AdamW)."""

    def __init__(self, cfg):
        import hvdcompress.keras as hvc
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        hvc.init()
        self.cfg, self.hvc, self.tf = cfg, hvc, tf

    def rank(self):
        return self.hvc.rank()

    def model(self, start_weights):
        tf, dims = self.tf, self.cfg["model"]
        layers = tf.keras.layers
        width, context = dims["width"], dims["context"]

        class CharLM(tf.keras.Model):
            def __init__(self):
                super().__init__()
                self.embed = layers.Embedding(128, width, embeddings_initializer=tf.keras.initializers.RandomNormal(
                    stddev=0.02, seed=1))
                self.position = self.add_weight(name="position", shape=(context, width),
                                                initializer=tf.keras.initializers.RandomNormal(stddev=0.02, seed=2))
                self.blocks = [(layers.LayerNormalization(epsilon=1e-5),
                                layers.MultiHeadAttention(dims["heads"], width // dims["heads"]),
                                layers.LayerNormalization(epsilon=1e-5),
                                layers.Dense(4 * width, activation="gelu"), layers.Dense(width))
                               for _ in range(dims["layers"])]
                self.norm = layers.LayerNormalization(epsilon=1e-5)

            def call(self, x):
                h = self.embed(x) + self.position[:tf.shape(x)[1]]
                for norm1, attention, norm2, up, down in self.blocks:
                    a = norm1(h)
                    h = h + attention(a, a, use_causal_mask=True)
                    h = h + down(up(norm2(h)))
                return tf.matmul(self.norm(h), self.embed.embeddings, transpose_b=True)

        tf.keras.utils.set_random_seed(0)
        model = CharLM()
        model(tf.zeros((1, context), tf.int64))
        if start_weights is not None:
            model.set_weights(start_weights)
        return model

    def train(self, model, spec, lr, schedule, steps, stream_seed):
        """As ``TorchFront.train``, in Keras: the lr set before each step from ``schedule``."""
        from hvdcompress import parse_spec
        from hvdcompress.bench.example_models import char_batches

        tf, hvc = self.tf, self.hvc
        if spec is not None and parse_spec(spec).name in ADAM_TAKEOVER:
            opt = tf.keras.optimizers.SGD(lr, momentum=0.0, weight_decay=0.1)
            spec = f"{spec},beta1=0.9,beta2=0.95,eps=1e-08"
        else:
            opt = tf.keras.optimizers.AdamW(lr, weight_decay=0.1, beta_1=0.9, beta_2=0.95, epsilon=1e-8)
        if spec is not None:
            opt = hvc.DistributedOptimizer(opt, compression=spec)
        model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        sent = (lambda: opt.stats.total_bytes) if spec is not None else (lambda: 0)
        batches = char_batches(self.text.train, self.cfg["batch"], self.cfg["model"]["context"],
                               seed=1000 * (self.rank() + 1) + stream_seed)
        warm, in_warmup = warmup_steps(self.cfg), 0
        for step in range(steps):
            if step == warm:
                in_warmup = sent()
            x, y = next(batches)
            opt.learning_rate.assign(lr * schedule(step))
            model.train_on_batch(x.numpy(), y.numpy())
        return in_warmup, sent()

    def start(self):
        model = self.model(None)
        self.train(model, "none", self.cfg["lr"], lambda s: 1.0, self.cfg["pretrain_steps"], 500)
        return model.get_weights()

    def phase(self, start_weights, spec, lr, seed):
        import numpy as np

        tf, hvc, context = self.tf, self.hvc, self.cfg["model"]["context"]
        model = self.model(start_weights)
        in_warmup, sent = self.train(model, spec, lr, lr_schedule("cosine", self.cfg["steps"]), self.cfg["steps"],
                                     7919 * seed)
        flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
        rows = hvc.allgather(flat[None], name=f"check.{spec}.{lr}.{seed}").numpy()
        identical = bool(all(np.array_equal(rows[0], r) for r in rows)) if spec is not None else None
        test = self.text.test.astype(np.int64)  # char_eval_loss's windows
        starts = np.linspace(0, len(test) - context - 2, self.cfg["eval_windows"]).astype(np.int64)
        win = test[starts[:, None] + np.arange(context + 1)[None]]
        loss = float(tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(win[:, 1:], model(win[:, :-1])))
        mean = float(hvc.allreduce(tf.constant([loss], tf.float64), name=f"loss.{spec}.{lr}.{seed}",
                                   op=hvc.Average)[0])
        return result(self.cfg, mean, loss, in_warmup, sent, identical)

    def close(self):
        self.hvc.shutdown()


FRONTS = {"horovod": HorovodFront, "ddp": DDPFront, "keras": KerasFront}
FRONT_NAMES = {"horovod": "PyTorch DistributedOptimizer on Horovod", "ddp": "torch DDP comm hook on gloo",
               "keras": "Keras DistributedOptimizer on Horovod"}


def result(cfg, mean, loss, in_warmup, sent, identical) -> dict:
    warm = warmup_steps(cfg)
    return {"final_loss": mean, "final_loss_rank": loss, "bytes_per_step": sent / cfg["steps"],
            "bytes_per_step_after_warmup": (sent - in_warmup) / (cfg["steps"] - warm), "identical": identical}


def warmup_steps(cfg) -> int:
    """``onebitadam``'s and ``topkadam``'s dense warm-up in steps (``--onebitadam-warmup`` of ``--steps``);
    every method's bytes are also counted over the steps after it (the steady state)."""
    return max(1, round(cfg["onebitadam_warmup"] * cfg["steps"]))


def worker_main(config_path: str) -> int:
    from hvdcompress.datasets import load_stdlib_text

    with open(config_path) as f:
        cfg = json.load(f)
    front = FRONTS[cfg.get("front", "horovod")](cfg)
    front.text = text = load_stdlib_text(cfg["corpus_bytes"])
    start_state = front.start() if cfg["pretrain_steps"] else None
    results = {}
    for name, template in cfg["configs"].items():
        specs = settings(template, cfg["ratios"], warmup_steps(cfg))
        first, runs = cfg["seeds"][0], []
        for spec, lr in itertools.product(specs, cfg["lrs"]):
            t0 = time.time()
            r = dict(front.phase(start_state, spec, lr, first), spec=spec, lr=lr, seed=first)
            r["seconds"] = time.time() - t0
            runs.append(r)
            if front.rank() == 0:
                print(f"[fidelity_adam] {name} {spec} lr {lr:g} seed {first}: loss {r['final_loss']:.4f}, "
                      f"{r['bytes_per_step']:.0f} B/step ({r['bytes_per_step_after_warmup']:.0f} after the warm-up), "
                      f"identical {r['identical']} ({r['seconds']:.0f} s)", flush=True)
        best = min(runs, key=lambda r: (r["final_loss"], r["lr"]))  # identical on every rank (a mean)
        for seed in cfg["seeds"][1:]:
            r = dict(front.phase(start_state, best["spec"], best["lr"], seed), spec=best["spec"], lr=best["lr"],
                     seed=seed)
            runs.append(r)
            if front.rank() == 0:
                print(f"[fidelity_adam] {name} {best['spec']} lr {best['lr']:g} seed {seed}: loss "
                      f"{r['final_loss']:.4f}", flush=True)
        results[name] = {"template": template, "spec": best["spec"], "lr": best["lr"], "runs": runs}
    rank = front.rank()
    with open(cfg["out"].format(rank=rank), "w") as f:
        json.dump({"rank": rank, "results": results, "corpus": text.source}, f)
    front.close()
    return 0


# -- orchestrator --------------------------------------------------------------------------------
def summarize(rank0: dict, seeds) -> dict:
    """Per method: its own setting's mean loss over the seeds, bytes, and the comparisons."""
    rows = {}
    for name, r in rank0["results"].items():
        own = [x for x in r["runs"] if x["spec"] == r["spec"] and x["lr"] == r["lr"] and x["seed"] in seeds]
        rows[name] = {"spec": r["spec"], "lr": r["lr"],
                      "sweep": [(x["spec"], x["lr"], x["final_loss"]) for x in r["runs"] if x["seed"] == seeds[0]],
                      "loss_per_seed": [x["final_loss"] for x in own],
                      "final_loss": statistics.mean(x["final_loss"] for x in own),
                      "bytes_per_step": statistics.mean(x["bytes_per_step"] for x in own),
                      "bytes_per_step_after_warmup": statistics.mean(x["bytes_per_step_after_warmup"] for x in own),
                      "identical": None if r["template"] is None else all(x["identical"] for x in r["runs"])}
    dense, alone = rows.get("none"), rows.get("alone")
    for name, row in rows.items():
        if dense is not None:
            row["loss_vs_dense_pct"] = 100.0 * (row["final_loss"] / dense["final_loss"] - 1.0)
            row["within_1pct"] = row["loss_vs_dense_pct"] <= 1.0
            row["fewer_bytes_than_dense"] = (dense["bytes_per_step"] / row["bytes_per_step"]
                                             if row["bytes_per_step"] else None)
            row["fewer_bytes_after_warmup"] = (dense["bytes_per_step"] / row["bytes_per_step_after_warmup"]
                                               if row["bytes_per_step_after_warmup"] else None)
        if alone is not None and name != "alone":
            row["better_than_alone"] = row["final_loss"] < alone["final_loss"]
    return rows


def table(report) -> str:
    m = report["meta"]
    out = [f"{m['workers']} workers ({FRONT_NAMES[m.get('front', 'horovod')]}), char LM {m['model']}, {m['steps']} steps after {m['pretrain_steps']} dense "
           f"pretraining steps, batch {m['batch_per_worker']} per worker, AdamW (wd 0.1, betas 0.9/0.95) with "
           f"cosine lr; seeds {m['seeds']}; sweep lrs {m['lrs']}, ratios {m['ratios']}; corpus: {m.get('corpus', '?')}.",
           "", "| method | spec (own setting) | lr | final loss (per seed) | mean | vs dense | bytes/worker/step | "
           "fewer bytes than dense | bytes/worker/step after warm-up | fewer after warm-up | better than alone | identical |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["rows"].items():
        vs = f"{r['loss_vs_dense_pct']:+.2f}%" if "loss_vs_dense_pct" in r and name != "none" else "-"
        spec = f"`{r['spec']}`" if r["spec"] is not None else "no exchange"
        fewer = f"{r['fewer_bytes_than_dense']:.1f}x" if r.get("fewer_bytes_than_dense") else "-"
        after = f"{r['bytes_per_step_after_warmup']:.0f}" if "bytes_per_step_after_warmup" in r else "-"
        fewer_after = f"{r['fewer_bytes_after_warmup']:.1f}x" if r.get("fewer_bytes_after_warmup") else "-"
        alone = {True: "yes", False: "**no**"}.get(r.get("better_than_alone"), "-")
        seeds = ", ".join(f"{v:.4f}" for v in r["loss_per_seed"])
        out.append(f"| {name} | {spec} | {r['lr']:g} | {seeds} | {r['final_loss']:.4f} | {vs} | "
                   f"{r['bytes_per_step']:.0f} | {fewer} | {after} | {fewer_after} | {alone} | {'-' if r['identical'] is None else r['identical']} |")
    return "\n".join(out)


def run(args, argv) -> int:
    from hvdcompress.bench.launch import Placement, WorkerFailure, run_workers

    every = configs()
    chosen = args.configs or [c for c in every if c not in VARIANTS]
    unknown = [c for c in chosen if c not in every]
    if unknown:
        print(f"unknown configs {unknown}; known: {', '.join(every)}", file=sys.stderr)
        return 2
    model = dict(QUICK_MODEL if args.quick else MODEL)
    for key in ("width", "layers", "context"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    config = {"configs": {c: every[c] for c in chosen}, "steps": args.steps, "batch": args.batch, "lr": args.lrs[0],
              "lrs": args.lrs, "ratios": args.ratios, "seeds": args.seeds, "pretrain_steps": args.pretrain_steps,
              "onebitadam_warmup": args.onebitadam_warmup, "corpus_bytes": args.corpus_bytes, "model": model,
              "eval_windows": 16 if args.quick else 256, "threads": 1, "front": args.front}
    meta = {"command": "python benchmarks/fidelity_adam.py " + shlex.join(argv), "front": args.front,
            "workers": args.workers,
            "steps": args.steps, "pretrain_steps": args.pretrain_steps, "batch_per_worker": args.batch,
            "model": model, "lrs": args.lrs, "ratios": args.ratios, "seeds": args.seeds,
            "onebitadam_warmup_fraction": args.onebitadam_warmup, "network": "loopback",
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1_5_15_at_start": list(os.getloadavg()), "machine": f"{os.cpu_count()} cores"}
    with tempfile.TemporaryDirectory(prefix="hvcfidelityadam-") as tmp:
        try:
            ranks = run_workers(Placement.loopback(args.workers), config, tmp, args.launch_timeout,
                                lambda line: print(line, flush=True),
                                worker_argv=[os.path.abspath(__file__), "worker"])
        except WorkerFailure as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    meta["corpus"] = ranks[0]["corpus"]
    meta["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta["load_average_1_5_15_at_end"] = list(os.getloadavg())
    report = {"meta": meta, "rows": summarize(ranks[0], args.seeds)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def _floats(text):
    return [float(v) for v in str(text).split(",") if v.strip()]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--front", choices=sorted(FRONTS), default="horovod",
                   help="horovod: PyTorch DistributedOptimizer (default); ddp: torch DDP with hvdcompress.ddp's comm "
                        "hook on torch.distributed gloo (no Horovod); keras: hvdcompress.keras on Horovod TensorFlow")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--pretrain-steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lrs", type=_floats, default=[3e-3], help="comma-separated peak learning rates swept (first seed)")
    p.add_argument("--ratios", type=_floats, default=[0.01], help="comma-separated densities swept for ratio specs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--onebitadam-warmup", type=float, default=0.03,
                   help="onebitadam's and topkadam's dense warm-up as a fraction of --steps")
    p.add_argument("--configs", nargs="*", default=None, help="subset of methods (default: alone and every spec)")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--quick", action="store_true", help="diloco_wan's tiny model (smoke test; figures mean nothing)")
    p.add_argument("--launch-timeout", type=float, default=6 * 3600.0)
    p.add_argument("--out", default="benchmarks/results/fidelity/adamw-4workers")
    args = p.parse_args(argv)
    if args.quick:
        args.width = args.layers = args.context = None
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
