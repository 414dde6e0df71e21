"""What one learner update measures besides the loss: the whole-minibatch metrics built from
micro-batch (and per-learner) parts, and the trained tokens' squared log-ratios by age
(`max_staleness="auto"`). Used by `M2POTorchLearner` (learner.py)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from m2po_rllib.common import keys

# Token-level means and the token count each averages over (default: the valid tokens).
_MEAN_WEIGHTS = {
    keys.M2_AFTER: keys.KEPT_TOKENS,
    keys.ENTROPY_MASKED: keys.MASKED_TOKENS,
    **{keys.entropy_clipped(f): keys.clipped_tokens(f) for f in keys.CLIP_FAMILIES},
}


class MinibatchMetrics:
    """Whole-minibatch metrics from per-micro-batch (and per-learner) ones: counts and the
    loss add up, maxima take the max, means are re-weighted by the tokens they average
    over. Over learners it is one SUM and one MAX all-reduce; RLlib then averages the (now
    identical) values of the learners."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.means: dict[str, list[torch.Tensor]] = {}  # key -> [sum(mean * w), sum(w)]

    @staticmethod
    def _kind(key: str) -> str:
        if key.endswith("_tokens") or key == keys.LOSS:
            return "sum"
        return "max" if key.endswith("_max") else "mean"

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach().reshape(()).double()
            kind = self._kind(key)
            if kind == "sum":
                self.sums[key] = self.sums.get(key, 0) + value
            elif kind == "max":
                self.maxes[key] = torch.maximum(self.maxes[key], value) if key in self.maxes else value
        for key, value in metrics.items():
            if self._kind(key) == "mean":
                w = metrics.get(_MEAN_WEIGHTS.get(key, keys.VALID_TOKENS), torch.ones(())).detach().reshape(()).double()
                part = torch.nan_to_num(value.detach().reshape(()).double()) * w
                acc = self.means.setdefault(key, [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])
                acc[0] = acc[0] + part.cpu()
                acc[1] = acc[1] + w.cpu()

    def result(self, device, over_learners: bool) -> dict[str, float]:
        sum_keys, mean_keys, max_keys = sorted(self.sums), sorted(self.means), sorted(self.maxes)
        parts = [self.sums[k].to(device) for k in sum_keys]
        for k in mean_keys:
            parts += [self.means[k][0].to(device), self.means[k][1].to(device)]
        out = {}
        if parts:
            buf = torch.stack(parts)
            if over_learners:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # NCCL needs device tensors
            out.update(zip(sum_keys, buf[: len(sum_keys)].tolist()))
            for k, (total, w) in zip(mean_keys, buf[len(sum_keys) :].reshape(-1, 2).tolist()):
                out[k] = total / w if w > 0 else math.nan
        if max_keys:
            buf = torch.stack([self.maxes[k].to(device) for k in max_keys])
            if over_learners:
                dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            out.update(zip(max_keys, buf.tolist()))
        return out


class M2ByAge:
    """The squared log-ratios of the trained tokens by their age (optimizer updates between
    the weights that generated a row and those it is trained with), over an update call:
    per row on the device while it runs, grouped once at its end (one transfer), as
    {age: (sum of squared log-ratios, tokens)} for the staleness controller
    (rollout/staleness.py)."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, log_ratio: torch.Tensor, usable: torch.Tensor, ages: torch.Tensor, sample_ids: torch.Tensor) -> None:
        sq = torch.where(usable, log_ratio.detach().double() ** 2, 0.0)
        self.parts.append((sample_ids.detach(), ages.detach().long(), sq.sum(dim=1), usable.sum(dim=1).double()))

    def take(self) -> dict[int, tuple[float, float]]:
        """{age: (sum, tokens)} of every row's first pass in this update (with num_epochs > 1
        a row's later passes see weights already fitted to it), and a fresh start."""
        if not self.parts:
            return {}
        ids, ages, sums, counts = (torch.cat(c).cpu().numpy() for c in zip(*self.parts))
        self.parts = []
        _, first = np.unique(ids, return_index=True)
        ages, sums, counts = ages[first], sums[first], counts[first]
        out = {}
        for age in np.unique(ages):
            rows = ages == age
            out[int(age)] = (float(sums[rows].sum()), float(counts[rows].sum()))
        return out

    def clear(self) -> None:
        self.parts = []
