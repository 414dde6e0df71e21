"""Shared fixtures: tiny models the tests build themselves (no hub access)."""

from __future__ import annotations

import os

import pytest

# vLLM on CPU: keep the KV cache small; the tests share a 2-core, 24 GB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs the suite in pytest-xdist workers (TEST_WORKERS, whole files each): each
# worker's torch gets its share of the cores, set before torch is imported and inherited by
# the subprocesses, Ray nodes and actors it starts, so the workers together never ask for more
# threads than the machine has (two 2-thread torch processes on 2 cores fall off a cliff).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny Qwen2 causal LM with a character-level tokenizer, saved as a HF directory."""
    from m2po_rllib.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (started by the first test that asks,
    ~6 s, instead of once per module): its own temp dir (so parallel test runs and other
    people's Ray on the machine are never touched) and random free ports (what `ray.init()`
    picks when it starts a local instance). `ray.shutdown()` ends only it. Tests stop the
    algorithms and actors they start, so the next test finds every CPU free."""
    import shutil
    import tempfile

    ray = pytest.importorskip("ray")
    # Short path: Ray's unix sockets live under it and must stay under ~100 characters.
    temp_dir = tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def verifier():
    """The reward tests' verifier (test_reward, test_reward_pool: one pool of two children for
    both), with short math-verify timeouts, so hostile samples cost about a second."""
    from envs import MathVerifier

    v = MathVerifier(num_workers=2, timeout_s=1, deadline_s=4.0)
    yield v
    v.close()
