"""The steady state of a stale run, and the one masked / clipped fraction the report prints.

A stale-k run trains on base-model rounds for its first `staleness` updates (the queue fills
with rounds of the initial weights, younger than the staleness); from then on every update
trains on data exactly `staleness` updates old. Its **steady state** is the records of the
iterations whose policy version *before* the iteration (the previous record's) is at least
the staleness. An on-policy run (staleness 0) and an async run (a bound, not an age) are in
steady state from their first record.

**The steady-state fraction** of a variant (M2PO's masked fraction, the clip losses'
clipped fraction) is combined one way everywhere (the table, the Regime section, claim (d)):
a run's value is the mean over its steady-state records; a seed's, the mean of its runs'; the
variant's, the mean over its seeds. Claim (d) tests the seeds' values on a log scale and says
so; the number it prints for each arm is this one. No Ray import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

from m2po_rllib.common.keys import POLICY_VERSION
from m2po_rllib.jobs.stats import per_seed

KINDS = ("masked", "clipped")  # masked_frac (M2PO), clipped_frac (the clip losses)


def start(staleness, mode: str = "stale-k") -> int:
    """The policy version from which a run trains on data as old as its staleness: the stale-k
    staleness; 0 on-policy and in async mode (a bound or "auto", not an age: the data's age
    varies by round)."""
    if mode != "stale-k" or not isinstance(staleness, int) or isinstance(staleness, bool):
        return 0
    return max(staleness, 0)


def steady_state(history: list[dict], staleness, mode: str = "stale-k") -> list[dict]:
    """The records of `history` that trained on data as old as `staleness` (module docstring)."""
    first, out, before = start(staleness, mode), [], 0
    for h in history:
        if before >= first:
            out.append(h)
        if h.get(POLICY_VERSION) is not None:
            before = h[POLICY_VERSION]
    return out


def run_value(history: list[dict], name: str, staleness, mode: str = "stale-k") -> float | None:
    """The mean of `name` over the run's steady-state records, or None without a value there."""
    values = [h[name] for h in steady_state(history, staleness, mode) if h.get(name) is not None]
    return statistics.fmean(values) if values else None


def kind_of(histories: Iterable[list[dict]]) -> str | None:
    """"masked" when the runs record a masked fraction (M2PO), "clipped" for the clip losses."""
    histories = list(histories)
    return next((k for k in KINDS if any(h.get(f"{k}_frac") is not None for hist in histories for h in hist)), None)


@dataclass
class SteadyFraction:
    kind: str  # "masked" or "clipped"
    mean: float  # over seeds (module docstring)
    seeds: dict  # {seed: value}


def fraction(runs, staleness, mode: str = "stale-k") -> SteadyFraction | None:
    """The steady-state masked or clipped fraction of `runs` (objects with `.history` and
    `.settings["seed"]`), combined as the module docstring says; None without one."""
    runs = list(runs)
    kind = kind_of(r.history for r in runs)
    if kind is None:
        return None
    seeds = per_seed(runs, lambda r: run_value(r.history, f"{kind}_frac", staleness, mode))
    return SteadyFraction(kind, statistics.fmean(seeds.values()), seeds) if seeds else None
