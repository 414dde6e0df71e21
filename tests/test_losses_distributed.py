"""The global mask and loss over gloo data-parallel ranks equal the single-process result.

One spawn of WORLD processes runs every case, each rank checking its own shard against
the whole batch it also computes alone; a failing assert on any rank fails the test.
"""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import m2po_rllib.losses.mask as mask_module
from m2po_rllib.common.net import free_port
from m2po_rllib.losses import (
    LOCAL,
    POLICY_LOSSES,
    compute_policy_loss,
    m2po_keep_mask,
    m2po_keep_mask_global,
    m2po_official_tau,
)

WORLD = 3
# Uneven shards: rank 1 holds a single fully padded row, rank 2 most of the batch.
ROWS = [slice(0, 3), slice(3, 4), slice(4, 10)]


def _batch(seed, scale, heavy):
    g = torch.Generator().manual_seed(seed)
    B, T = 10, 17
    lr = torch.randn(B, T, generator=g) * scale
    if heavy:
        lr = lr * torch.where(torch.rand(B, T, generator=g) < 0.05, 20.0, 1.0)
    if seed % 2:
        lr = torch.round(lr * 8) / 8  # exact ties, some at the cut
    # dyadic, so that logp - behavior gives back lr exactly (ties stay ties)
    behavior = -torch.randint(0, 24, (B, T), generator=g).float() / 8
    valid = torch.rand(B, T, generator=g) < 0.8
    valid[3] = False  # rank 1's only row: no valid token on that rank
    logp = behavior + lr
    return logp, behavior, torch.randn(B, generator=g), valid, logp - behavior


def _loss_and_grad(name, logp, behavior, adv, valid, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, _ = compute_policy_loss(name, logp, behavior, adv, valid, **kw)
    loss.backward()
    return loss.detach(), logp.grad


def _check_close(got, want, what):
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), f"{what}: {got} != {want}"


def _worker(rank, port):
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=WORLD)
    rows = ROWS[rank]
    try:
        for first_top in (2, 4096):  # 2 forces several widening rounds of the search
            mask_module._FIRST_TOP = first_top
            for seed, scale, heavy in [(0, 0.3, 0), (1, 0.4, 1), (2, 0.05, 0), (3, 1.0, 1)]:
                logp, behavior, adv, valid, lr = _batch(seed, scale, heavy)
                case = f"rank {rank} seed {seed} first_top {first_top}"

                # the mask: same kept set as one process on the whole batch
                whole_keep = m2po_keep_mask(lr, valid, 0.04)
                keep, stats = m2po_keep_mask_global(lr[rows], valid[rows], 0.04, return_stats=True)
                assert torch.equal(keep, whole_keep[rows]), case
                assert stats["m2po/kept_tokens"] == whole_keep.sum(), case
                _, whole_stats = m2po_keep_mask_global(lr, valid, 0.04, LOCAL, return_stats=True)
                assert stats["m2po/tied_kept_frac"] == whole_stats["m2po/tied_kept_frac"], case
                # with sample ids, rows may sit anywhere: shuffled, then split the same way
                g = torch.Generator().manual_seed(seed)
                ids, perm = torch.randperm(len(lr), generator=g) * 3 + 11, torch.randperm(len(lr), generator=g)
                whole_by_id = m2po_keep_mask(lr, valid, 0.04, sample_id=ids)
                keep_by_id = m2po_keep_mask_global(
                    lr[perm][rows], valid[perm][rows], 0.04, sample_id=ids[perm][rows]
                )
                assert torch.equal(keep_by_id, whole_by_id[perm][rows]), case
                adv_t = adv[:, None].expand_as(lr)
                for solver in ("exact", "breakpoint"):
                    tau = m2po_official_tau(lr[rows], adv_t[rows], valid[rows], 0.04, solver=solver)
                    want = m2po_official_tau(lr, adv_t, valid, 0.04, solver=solver)
                    assert tau == pytest.approx(want, rel=1e-6), case

                # every loss: shard losses sum to the whole loss; shard grads are its rows
                for name in sorted(POLICY_LOSSES):
                    for mode in ("token-mean", "seq-mean-token-mean"):
                        whole, grad = _loss_and_grad(
                            name, logp, behavior, adv, valid, loss_agg_mode=mode, group=LOCAL
                        )
                        part, part_grad = _loss_and_grad(
                            name, logp[rows], behavior[rows], adv[rows], valid[rows],
                            loss_agg_mode=mode,
                        )
                        dist.all_reduce(part)
                        _check_close(part, whole, f"{case} {name} {mode} loss")
                        _check_close(part_grad, grad[rows], f"{case} {name} {mode} grad")

                # sharded and micro-batched: one global mask per minibatch, two micro-batches
                whole, grad = _loss_and_grad("m2po", logp, behavior, adv, valid, group=LOCAL)
                counts = torch.tensor(float(valid[rows].sum()))
                dist.all_reduce(counts)
                n = rows.stop - rows.start
                total, grads = torch.zeros(()), []
                for micro in (slice(0, n // 2), slice(n // 2, n)):
                    r = slice(rows.start + micro.start, rows.start + micro.stop)
                    part, g = _loss_and_grad(
                        "m2po", logp[r], behavior[r], adv[r], valid[r],
                        keep_mask=keep[micro], num_global_tokens=counts,
                    )
                    total, grads = total + part, grads + [g]
                dist.all_reduce(total)
                _check_close(total, whole, f"{case} grad-accumulation loss")
                _check_close(torch.cat(grads), grad[rows], f"{case} grad-accumulation grad")
    finally:
        dist.destroy_process_group()


def test_global_mask_and_loss_match_single_process():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
