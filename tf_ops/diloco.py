"""DiLoCo, Streaming DiLoCo and SparseLoCo for TensorFlow 2 / Keras.

``DiLoCo`` runs the outer loop of ``hvdcompress.diloco`` (its module doc states the rules; the
numpy oracle is ``hvdcompress.reference.diloco``) over a list of ``tf.Variable`` s trained by any
inner optimizer: call ``step()`` after every inner step (eagerly, outside ``tf.function``).
``DiLoCoCallback`` does that for ``model.fit`` (after every training batch) and flushes at the end
of training. Inner steps exchange nothing; a fragment's pseudo-gradients ``Delta_i =
theta_global - theta_i`` (global MINUS local) are compressed with the spec (error feedback on the
pseudo-gradient where the spec has it) and exchanged on an ``ExchangeSession`` (``tf_ops.session``:
the compressor, the non-finite guard -- a NaN or inf on any rank makes the result NaN on every
rank --, the transport, Horovod's ``tf_ops.collectives.Communicator`` unless one is given as
``transport=``, and the wire statistics, ``stats``: one count per outer exchange of a fragment);
this module is the adapter that turns inner steps into outer rounds.

The outer optimizer is SGD with momentum (default lr 0.7, momentum 0.9, Nesterov), written out:
``buf = m * buf + g`` (buf starts at 0), ``d = g + m * buf`` (Nesterov) or ``buf``, ``theta +=
-lr * d``; then the local variables become ``theta + mix * (local - theta)``.

One difference from PyTorch, forced by eager Horovod ops on TensorFlow (they block): the
exchange completes when it is launched, and its result waits in a variable for ``overlap_steps``
inner steps before it is applied: the same arithmetic, without hiding the latency.

State: ``DiLoCo`` is a ``tf.Module``; ``tf.train.Checkpoint(diloco=...)`` saves the global
parameters, the outer momentum, this rank's compression state, the counters and the result in
flight, so resuming is exact (Horovod Elastic: put it in ``TensorFlowKerasState``'s checkpointed
objects, or restore it from a checkpoint after a reset).
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import tensorflow as tf

from hvdcompress.contract import transport_argument
from hvdcompress.diloco import OUTER_LR, OUTER_MOMENTUM, OUTER_NESTEROV, check_arguments, split_fragments
from hvdcompress.stats import WireStats

from .session import ExchangeSession, Untracked, exchange_name
from .variables import created_eagerly


class DiLoCo(tf.Module):
    """The DiLoCo outer loop over ``variables`` (module doc). Arguments as
    ``hvdcompress.torch.DiLoCo``'s, with the outer SGD's ``outer_lr``, ``outer_momentum`` and
    ``nesterov`` in place of an outer optimizer object. The variables must be identical on every
    rank when the first ``step()`` runs (broadcast them first); ``theta_global`` starts there.
    ``driver=`` is the deprecated former name of ``transport=`` (a DeprecationWarning)."""

    def __init__(self, variables: Sequence[tf.Variable], sync_every: int = 500, fragments: int = 1,
                 overlap_steps: int = 0, mix: float = 0.0, compression=None, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, nesterov: bool = OUTER_NESTEROV, process_set=None,
                 transport=None, names: Optional[Sequence[str]] = None, driver=None):
        transport = transport_argument(transport, driver, "DiLoCo")
        super().__init__(name="diloco")
        variables = list(variables)
        self.cfg = check_arguments(len(variables), sync_every, fragments, overlap_steps, mix, compression)
        for label, v in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
                raise ValueError(f"DiLoCo: {label} must be a float in [0.0, inf); got {v!r}")
        if not all(isinstance(v, tf.Variable) for v in variables):
            raise ValueError("DiLoCo: variables must be tf.Variable s (e.g. model.trainable_variables)")
        self._vars = variables
        # exchange names (Horovod matches ops across ranks by name): position, then a readable tag
        tags = list(names) if names is not None else [""] * len(variables)
        self.names = [f"v{i}" + ("." + "".join(c if c.isalnum() else "_" for c in str(n)) if n else "")
                      for i, n in enumerate(tags)]
        self._session = Untracked(ExchangeSession(self.cfg.compression, transport=transport, prefix="hvc.diloco"))
        self.compressor = self.session.compressor
        self.fragments = split_fragments([int(v.shape.num_elements()) for v in variables], self.cfg.fragments)
        self.lr, self.momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self._process_set = process_set
        with tf.init_scope(), created_eagerly():
            self.global_params = [tf.Variable(v, trainable=False, name=f"global_{i}") for i, v in enumerate(variables)]
            self.momentum_buffers = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"outer_momentum_{i}")
                                     for i, v in enumerate(variables)]
            self.pending = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"in_flight_{i}")
                            for i, v in enumerate(variables)]
            self.comp_state = [self.session.new_state(tuple(v.shape), v.dtype) for v in variables]
            self.t = self.session.counter("step")
            self.rounds = self.session.counter("rounds", [0] * self.cfg.fragments)
            self.in_flight = tf.Variable([-1, -1], dtype=tf.int64, trainable=False, name="in_flight")  # fragment, due
            self.bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_sent")
            self._started = tf.Variable(False, trainable=False, name="started")

    @property
    def session(self) -> ExchangeSession:
        """The exchange session (``tf_ops.session``) this outer loop is the adapter of."""
        return self._session.value

    @property
    def transport(self):
        """The transport the pseudo-gradients travel on."""
        return self.session.transport(self._process_set)

    @property
    def driver(self):
        """Deprecated: the former name of ``transport`` (removed in the next release)."""
        warnings.warn("DiLoCo.driver is deprecated and will be removed in the next release; use "
                      "DiLoCo.transport", DeprecationWarning, stacklevel=2)
        return self.transport

    @property
    def stats(self) -> WireStats:
        """Bytes this rank handed to the transport per outer exchange (one fragment's sync, a
        ``steps`` count each; a flush counts one per fragment) and in total, next to dense."""
        return self.session.stats

    @property
    def started(self) -> bool:
        """Whether ``start()`` took the variables as ``theta_global`` (saved with the checkpoint)."""
        return bool(self._started.numpy())

    def _world(self) -> int:
        from hvdcompress.schedule.groups import process_set_size
        ps = self.transport.process_set
        return process_set_size(ps) if ps is not None else 1

    def _rank(self) -> int:
        ps = self.transport.process_set
        return int(ps.rank()) if ps is not None else 0

    # -- the outer loop ---------------------------------------------------------------------------
    def start(self) -> None:
        """Take the variables as ``theta_global`` (done by the first ``step()`` when not called)."""
        for g, v in zip(self.global_params, self._vars):
            g.assign(v)
        self._started.assign(True)

    def step(self) -> None:
        """After an inner step: launch and/or apply the fragment the schedule names (module doc)."""
        if not self.started:
            raise RuntimeError("DiLoCo.step: call start() before the first inner step (or use DiLoCoCallback)")
        t = int(self.t.assign_add(1).numpy())
        p = self.cfg.launched_at(t)
        if p is not None:
            self._launch(p, self.cfg.due(t))
        fragment, due = (int(x) for x in self.in_flight.numpy())
        if fragment >= 0 and due == t:
            self._apply(fragment, self.cfg.mix)

    def flush(self) -> None:
        """Apply the fragment in flight now, then sync every fragment at once with mix 0: every rank
        then holds ``theta_global`` (identical replicas). A collective: call it on every rank."""
        fragment = int(self.in_flight.numpy()[0])
        if fragment >= 0:
            self._apply(fragment, self.cfg.mix)
        t = int(self.t.numpy())
        for p in range(self.cfg.fragments):
            self._launch(p, t)
            self._apply(p, 0.0)

    def global_parameters(self) -> List[tf.Tensor]:
        return [tf.identity(g) for g in self.global_params]

    def _launch(self, p: int, due: int) -> None:
        world = self._world()
        rnd = int(self.rounds.numpy()[p])
        session, rank = self.session, self._rank()
        gens, names = [], []
        for i in self.fragments[p]:
            delta = tf.reshape(self.global_params[i] - self._vars[i], [-1])
            gens.append(session.start(delta, key=self.names[i], step=rnd, world_size=world, scale=1.0 / world,
                                      state=self.comp_state[i], shape=tuple(self._vars[i].shape), rank=rank,
                                      where=f"'{self.names[i]}'"))
            names.append(exchange_name(session.prefix, self.names[i], f"s{rnd}"))
        results, sent = session.run(gens, names, self._process_set)
        for i, res in zip(self.fragments[p], results):
            self.pending[i].assign(tf.reshape(tf.cast(res, self.pending[i].dtype), self.pending[i].shape))
        self.bytes_sent.assign_add(sent)
        self.session.count(sent, sum(int(self._vars[i].shape.num_elements()) * self._vars[i].dtype.size
                                     for i in self.fragments[p]))
        self.rounds.scatter_nd_update([[p]], [rnd + 1])
        self.in_flight.assign([p, due])

    def _apply(self, p: int, mix: float) -> None:
        m, lr = self.momentum, self.lr
        for i in self.fragments[p]:
            g = self.pending[i]
            theta = self.global_params[i]
            if m != 0.0:
                buf = self.momentum_buffers[i].assign(self.momentum_buffers[i] * tf.cast(m, g.dtype) + g)
                d = g + tf.cast(m, g.dtype) * buf if self.nesterov else tf.identity(buf)
            else:
                d = tf.identity(g)
            theta.assign(theta + tf.cast(-lr, g.dtype) * d)
            if mix == 0.0:
                self._vars[i].assign(theta)
            else:
                self._vars[i].assign(theta + tf.cast(mix, g.dtype) * (self._vars[i] - theta))
        self.in_flight.assign([-1, -1])


class DiLoCoCallback(tf.keras.callbacks.Callback):
    """Runs ``DiLoCo`` for ``model.fit``: built on the model's trainable variables when training
    begins (after ``BroadcastGlobalVariablesCallback``: place this callback after it), stepped
    after every training batch, flushed at the end of training (identical replicas). Arguments as
    ``DiLoCo``'s; ``self.diloco`` is the outer loop (checkpoint it with ``tf.train.Checkpoint``).
    The arguments are checked when the callback is made (ValueError before any collective)."""

    def __init__(self, sync_every: int = 500, flush_at_end: bool = True, **kwargs):
        super().__init__()
        check_arguments(max(1, int(kwargs.get("fragments", 1))), sync_every, kwargs.get("fragments", 1),
                        kwargs.get("overlap_steps", 0), kwargs.get("mix", 0.0), kwargs.get("compression"))
        self._kwargs = dict(kwargs, sync_every=sync_every)
        self.flush_at_end = bool(flush_at_end)
        self.diloco: Optional[DiLoCo] = None

    def on_train_begin(self, logs=None):
        if self.diloco is None:
            variables = self.model.trainable_variables
            self.diloco = DiLoCo(variables, names=[v.name for v in variables], **self._kwargs)
        if not self.diloco.started:
            self.diloco.start()

    def on_train_batch_end(self, batch, logs=None):
        self.diloco.step()

    def on_train_end(self, logs=None):
        if self.flush_at_end:
            self.diloco.flush()
