"""Measured validation of cost-model plans: try a few candidate plans for some steps, keep the fastest.

The cost model can be wrong where it matters most (a collective completes only when the slowest
rank has compressed and contributed; rank skew and load are not in an alpha-beta fit), so a plan
it calls optimal may be slower than a plain fixed one. Horovod's own autotuner meets the same
problem for its fusion threshold by measuring; this module does the same for merge plans. Pure
functions over plans and step times (no torch, no Horovod); ``torch_ops.scheduling`` runs them.

After profiling, ``propose`` lists the candidates, in this order, duplicates (same groups) and
candidates beyond ``max_candidates`` dropped:

1. the plan the schedule asked for (the model's optimum for "mgs"/"mgwfbp", the greedy rule's
   plan for ":greedy") -- first, so that it wins ties;
2. the other search's plan (greedy for the exact search, exact for greedy);
3. ``single`` (one group after backward);
4. two Horovod-fusion-like size plans, thresholds 1/4 and 1/16 of the model's gradient bytes
   (``size_fractions``): a few large groups, and many mid-sized ones;
5. ``layerwise``, only when the model predicts it within ``layerwise_within`` (1.5x) of the best
   predicted candidate (one exchange per tensor is rarely worth trying on a deep model: a
   ResNet-50 has 161 tensors).

The candidates take turns, one step each, the model's first: one settling round (new buffers,
Horovod's response cache learning the new collective names: not counted), then ``tune_steps``
measured rounds -- interleaved, so a load that drifts (a shared machine, another job) weighs on
every candidate alike instead of on whichever ran last. A step's time is the
slowest rank's (every rank waits for it); a candidate's time is the median of its steps
(``step_times``). ``select`` keeps the candidate with the smallest median; candidates within
``tolerance`` (2%) of it count as ties, and the earliest of them wins, so the model's own plan
is kept unless another is measurably faster.

A few steps per candidate are noisy, and the more candidates, the likelier one that is not
faster measures fastest by luck. So ``select(..., noise_z=z)`` keeps the first candidate (the
cost model's pick) unless the smallest median is below its own by more than ``z`` standard errors
of the difference of two medians, the step noise measured from the candidates' own steps
(``step_noise``) -- and by more than ``tolerance`` in any case; only then the earliest within
``tolerance`` of the smallest median wins, as above. ``noise_z=0`` is the rule above. The
scheduler passes ``NOISE_Z`` (1) with the per-group codec choice, whose list is the longest (up to
8 candidates, several the same partition sent with other specs).

With a per-group codec choice (``codec_choice="auto"``) the candidates are the choice's plan,
then the fixed choices -- the compressor, fp16 and dense, each on every group and on the
partition the planner makes for that spec alone -- then the compressor on every group of each
other partition ``propose`` lists for it alone (what the validation without the choice
measures), then the choice's other partitions while there are fewer than ``MAX_CANDIDATES``
(``with_fixed_choices``). The
cost model may err most on which spec pays: measuring the fixed choices bounds what such an error
can cost, and measuring the compressor's own candidates keeps the plan kept from being measurably
slower than the one the validation without the choice would keep. At most
``MAX_CHOICE_CANDIDATES`` (8): the choice, the compressor's own list (at most ``MAX_CANDIDATES``,
its model plan being its fixed choice) and fp16 and dense.

After the decision the load can change (another job, the link), so the scheduler may watch the
kept plan (``revalidate_every`` steps per window): at the end of every window each rank's step
times are gathered and rank 0 takes the median of the slowest rank's step (``window_median``).
The first window after a decision gives the reference -- not the validation's median, whose steps
ran interleaved with the other candidates, each one new to its buffers and to Horovod, and would
differ from steady steps on a stable machine too. A later window whose median differs from the
reference by more than ``DRIFT_THRESHOLD`` (25%), slower or faster (``drifted``), re-runs the
measured validation over the same candidates; its decision starts a new reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

MAX_TUNE_STEPS = 100
DEFAULT_TUNE_STEPS = 3
SIZE_FRACTIONS = (1 / 4, 1 / 16)
MAX_CANDIDATES = 5
# with the codec choice: the choice, the compressor's own candidates (``propose``) and two fixed choices
MAX_CHOICE_CANDIDATES = 1 + MAX_CANDIDATES + 2
LAYERWISE_WITHIN = 1.5
TOLERANCE = 0.02
# with the codec choice (``select``'s noise_z): standard errors of the difference of two medians a
# candidate must gain over the cost model's pick to be kept instead
NOISE_Z = 1.0
# the median of |X - Y| for two independent normal draws of deviation s is sqrt(2) * 0.6745 * s
_PAIR_MEDIAN = math.sqrt(2.0) * 0.6744897501960817
# a sample median's standard error is sqrt(pi / 2) * s / sqrt(n) (normal steps, n not tiny)
_MEDIAN_SE = math.sqrt(math.pi / 2.0)
# re-validation on drift (``drifted``): the median step of a window against the kept plan's reference
DRIFT_THRESHOLD = 0.25  # relative change, either way, that re-runs the measured validation
DEFAULT_REVALIDATE_EVERY = 100  # steps per window with codec_choice="auto" (0 otherwise: off)
MIN_REVALIDATE_EVERY = 3  # a window's median needs a few steps
MAX_REVALIDATE_EVERY = 1_000_000


def check_tune_steps(n) -> int:
    """``tune_steps``: measured steps per candidate plan, an int in [0, 100]; 0 disables tuning."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TUNE_STEPS:
        raise ValueError(f"tune_steps: must be an int in [0, {MAX_TUNE_STEPS}] (0: no measured validation "
                         f"of the cost model's plan); got {n!r}")
    return n


@dataclass(frozen=True)
class Candidate:
    """A plan to measure: a label ("mgs", "single", "size:4.1", ...), its groups (tensor indices in
    backward order) and the model's predicted step time (None if unknown)."""

    label: str
    groups: Tuple[Tuple[int, ...], ...]
    predicted_seconds: Optional[float]
    codecs: Optional[Tuple[str, ...]] = None  # per group, its spec (None: the compressor's, all)

    def to_dict(self) -> dict:
        return {"label": self.label, "groups": [list(g) for g in self.groups],
                "predicted_seconds": self.predicted_seconds,
                "codecs": None if self.codecs is None else list(self.codecs)}

    @classmethod
    def from_dict(cls, d) -> "Candidate":
        p, c = d.get("predicted_seconds"), d.get("codecs")
        return cls(str(d["label"]), tuple(tuple(int(i) for i in g) for g in d["groups"]),
                   None if p is None else float(p), None if c is None else tuple(str(x) for x in c))


def candidate(label: str, plan) -> Candidate:
    """The candidate of a plan (its groups, predicted time and per-group specs)."""
    codecs = getattr(plan, "codecs", None)
    return Candidate(label, tuple(tuple(int(i) for i in g) for g in plan.groups), plan.predicted_seconds,
                     None if codecs is None else tuple(codecs))


def everywhere(cand: Candidate, spec: str, name: str) -> Candidate:
    """``cand`` 's groups each sent with ``spec`` (its string), labelled "<label> (all <name>)"."""
    return Candidate(f"{cand.label} (all {name})", cand.groups, cand.predicted_seconds, (str(spec),) * len(cand.groups))


def with_fixed_choices(candidates: Sequence[Candidate], fixed: Sequence[Tuple[str, object]],
                       max_candidates: int = MAX_CANDIDATES, spec_alone: Sequence[Candidate] = ()) -> List[Candidate]:
    """The candidates of a per-group codec choice with the fixed choices measured beside it.

    ``candidates[0]`` is the choice (first, so that it wins ties); then every ``(label, plan)`` of
    ``fixed`` -- one spec on every group (the compressor, fp16, dense), each on the partition the
    planner makes for that spec alone; then ``spec_alone``, the compressor's own candidates (those
    the validation without the choice measures, with their specs given: ``everywhere``). None of
    these is dropped, so the plan kept is never measurably slower than the best of them. Then the
    rest of ``candidates`` (other partitions of the choice) while the list is shorter than
    ``max_candidates``. Duplicates (same groups and specs) are dropped, so there are at most
    ``max(max_candidates, 1 + len(fixed) + len(spec_alone))`` candidates."""
    if max_candidates < 1:
        raise ValueError(f"max_candidates: must be >= 1; got {max_candidates!r}")
    if not candidates:
        raise ValueError("with_fixed_choices: no candidates (the choice comes first)")
    out, seen = [], set()

    def add(cand):
        if (cand.groups, cand.codecs) not in seen:
            seen.add((cand.groups, cand.codecs))
            out.append(cand)

    add(candidates[0])
    for label, plan in fixed:
        add(candidate(label, plan))
    for cand in spec_alone:
        add(cand)
    for cand in candidates[1:]:
        if len(out) >= max_candidates:
            break
        add(cand)
    return out


def size_label(threshold_bytes: float) -> str:
    """The schedule string of a size plan with this threshold (MiB, 3 significant digits)."""
    return f"size:{threshold_bytes / (1 << 20):.3g}"


def propose(plan_fn, asked: str, sizes_bytes: Sequence[float], *, size_fractions=SIZE_FRACTIONS,
            max_candidates: int = MAX_CANDIDATES, layerwise_within: float = LAYERWISE_WITHIN) -> List[Candidate]:
    """The candidates of the module doc. ``plan_fn(schedule_string)`` makes a plan with the
    (calibrated) cost model and returns an object with ``groups`` and ``predicted_seconds`` (a
    ``hvdcompress.schedule.planner.Plan``); ``asked`` is the resolved cost-model schedule ("mgs",
    "mgwfbp:greedy", ...)."""
    if max_candidates < 1:
        raise ValueError(f"max_candidates: must be >= 1; got {max_candidates!r}")
    kind, _, search = asked.partition(":")
    other = kind if search == "greedy" else f"{kind}:greedy"
    total = float(np.sum(np.asarray(sizes_bytes, dtype=float)))
    schedules = [asked, other, "single"]
    schedules += [size_label(total * f) for f in size_fractions if total * f > 0]
    out: List[Candidate] = []
    seen = set()

    def add(label, plan):
        cand = candidate(label, plan)
        if (cand.groups, cand.codecs) not in seen and len(out) < max_candidates:
            seen.add((cand.groups, cand.codecs))
            out.append(cand)

    for s in schedules:
        add(s, plan_fn(s))
    lw = plan_fn("layerwise")
    known = [c.predicted_seconds for c in out if c.predicted_seconds is not None]
    if lw.predicted_seconds is not None and known and lw.predicted_seconds <= layerwise_within * min(known):
        add("layerwise", lw)
    return out


def step_times(per_rank: Sequence[Sequence[Sequence[float]]]) -> List[List[float]]:
    """``per_rank[r][c][s]``: rank r's time of step s of candidate c -> the slowest rank's time
    of every step (every rank waits for the slowest one)."""
    if not per_rank:
        raise ValueError("step_times: no ranks")
    shape = [len(c) for c in per_rank[0]]
    for r in per_rank:
        if [len(c) for c in r] != shape:
            raise ValueError("step_times: every rank must report the same steps of the same candidates")
    return [[max(float(r[c][s]) for r in per_rank) for s in range(n)] for c, n in enumerate(shape)]


def _finite(steps) -> List[float]:
    return [float(x) for x in steps if x is not None and math.isfinite(float(x))]


def step_noise(times: Sequence[Sequence[float]]) -> float:
    """The measured noise of one step's time, relative to the step (an estimate of its standard
    deviation over its typical value): within every candidate, each pair of its finite steps'
    absolute difference over the candidate's median step; all pooled, their median over the median
    of |X - Y| for two normal draws of unit deviation (0.954). Robust to an odd slow step, and
    blind to the candidates' own differences (steps are compared within a candidate only). 0 when
    no candidate has two finite steps (one measured step each: no noise can be told)."""
    pairs = []
    for t in times:
        steps = _finite(t)
        if len(steps) < 2:
            continue
        mid = float(np.median(steps))
        if mid <= 0:
            continue
        pairs += [abs(a - b) / mid for i, a in enumerate(steps) for b in steps[i + 1:]]
    return float(np.median(pairs)) / _PAIR_MEDIAN if pairs else 0.0


def select(times: Sequence[Sequence[float]], tolerance: float = TOLERANCE,
           noise_z: float = 0.0) -> Tuple[int, List[float]]:
    """(index of the candidate to keep, median step time of each). Candidates whose median is
    within ``tolerance`` (relative) of the smallest are ties; the earliest of them is kept.
    With ``noise_z`` > 0 the first candidate is kept unless the smallest median is below its own
    by more than ``noise_z`` standard errors of the difference of the two medians (relative, from
    ``step_noise`` and each one's number of steps), and by more than ``tolerance``: a gain within
    the measured noise does not move the choice off the cost model's pick (module doc).
    Candidates without a finite measurement are never kept unless none has one (then the first)."""
    if not times:
        raise ValueError("select: no candidates")
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise ValueError(f"tolerance: must be in [0, 1); got {tolerance!r}")
    if isinstance(noise_z, bool) or not (isinstance(noise_z, (int, float)) and 0 <= noise_z <= 10):
        raise ValueError(f"noise_z: must be a number in [0, 10] (standard errors; 0: tolerance only); got {noise_z!r}")
    steps = [_finite(t) for t in times]
    medians = [float(np.median(s)) if s else math.inf for s in steps]
    best = min(medians)
    if not math.isfinite(best):
        return 0, medians
    if noise_z > 0 and steps[0]:
        fastest = medians.index(best)
        spread = _MEDIAN_SE * step_noise(times) * math.sqrt(1.0 / len(steps[0]) + 1.0 / len(steps[fastest]))
        if medians[0] <= best * (1.0 + max(tolerance, noise_z * spread)):
            return 0, medians
    for i, m in enumerate(medians):
        if m <= best * (1.0 + tolerance):
            return i, medians
    return int(np.argmin(medians)), medians  # unreachable: the minimum is within any tolerance


def check_revalidate_every(n, choosing: bool = False) -> int:
    """``revalidate_every``: steps per window of the drift watch (``drifted``). None (the default)
    is ``DEFAULT_REVALIDATE_EVERY`` when the plan chooses a spec per group (``choosing``:
    codec_choice="auto") and 0 otherwise; else 0 (off) or an int in [``MIN_REVALIDATE_EVERY``,
    ``MAX_REVALIDATE_EVERY``]."""
    if n is None:
        return DEFAULT_REVALIDATE_EVERY if choosing else 0
    if isinstance(n, bool) or not isinstance(n, int) or not (
            n == 0 or MIN_REVALIDATE_EVERY <= n <= MAX_REVALIDATE_EVERY):
        raise ValueError(f"revalidate_every: must be None (default: {DEFAULT_REVALIDATE_EVERY} with "
                         f"codec_choice='auto', else 0), 0 (no re-validation on drift) or an int in "
                         f"[{MIN_REVALIDATE_EVERY}, {MAX_REVALIDATE_EVERY}] (steps per window); got {n!r}")
    return n


def window_median(per_rank: Sequence[Sequence[float]]) -> float:
    """``per_rank[r][s]``: rank r's time of step s of a window -> the median over the steps of the
    slowest rank's time (every rank waits for it); steps without a finite time on every rank are
    left out; nan when none is left."""
    if not per_rank:
        raise ValueError("window_median: no ranks")
    n = len(per_rank[0])
    if any(len(r) != n for r in per_rank):
        raise ValueError("window_median: every rank must report the same steps")
    slowest = []
    for s in range(n):
        values = [r[s] for r in per_rank]
        if all(x is not None and math.isfinite(float(x)) for x in values):
            slowest.append(max(float(x) for x in values))
    return float(np.median(slowest)) if slowest else math.nan


def drifted(window_seconds: float, reference_seconds: Optional[float], threshold: float = DRIFT_THRESHOLD) -> bool:
    """Whether a window's median step (``window_median``) differs from the reference -- the median
    the kept plan ran at, over its first window -- by more than ``threshold`` of the reference,
    slower or faster: the load, the link or the other jobs changed, and the plan measured fastest
    before may not be now. False when either time is unknown (None, nan, <= 0)."""
    if not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold: must be > 0; got {threshold!r}")
    if reference_seconds is None or window_seconds is None:
        return False
    ref, now = float(reference_seconds), float(window_seconds)
    if not (math.isfinite(ref) and math.isfinite(now) and ref > 0 and now > 0):
        return False
    return abs(now - ref) > threshold * ref


def summary(candidates: Sequence[Candidate], medians: Sequence[float], chosen: int) -> str:
    """One line for ``Plan.notes``: every candidate's measured median, and which was kept."""
    parts = [f"{c.label} ({len(c.groups)} groups) {m * 1e3:.1f} ms" for c, m in zip(candidates, medians)]
    return (f"measured validation, median step of the slowest rank: {'; '.join(parts)}; kept "
            f"{candidates[chosen].label}")


__all__ = ["candidate", "everywhere", "with_fixed_choices", "MAX_CANDIDATES", "MAX_CHOICE_CANDIDATES", "Candidate", "DEFAULT_TUNE_STEPS", "check_tune_steps", "propose", "select", "step_noise", "step_times", "summary", "NOISE_Z",
           "check_revalidate_every", "window_median", "drifted", "DRIFT_THRESHOLD", "DEFAULT_REVALIDATE_EVERY",
           "size_label"]
