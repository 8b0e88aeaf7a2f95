"""What each group was sent with, and the figures that decided it: a plan explained in rows.

A user who asks for ``topk:ratio=0.01`` and sees 1.1x fewer bytes deserves to know why: with the
per-group codec choice the plan may send a group dense or in fp16 where the cost model (and then
the measured validation) found the spec slower on this link. ``explain`` turns a plan and the cost
model it was made with into one row per group -- what the group was sent with and, for every spec
it could have been sent with, the *predicted* seconds of that group alone (compression and the
hand-over of its collectives, the exchange, the decoding where fitted; the closing group's skew
term too) -- and one row per candidate plan the measured validation ran, with its *measured*
median step. Predicted and measured figures are labelled as such: the choice itself is made
jointly with the partition over the whole step's timeline (``planner.make_plan``), so the
per-group figures explain it, they do not replay it; where the validation ran, its measurement
decided.

Pure functions over plans, sizes and a ``CostModel``: no torch, no TensorFlow, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..spec import resolve

KINDS = ("spec", "fp16", "dense")
DEFAULT_ALTERNATIVES = ("fp16", "none")


@dataclass(frozen=True)
class GroupRow:
    """One group of the plan in use: its members, dense size, what it was sent with (``sent``: the
    spec string; ``kind``: "spec", "fp16" or "dense") and, per spec it could be sent with, the
    predicted seconds of the group alone (None where the cost model has no fit for that spec)."""

    index: int
    names: Tuple[str, ...]
    nbytes: float
    sent: str
    kind: str
    predicted: Tuple[Tuple[str, Optional[float]], ...]
    closing: bool = False  # the step's last group (its exchange is charged the skew term)

    @property
    def fastest(self) -> Optional[str]:
        """The kind predicted fastest for this group alone (None when nothing is predicted)."""
        known = [(s, k) for k, s in self.predicted if s is not None]
        return min(known)[1] if known else None

    def as_dict(self) -> dict:
        return {"index": self.index, "names": list(self.names), "bytes": self.nbytes, "sent": self.sent,
                "kind": self.kind, "closing": self.closing, "fastest_predicted": self.fastest,
                "predicted_seconds": {k: s for k, s in self.predicted}}


@dataclass(frozen=True)
class CandidateRow:
    """One candidate plan of the measured validation: its label, how many groups went with each
    kind, the model's predicted step and the measured median step (slowest rank), and whether it
    was kept."""

    label: str
    kinds: Tuple[Tuple[str, int], ...]
    predicted_seconds: Optional[float]
    measured_seconds: Optional[float]
    kept: bool

    def as_dict(self) -> dict:
        return {"label": self.label, "groups_by_kind": dict(self.kinds),
                "predicted_seconds": self.predicted_seconds, "measured_seconds": self.measured_seconds,
                "kept": self.kept}


@dataclass(frozen=True)
class Decisions:
    """Per group what was sent and why (``groups``), the measured candidates (``measured``, empty
    when no validation ran), the codec choice in use ("auto" or "off") and what decided the plan
    (``basis``: "measured", "predicted" or "fixed": a schedule without a cost model)."""

    spec: str
    codec_choice: str
    basis: str
    groups: Tuple[GroupRow, ...]
    measured: Tuple[CandidateRow, ...] = ()

    def counts(self) -> Dict[str, int]:
        """Groups sent with each kind ("spec", "fp16", "dense")."""
        out = {k: 0 for k in KINDS}
        for g in self.groups:
            out[g.kind] += 1
        return out

    def as_dict(self) -> dict:
        return {"spec": self.spec, "codec_choice": self.codec_choice, "basis": self.basis,
                "groups_by_kind": self.counts(), "groups": [g.as_dict() for g in self.groups],
                "measured": [c.as_dict() for c in self.measured]}

    def lines(self, max_names: int = 2) -> List[str]:
        """A readable table: a heading, one line per group, then the measured candidates."""
        c = self.counts()
        basis = "fixed schedule, nothing predicted" if self.basis == "fixed" else self.basis
        head = (f"codec choice {self.codec_choice} ({basis}): {len(self.groups)} group(s), "
                f"{c['spec']} sent {self.spec}, {c['fp16']} fp16, {c['dense']} dense")
        out = [head]
        if self.groups and any(s is not None for g in self.groups for _, s in g.predicted):
            kinds = [k for k, _ in self.groups[0].predicted]
            out.append(f"  {'group':>5}  {'tensors':<28} {'KiB':>8}  {'sent':<5}  ms alone "
                       + "  ".join(f"{k:>6}" for k in kinds))
            for g in self.groups:
                shown = ", ".join(g.names[:max_names]) + (f" +{len(g.names) - max_names}" if len(g.names) > max_names else "")
                cells = "  ".join(f"{s * 1e3:6.2f}" if s is not None else f"{'-':>6}" for _, s in g.predicted)
                mark = " (closing)" if g.closing else ""
                out.append(f"  {g.index:>5}  {shown[:28]:<28} {g.nbytes / 1024:8.1f}  {g.kind:<5}  "
                           f"{'':<9}{cells}{mark}")
            if self.codec_choice == "auto":
                out.append("  (ms alone: predicted for the group by itself; the choice weighs the whole step, "
                           "where an exchange hidden behind backward costs nothing)")
        if self.measured:
            out.append("  measured validation (median step, slowest rank; predicted by the model):")
            for m in self.measured:
                kinds = ", ".join(f"{n} {k}" for k, n in m.kinds if n)
                pred = f"{m.predicted_seconds * 1e3:.1f}" if m.predicted_seconds is not None else "-"
                meas = f"{m.measured_seconds * 1e3:.1f}" if m.measured_seconds is not None else "-"
                out.append(f"  {'*' if m.kept else ' '} {m.label:<28} measured {meas:>7} ms  predicted "
                           f"{pred:>7} ms  ({kinds})")
        return out


def kind_of(sent: str, spec) -> str:
    """"dense" for a none spec, "fp16" for fp16, else "spec" (the compressor's own)."""
    name = resolve(sent).name
    if name == "none" and resolve(spec).name != "none":
        return "dense"
    if name == "fp16" and resolve(spec).name != "fp16":
        return "fp16"
    return "spec"


def calibrated(cost_model, calibration: Optional[Mapping[str, float]]):
    """``cost_model`` scaled by a scheduler's ``calibration`` (compress, decompress, skew), the
    model its plan was made with; ``cost_model`` itself without one."""
    if cost_model is None or not calibration:
        return cost_model
    return cost_model.scaled(calibration.get("compress", 1.0),
                             calibration.get("decompress", 1.0)).with_skew(calibration.get("skew", 0.0))


def group_seconds(cost_model, spec, nbytes: float, world: int, itemsize: int = 4,
                  closing: bool = False) -> Optional[float]:
    """Predicted seconds of one group of ``nbytes`` sent alone with ``spec``: compression and the
    hand-over of its collectives, the exchange, decoding where fitted, and for the closing group
    the skew term. None where the model has no compression-time fit for ``spec``."""
    if not cost_model.has_compress_fit(spec):
        return None
    t = (float(cost_model.group_cpu_seconds(spec, [nbytes], itemsize)[0])
         + float(cost_model.exchange_seconds(spec, [nbytes], world, itemsize)[0])
         + float(cost_model.decompress_seconds(spec, [nbytes], itemsize)[0]))
    if closing:
        t += float(cost_model.closing_seconds(spec, [nbytes], world, itemsize)[0])
    return t


def _kinds(codecs: Optional[Sequence[str]], n: int, spec) -> Tuple[Tuple[str, int], ...]:
    counts = {k: 0 for k in KINDS}
    for k in (kind_of(c, spec) for c in (codecs or [str(spec)] * n)):
        counts[k] += 1
    return tuple(counts.items())


def measured_rows(tuning: Optional[Mapping], spec) -> Tuple[CandidateRow, ...]:
    """The candidates of a plan's measured validation record (``Plan.tuning``) as rows; () when
    none ran or it is still in progress."""
    if not tuning or "candidates" not in tuning:
        return ()
    medians = list(tuning.get("medians_seconds") or [])
    kept = tuning.get("kept")
    rows = []
    for i, c in enumerate(tuning["candidates"]):
        rows.append(CandidateRow(str(c["label"]), _kinds(c.get("codecs"), len(c["groups"]), spec),
                                 c.get("predicted_seconds"), medians[i] if i < len(medians) else None, i == kept))
    return tuple(rows)


def explain_groups(members: Sequence[Sequence[str]], sizes_bytes: Sequence[float], sent: Sequence[Optional[str]],
                   spec, cost_model=None, world: Optional[int] = None, codec_choice: str = "off",
                   alternatives: Sequence[str] = DEFAULT_ALTERNATIVES, itemsize: int = 4, tuning=None,
                   predicted_seconds: Optional[float] = None) -> Decisions:
    """The ``Decisions`` of groups given directly, in exchange order: each one's member names,
    dense bytes and the spec it is sent with (None: ``spec``). ``cost_model``: the model the plan
    was made with (calibrated: ``calibrated``), or None (then nothing is predicted); ``world``
    defaults to the model's. ``alternatives``: the specs predicted beside ``spec`` in every row,
    whether or not the choice was on (so that "off" still shows what the choice would weigh).
    ``tuning``: the measured validation's record (``Plan.tuning``); ``predicted_seconds``: the
    plan's predicted step (None: no model)."""
    spec = resolve(spec)
    if codec_choice not in ("auto", "off"):
        raise ValueError(f"codec_choice: must be 'auto' or 'off'; got {codec_choice!r}")
    if not len(members) == len(sizes_bytes) == len(sent):
        raise ValueError(f"members, sizes_bytes, sent: one per group; got {len(members)}, {len(sizes_bytes)}, "
                         f"{len(sent)}")
    options = [("spec", spec)]
    for alt in alternatives:
        alt = resolve(alt)
        kind = kind_of(str(alt), spec)
        if kind != "spec" and all(k != kind for k, _ in options):
            options.append((kind, alt))
    world = (cost_model.world_size if cost_model is not None else 1) if world is None else int(world)
    rows = []
    for gi, (names, nbytes, codec) in enumerate(zip(members, sizes_bytes, sent)):
        codec = str(spec) if codec is None else str(resolve(codec))
        closing = gi == len(members) - 1
        predicted = tuple((k, None if cost_model is None else
                           group_seconds(cost_model, o, float(nbytes), world, itemsize, closing)) for k, o in options)
        rows.append(GroupRow(gi, tuple(str(n) for n in names), float(nbytes), codec, kind_of(codec, spec),
                             predicted, closing))
    measured = measured_rows(tuning, spec)
    basis = "measured" if measured else ("predicted" if predicted_seconds is not None else "fixed")
    return Decisions(str(spec), codec_choice, basis, tuple(rows), measured)


def explain(plan, names: Sequence[str], sizes_bytes: Sequence[float], spec, cost_model=None,
            world: Optional[int] = None, codec_choice: str = "off",
            alternatives: Sequence[str] = DEFAULT_ALTERNATIVES, itemsize: int = 4) -> Decisions:
    """The ``Decisions`` of ``plan`` (a ``planner.Plan``, or None before one is made; its groups
    index ``names``/``sizes_bytes``, tensors in backward order) for ``spec``; the other arguments
    as ``explain_groups``."""
    if len(names) != len(sizes_bytes):
        raise ValueError(f"names: one per size ({len(sizes_bytes)}); got {len(names)}")
    if plan is None:
        return explain_groups((), (), (), spec, None, world, codec_choice, alternatives, itemsize)
    codecs = plan.codecs or [None] * len(plan.groups)
    return explain_groups([[names[i] for i in g] for g in plan.groups],
                          [sum(float(sizes_bytes[i]) for i in g) for g in plan.groups], codecs, spec, cost_model,
                          world, codec_choice, alternatives, itemsize, plan.tuning, plan.predicted_seconds)


__all__ = ["CandidateRow", "Decisions", "GroupRow", "KINDS", "calibrated", "explain", "explain_groups", "group_seconds", "kind_of",
           "measured_rows"]
