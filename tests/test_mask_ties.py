"""Ties at the M2PO mask's cut: Alg. 1's count, broken by (sample id, position), and the
same mask for every row order, padding and split over ranks.

Completions of one group share prefixes, so equal log-ratios are common: the mask drops
only as many tokens of the cut's value as the bound needs, those with the smallest keys.
Sharded runs are simulated with threads standing in for ranks (the real gloo collectives
are in test_losses_distributed.py), so hypothesis can try many splits cheaply.
"""

import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m2po_rllib.losses.mask as mask_module
from _references import plain_m2po_keep
from m2po_rllib.common import keys
from m2po_rllib.losses import compute_policy_loss, m2po_keep_mask, m2po_keep_mask_global

# Dyadic log-ratios: squares and their sums are exact in float32 / float64, so the cut is
# the same however the sums are ordered, and most values repeat.
TIED_VALUES = [0.0, 0.125, -0.125, 0.25, -0.25, 0.375, 0.5, -0.5, 1.0, 2.0]
TAUS = [0.0, 0.01, 0.04, 0.1, 0.3]


def _grouped_batch(g: torch.Generator, groups: int, group_size: int, T: int, p_shared: float):
    """Groups of completions that share a prefix: the shared tokens have one log-ratio per
    group and position (same token, same context), the rest their own. Sample ids are
    unique, large and not in row order. Returns log_ratio (B, T), valid (B, T), ids (B,)."""
    B = groups * group_size
    values = torch.tensor(TIED_VALUES)
    own = values[torch.randint(len(values), (B, T), generator=g)]
    shared = values[torch.randint(len(values), (groups, T), generator=g)].repeat_interleave(group_size, 0)
    prefix = (torch.rand(groups, 1, generator=g) * p_shared * T).long().repeat_interleave(group_size, 0)
    lr = torch.where(torch.arange(T)[None] < prefix, shared, own)
    lengths = torch.randint(0, T + 1, (B, 1), generator=g)
    valid = torch.arange(T)[None] < lengths
    ids = torch.randperm(B, generator=g) * 1000 + 5 * 2**30
    return lr, valid, ids


@pytest.mark.parametrize("first_top", [2, 4096])  # 2: the widening search, ties across rounds
def test_matches_alg1_with_ties_broken_by_sample_id(first_top):
    with mock.patch.object(mask_module, "_FIRST_TOP", first_top):
        for seed in range(40):
            g = torch.Generator().manual_seed(seed)
            lr, valid, ids = _grouped_batch(g, groups=3, group_size=4, T=12, p_shared=0.8)
            tau = TAUS[seed % len(TAUS)]
            want = plain_m2po_keep(lr, valid, tau, ids)
            assert torch.equal(m2po_keep_mask(lr, valid, tau, sample_id=ids), want), seed
            # without ids the row index breaks ties: the same loop keyed by row
            assert torch.equal(m2po_keep_mask(lr, valid, tau), plain_m2po_keep(lr, valid, tau)), seed


def test_tie_edge_cases():
    ones = torch.ones(2, 3, dtype=torch.bool)
    # every token tied: above tau all go (no subset of equal values is within the bound),
    # within tau all stay
    assert not m2po_keep_mask(torch.full((2, 3), 0.5), ones, 0.04).any()
    assert m2po_keep_mask(torch.full((2, 3), 0.1), ones, 0.04).all()
    # one outlier and a tie at the cut: only what the bound needs goes, smallest key first
    lr = torch.tensor([[3.0, 0.5, 0.0], [0.0, 0.5, 0.0]])  # d: 9, .25, 0 / 0, .25, 0
    # drop 9: mean .1; one .25 more: .0625 <= tau, so only one of the two goes
    assert m2po_keep_mask(lr, ones, 0.07).tolist() == [[False, False, True], [True, True, True]]
    ids = torch.tensor([9, 4])  # row 1 now has the smaller key: its 0.25 goes instead
    assert m2po_keep_mask(lr, ones, 0.07, sample_id=ids).tolist() == [[False, True, True], [True, False, True]]
    # the same key on two rows: their tied tokens go together (a defined excess)
    same = torch.tensor([4, 4])
    assert m2po_keep_mask(lr, ones, 0.07, sample_id=same).tolist() == [[False, False, True], [True, False, True]]
    # empty batches, with and without ids
    empty = torch.zeros(0, 4)
    assert m2po_keep_mask(empty, empty.bool(), sample_id=torch.zeros(0, dtype=torch.long)).shape == (0, 4)
    assert m2po_keep_mask(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), sample_id=ids).shape == (2, 0)
    with pytest.raises(ValueError, match="sample_id"):
        m2po_keep_mask(lr, ones, 0.07, sample_id=torch.tensor([1, 2, 3]))
    for bad in ([-1, 2], [2**39, 2]):
        with pytest.raises(ValueError, match="sample ids in"):
            m2po_keep_mask(lr, ones, 0.07, sample_id=torch.tensor(bad))


def test_tied_kept_metric():
    """`m2po/tied_kept_frac`: the tokens of the cut's value that stay (dropping every tie
    would have masked them too), over the valid tokens; the loss and the global stats agree."""
    g = torch.Generator().manual_seed(0)
    lr, valid, ids = _grouped_batch(g, groups=4, group_size=8, T=16, p_shared=1.0)
    keep = m2po_keep_mask(lr, valid, 0.04, sample_id=ids)
    d = lr * lr
    cut = d[valid & ~keep].min()
    tied_kept = int((keep & (d == cut)).sum())
    assert tied_kept > 0  # this batch splits a tie
    behavior = torch.zeros_like(lr)
    _, m = compute_policy_loss("m2po", lr, behavior, torch.ones(len(lr)), valid, sample_id=ids)
    assert m[keys.TIED_KEPT_FRAC] == pytest.approx(tied_kept / int(valid.sum()))
    _, stats = m2po_keep_mask_global(lr, valid, 0.04, sample_id=ids, return_stats=True)
    assert stats[keys.TIED_KEPT_FRAC] == pytest.approx(tied_kept / int(valid.sum()))
    # within the bound, or a precomputed mask: 0, and absent
    _, m = compute_policy_loss("m2po", lr * 0, behavior, torch.ones(len(lr)), valid, sample_id=ids)
    assert m[keys.TIED_KEPT_FRAC] == 0
    _, m = compute_policy_loss("m2po", lr, behavior, torch.ones(len(lr)), valid, keep_mask=keep)
    assert keys.TIED_KEPT_FRAC not in m


# ---------------------------------------------------------------- layout invariance


class _ThreadGroup:
    """A simulated process group: ranks are threads that swap tensors between barriers."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)  # a rank that raised breaks it
        self.slots = [None] * n
        self.local = threading.local()

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts


def _run_sharded(shards, tau, use_ids: bool):
    """`m2po_keep_mask_global` on each shard (log_ratio, valid, ids), one thread per rank."""
    group = _ThreadGroup(len(shards))

    def all_reduce_sum(x, grp=None):
        return x.copy_(torch.stack(grp.exchange(x)).sum(0))

    def rank_of(grp=None):
        return grp.local.rank

    def run(rank):
        group.local.rank = rank
        lr, valid, ids = shards[rank]
        return m2po_keep_mask_global(lr, valid, tau, group, sample_id=ids if use_ids else None)

    with (
        mock.patch.object(mask_module, "world_size", lambda grp=None: grp.n),
        mock.patch.object(mask_module, "all_reduce_sum", all_reduce_sum),
        mock.patch.object(mask_module, "all_gather_cat", lambda x, grp=None: torch.cat(grp.exchange(x))),
        mock.patch.object(mask_module.dist, "get_rank", rank_of),
        ThreadPoolExecutor(len(shards)) as pool,
    ):
        return list(pool.map(run, range(len(shards))))


def _by_key(keep, valid, ids) -> dict[tuple[int, int], bool]:
    return {(int(ids[b]), t): bool(keep[b, t]) for b, t in valid.nonzero().tolist()}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([1, 2, 8]),
    T=st.integers(1, 10),
    tau=st.sampled_from(TAUS),
    world=st.integers(1, 4),
    first_top=st.sampled_from([1, 3, 4096]),
)
def test_mask_is_the_same_for_every_layout(seed, groups, group_size, T, tau, world, first_top):
    """Rows shuffled, padded to other widths, with garbage in the padding and split over
    simulated ranks (some empty): each token's mask, by (sample id, position), is Alg. 1's."""
    g = torch.Generator().manual_seed(seed)
    lr, valid, ids = _grouped_batch(g, groups, group_size, T, p_shared=0.9)
    want = _by_key(plain_m2po_keep(lr, valid, tau, ids), valid, ids)
    perm = torch.randperm(len(lr), generator=g)
    cuts = sorted(torch.randint(0, len(lr) + 1, (world - 1,), generator=g).tolist())
    shards = []
    for part in torch.tensor_split(perm, cuts):  # a rank's rows, in shuffled order
        width = T + int(torch.randint(0, 3, (1,), generator=g))  # its own padding width
        shard_lr = torch.full((len(part), width), float("nan"))
        shard_valid = torch.zeros(len(part), width, dtype=torch.bool)
        shard_lr[:, :T], shard_valid[:, :T] = lr[part], valid[part]
        shards.append((shard_lr, shard_valid, ids[part]))
    with mock.patch.object(mask_module, "_FIRST_TOP", first_top):
        masks = _run_sharded(shards, tau, use_ids=True)
    got = {}
    for (_, shard_valid, shard_ids), keep in zip(shards, masks):
        assert not (keep & ~shard_valid).any()
        got |= _by_key(keep, shard_valid, shard_ids)
    assert got == want


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), world=st.integers(2, 4), tau=st.sampled_from(TAUS))
def test_without_ids_the_ranks_concatenated_break_ties(seed, world, tau):
    """Without sample ids, ties go in the order of the ranks' batches concatenated in rank
    order, as `m2po_keep_mask` on that concatenation."""
    g = torch.Generator().manual_seed(seed)
    lr, valid, _ = _grouped_batch(g, groups=3, group_size=4, T=6, p_shared=0.9)
    cuts = sorted(torch.randint(0, len(lr) + 1, (world - 1,), generator=g).tolist())
    rows = torch.tensor_split(torch.arange(len(lr)), cuts)
    masks = _run_sharded([(lr[r], valid[r], None) for r in rows], tau, use_ids=False)
    assert torch.equal(torch.cat(masks), plain_m2po_keep(lr, valid, tau))


def test_extra_dropped_by_dropping_every_tie():
    """What the tie-break saves on a batch shaped like the miniature's (groups of 8
    completions with shared prefixes): dropping every tie at the cut masks more than Alg. 1."""
    g = torch.Generator().manual_seed(1)
    lr, valid, ids = _grouped_batch(g, groups=16, group_size=8, T=32, p_shared=0.7)
    keep = m2po_keep_mask(lr, valid, 0.04, sample_id=ids)
    d = torch.where(valid, lr * lr, -1.0)
    cut = d[valid & ~keep].min()
    drop_every_tie = valid & (d < cut)
    assert (keep & ~drop_every_tie).sum() > 0 and not (drop_every_tie & ~keep).any()
    kept = d[keep]
    assert kept.mean() <= 0.04 < torch.cat([kept, cut[None]]).mean()
