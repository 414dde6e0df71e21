"""The paper's claims (arXiv 2510.01161), checked on a report's runs where it has the variants
each one needs (a claim without them is left out). Runs are compared within one setting
(sync or async, learning rate, numerics); each arm is one value per seed (runs of one seed
averaged), and two arms over the same seeds are paired (`m2po_rllib.jobs.stats`).

(a) M2PO at the largest staleness matches on-policy training: equivalence within ±`margin`
    (TOST) of the final held-out accuracy;
(b) clipped GRPO at the largest staleness is below on-policy training;
(c) M2PO is above clipped GRPO at the largest staleness both have;
(d) at that staleness M2PO masks at least 10x fewer tokens than GRPO clips, at steady state
    (`m2po_rllib.jobs.steady`: each arm's seeds' fractions, as everywhere in the report): the
    ratio of the fractions, tested on the seeds' log values;
(e) no trust region (grpo_no_tr) at its largest staleness: prosperity, its early accuracy
    (`early_accuracy`) is not below the other losses' by more than `margin`; then collapse,
    its final accuracy is below its own early accuracy.

The on-policy arm is the same loss at staleness 0, else M2PO's, else any loss's at staleness
0 (on-policy the losses nearly coincide); the claim names the one it used.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from m2po_rllib.jobs.runs import Run, Variant
from m2po_rllib.jobs import steady
from m2po_rllib.jobs.stats import NOT_RESOLVED, Comparison, compare, per_seed

MARGIN = 0.02  # accuracy (2 points): what "matches" and "not below" allow
FEWER = 10.0  # (d): masked at least this many times fewer than clipped
FRACTION_FLOOR = 1e-6  # (d): a fraction below this (0 included) counts as this, so its log is finite
M2PO, GRPO, NO_TR = "m2po", "grpo", "grpo_no_tr"


# -- the windows ------------------------------------------------------------------------------
def early_window(runs: list[Run]) -> float:
    """The first third of training: one third of the latest evaluated update of `runs` (one
    window for every arm, so a run stopped at its collapse is not judged on a shorter one)."""
    last = [e.update for r in runs for e in r.evaluations[-1:] if e.update is not None]
    return max(last, default=0) / 3


def early_accuracy(run: Run, until: float) -> float | None:
    """The mean of the run's evaluations after its first update and at most `until` updates."""
    values = [e.accuracy for e in run.evaluations if e.update is not None and 0 < e.update <= until]
    return statistics.fmean(values) if values else None


# -- arms ---------------------------------------------------------------------------------------
@dataclass
class Claim:
    id: str  # "a" .. "e"
    text: str  # what the paper says, in this setting's words
    setting: str  # lr, tau, mode, numerics
    arms: tuple[str, str]  # the variants compared (A, B)
    values: tuple[dict, dict]  # per seed
    comparison: Comparison
    scale: str = "accuracy"  # or "log ratio" for (d)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["values"] = [{str(k): v for k, v in arm.items()} for arm in self.values]
        return out


def _short(v: Variant) -> str:
    return v.label(("policy_loss", "staleness", "m2_threshold"))


def _setting(v: Variant) -> str:
    s = v.settings
    parts = ["async" if s["mode"] == "async" else None, f"lr {s['lr']:g}" if s["lr"] is not None else None,
             s["numerics"]]
    return ", ".join(p for p in parts if p)


def _groups(variants: list[Variant]) -> dict[tuple, list[Variant]]:
    groups: dict[tuple, list[Variant]] = {}
    for v in variants:
        if isinstance(v.key[2], int) and any(r.final is not None for r in v.runs):
            groups.setdefault((v.key[1], v.key[4], v.key[5]), []).append(v)
    return groups


def _at(group, loss, staleness=None, tau=None) -> list[Variant]:
    return [v for v in group if v.key[0] == loss and (staleness is None or v.key[2] == staleness)
            and (tau is None or v.key[3] == tau)]


def _largest(variants: list[Variant]) -> int | None:
    return max((v.key[2] for v in variants if v.key[2] > 0), default=None)


def _on_policy(group, loss, tau=None) -> Variant | None:
    zero = [v for v in group if v.key[2] == 0]
    for pick in ([v for v in zero if v.key[0] == loss and (tau is None or v.key[3] == tau)],
                 [v for v in zero if v.key[0] == loss], _at(zero, M2PO), zero):
        if pick:
            return pick[0]
    return None


def _final(r: Run) -> float | None:
    return r.final


def _accuracy_claim(cid, text, a: Variant, b: Variant, claim, margin) -> Claim | None:
    """A claim on the arms' final held-out accuracy."""
    va, vb = per_seed(a.runs, _final), per_seed(b.runs, _final)
    if not va or not vb:
        return None
    return Claim(cid, text, _setting(a), (_short(a), _short(b)), (va, vb),
                 compare(va, vb, claim, margin=margin if claim in ("equivalent", "not_lower") else None))


def evaluate_claims(variants: list[Variant], margin: float = MARGIN) -> list[Claim]:
    """Every claim the variants allow, per setting (module docstring)."""
    claims: list[Claim] = []
    for group in _groups(variants).values():
        for tau in sorted({v.key[3] for v in _at(group, M2PO)}, key=lambda t: (t is None, t)):
            m2po = _at(group, M2PO, tau=tau)
            top, base = _largest(m2po), _on_policy(group, M2PO, tau)
            if top is not None and base is not None:
                claims.append(_accuracy_claim(
                    "a", f"M2PO at stale {top} matches on-policy", _at(m2po, M2PO, top)[0], base,
                    "equivalent", margin))
            both = _largest([v for v in m2po if _at(group, GRPO, v.key[2])])
            if both is not None:
                a, b = _at(m2po, M2PO, both)[0], _at(group, GRPO, both)[0]
                claims.append(_accuracy_claim("c", f"M2PO above clipped GRPO at stale {both}", a, b, "greater", margin))
                claims.append(_fraction_claim(a, b, both))
        grpo = _at(group, GRPO)
        top, base = _largest(grpo), _on_policy(group, GRPO)
        if top is not None and base is not None:
            claims.append(_accuracy_claim(
                "b", f"clipped GRPO at stale {top} below on-policy", _at(grpo, GRPO, top)[0], base,
                "less", margin))
        claims += _no_trust_region_claims(group, margin)
    return sorted((c for c in claims if c is not None), key=lambda c: (c.id, c.setting, c.text))


def _fraction_claim(m2po: Variant, grpo: Variant, level: int) -> Claim | None:
    """(d): log masked fraction - log clipped fraction < log(1/FEWER), per seed."""
    mode = m2po.key[1]
    masked, clipped = steady.fraction(m2po.runs, level, mode), steady.fraction(grpo.runs, level, mode)
    if masked is None or clipped is None or (masked.kind, clipped.kind) != ("masked", "clipped"):
        return None
    masked, clipped = masked.seeds, clipped.seeds
    log_m = {s: math.log(max(v, FRACTION_FLOOR)) for s, v in masked.items()}
    log_c = {s: math.log(max(v, FRACTION_FLOOR)) for s, v in clipped.items()}
    comparison = compare(log_m, log_c, "less", threshold=-math.log(FEWER))
    return Claim("d", f"M2PO masks at least {FEWER:g}x fewer tokens than GRPO clips at stale {level}", _setting(m2po),
                 (_short(m2po), _short(grpo)), (masked, clipped), comparison, scale="log ratio",
                 details={"window": f"records whose policy_version before the iteration >= {steady.start(level, mode)}"})


def reference(variants: list[Variant], variant: Variant) -> Variant | None:
    """The on-policy variant the claims compare `variant` with (its setting's, same loss and
    tau first, else M2PO's, else any), or None."""
    group = _groups(variants).get((variant.key[1], variant.key[4], variant.key[5]), [])
    return _on_policy(group, variant.key[0], variant.key[3])


def _no_trust_region_claims(group, margin) -> list[Claim]:
    no_tr = _at(group, NO_TR)
    top = _largest(no_tr)
    if top is None:
        return []
    subject = _at(no_tr, NO_TR, top)[0]
    others = [v for v in group if v.key[2] == top and v.key[0] in (M2PO, GRPO)]
    until = early_window([r for v in (subject, *others) for r in v.runs])
    early = per_seed(subject.runs, lambda r: early_accuracy(r, until))
    out = []
    window = {"early": f"the evaluations at updates (0, {until:.0f}]: the first third of the longest run"}
    for other in others:
        theirs = per_seed(other.runs, lambda r: early_accuracy(r, until))
        if early and theirs:
            out.append(Claim("e", f"no trust region at stale {top}: early accuracy not below {_short(other)}'s",
                             _setting(subject), (_short(subject), _short(other)), (early, theirs),
                             compare(early, theirs, "not_lower", margin=margin), details=window))
    late = per_seed(subject.runs, _final)
    if early and late:
        collapsed = sum(r.collapsed for r in subject.runs)
        out.append(Claim("e", f"no trust region at stale {top}: then collapse, final below its own early accuracy",
                         _setting(subject), (f"{_short(subject)} final", f"{_short(subject)} early"), (late, early),
                         compare(late, early, "less"),
                         details={**window, "collapsed_runs": f"{collapsed}/{len(subject.runs)}"}))
    return out


# -- words --------------------------------------------------------------------------------------
def _num(x: float, scale: str) -> str:
    return f"{math.exp(x):.3g}" if scale == "log ratio" else f"{x:+.3f}"


def _interval(ci, scale) -> str:
    return f"[{_num(ci[0], scale)}, {_num(ci[1], scale)}]"


def _seeds_line(c: Comparison) -> str:
    if c.seeds_needed is None:
        return ("no estimate of the seeds it needs (an arm needs 2 seeds)" if c.sd is None
                else "the effect sits on the claim's bound: no number of seeds resolves it")
    n = c.seeds_needed
    if c.verdict == NOT_RESOLVED:
        return f"about {n} seeds per arm would resolve it (80% power at the observed effect)"
    return f"{n} seeds per arm give 80% power at this effect"


def claim_line(c: Claim) -> str:
    """One bullet: the numbers, the interval, the verdict and the seeds it would take."""
    cmp = c.comparison
    (a, b), (va, vb) = c.arms, c.values
    if c.scale == "log ratio":
        numbers = (f"{a} masked {100 * statistics.fmean(va.values()):.4f}% ({cmp.n_a} seeds) vs {b} clipped "
                   f"{100 * statistics.fmean(vb.values()):.4f}% ({cmp.n_b} seeds), at steady state "
                   f"({c.details['window']}; means over seeds); ratio of the seeds' geometric means "
                   f"{math.exp(cmp.diff):.3g}")
    else:
        numbers = (f"{a} {cmp.mean_a:.3f} ({cmp.n_a} seeds) vs {b} {cmp.mean_b:.3f} ({cmp.n_b} seeds); "
                   f"difference {cmp.diff:+.3f}")
    if cmp.claim == "equivalent":
        ci = f"90% CI {_interval(cmp.ci90, c.scale)} (TOST at ±{cmp.margin:g})" if cmp.ci90 else "no interval"
    else:
        ci = f"95% CI {_interval(cmp.ci95, c.scale)}" if cmp.ci95 else "no interval"
        if cmp.claim == "not_lower":
            ci += f" (not below by more than {cmp.margin:g})"
    extra = f"; early: {c.details['early']}" if "early" in c.details else ""
    extra += f"; {c.details['collapsed_runs']} runs collapsed" if "collapsed_runs" in c.details else ""
    return (f"- ({c.id}) {c.text} [{c.setting}]: {numbers}, {ci}, {cmp.test}: **{cmp.verdict}**{extra}; "
            f"{_seeds_line(cmp)}.")


def claims_markdown(claims: list[Claim], last_k: int, margin: float) -> list[str]:
    if not claims:
        return []
    return [
        "## Claims", "",
        f"The paper's comparisons, where this report has the runs for them. A run counts with its final value "
        f"(the mean of its last {last_k} evaluations), a seed with the mean of its runs; arms over the same seeds "
        "are paired (paired t on the per-seed differences), others compared with Welch's t. Intervals are of the "
        f"difference A - B, 95% (90% for equivalence: TOST at ±{margin:g}); a directional claim holds when its "
        "interval excludes the bound, does not hold when the interval lies on the other side, else it is not "
        "resolved. Early accuracy is the mean of the evaluations in the first third of training; the masked / "
        f"clipped ratio is taken on log fractions (below {FRACTION_FLOOR:g} counted as {FRACTION_FLOOR:g}). Seeds per "
        "arm for 80% power at the observed effect: m2po_rllib/jobs/stats.py (`seeds_needed`).", "",
        *map(claim_line, claims), "",
    ]
