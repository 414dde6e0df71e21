"""A checkpoint survives a kill at any moment of its save (m2po_rllib/driver/checkpoints.py): the
directory protocol under a crash injected at every step, the algorithm's own save (sync and
async) under the same, and a real `kill -9` of `m2po train` in the middle of a save."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2po_rllib.driver import checkpoints

from m2po_rllib.common import durable


class Killed(BaseException):
    """What a kill -9 leaves on disk: no handler, no `finally` of the save runs after it.
    (The save has none: its safety must not depend on cleanup.)"""


class KillAt:
    """Counts the save's file-system steps (writes, renames, removals, seals) and raises
    Killed at step `at`; `steps` is how many a save made when it was not killed."""

    def __init__(self, monkeypatch, at: int | None):
        self.at, self.steps = at, 0
        for owner, name in ((os, "rename"), (shutil, "rmtree"), (durable, "write_json"), (checkpoints, "_seal")):
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name)))

    def tick(self) -> None:
        if self.at is not None and self.steps == self.at:
            raise Killed(f"killed at step {self.at}")
        self.steps += 1

    def _wrap(self, fn):
        def step(*args, **kwargs):
            self.tick()
            return fn(*args, **kwargs)

        return step


def _files_writer(contents: dict[str, bytes], kill: KillAt):
    """A writer like RLlib's: one file after another, each a step at which a kill can land."""

    def write(directory: str) -> None:
        for name, data in contents.items():
            kill.tick()
            path = Path(directory) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[: len(data) // 2])  # a kill here leaves the file cut short
            kill.tick()
            path.write_bytes(data)

    return write


def _read(directory: str) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in Path(directory).rglob("*") if p.is_file() and p.name != checkpoints.MANIFEST
    }


def test_a_kill_at_every_step_of_a_save_leaves_the_old_or_the_new_checkpoint_whole(tmp_path, monkeypatch):
    old = {"rllib_checkpoint.json": b"{}", "learner/module_state.pkl": b"old" * 100, "algorithm_state.pkl": b"a1" * 50}
    new = {"rllib_checkpoint.json": b"{}", "learner/module_state.pkl": b"new" * 120, "algorithm_state.pkl": b"a2" * 60}
    probe = tmp_path / "probe" / "ckpt"
    checkpoints.save(probe, _files_writer(old, KillAt(pytest.MonkeyPatch(), None)), iteration=1)
    with monkeypatch.context() as m:
        count = KillAt(m, None)
        checkpoints.save(probe, _files_writer(new, count), iteration=2)
    assert count.steps >= 11  # 6 file writes, the seal, 2 renames, 2 removals

    outcomes = set()
    for at in range(count.steps):
        root = tmp_path / f"kill-{at}"
        path = root / "ckpt"
        checkpoints.save(path, _files_writer(old, KillAt(pytest.MonkeyPatch(), None)), iteration=1)
        with monkeypatch.context() as m:
            with pytest.raises(Killed):
                checkpoints.save(path, _files_writer(new, KillAt(m, at)), iteration=2)
        restored = checkpoints.resolve(path)
        got = _read(restored)
        assert got in (old, new), f"killed at step {at}: a mix of both checkpoints"
        outcomes.add("new" if got == new else "old")
        # the next save cleans up whatever the killed one left
        checkpoints.save(path, _files_writer(new, KillAt(pytest.MonkeyPatch(), None)), iteration=3)
        assert sorted(p.name for p in root.iterdir()) == ["ckpt"] and _read(checkpoints.resolve(path)) == new
    assert outcomes == {"old", "new"}  # kills before the seal keep the old one, after it the new one


def test_a_file_cut_short_is_found_and_the_previous_checkpoint_restored(tmp_path, caplog):
    path = tmp_path / "ckpt"
    kill = KillAt(pytest.MonkeyPatch(), None)
    checkpoints.save(path, _files_writer({"state.pkl": b"x" * 64}, kill), iteration=1)
    # a save that died between its two renames: NAME.prev sealed, NAME gone
    os.rename(path, path.with_name("ckpt.prev"))
    assert checkpoints.resolve(path) == str(path.with_name("ckpt.prev"))
    assert "is incomplete (it is missing)" in caplog.text

    checkpoints.save(path, _files_writer({"state.pkl": b"y" * 64}, kill), iteration=2)
    (path / "state.pkl").write_bytes(b"")  # sealed, then damaged (a disk, a hand)
    with pytest.raises(checkpoints.IncompleteCheckpointError) as err:
        checkpoints.resolve(path)
    message = str(err.value)
    assert "state.pkl has 0 bytes, 64 were written" in message and "start a new run" in message
    assert not checkpoints.is_sealed(path)


def test_a_checkpoint_written_before_manifests_restores_as_it_is(tmp_path):
    legacy = tmp_path / "ckpt"
    legacy.mkdir()
    (legacy / "rllib_checkpoint.json").write_text("{}")
    assert checkpoints.resolve(legacy) == str(legacy)
    with pytest.raises(checkpoints.IncompleteCheckpointError, match="no such directory"):
        checkpoints.resolve(tmp_path / "none")


# -- the algorithm's own save ----------------------------------------------------------------
def _state(algo) -> tuple[int, int, str]:
    """(iteration, policy version, a digest of the learner's weights): a checkpoint restores
    one such triple whole; a mix (new weights, old counters) would match none."""
    published = algo.learner_weights()
    weights = published.get()
    assert weights and published.version == algo.policy_version
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].float().numpy().tobytes())
    return algo.iteration, algo.policy_version, digest.hexdigest()[:16]


def _kill_every_save_step(algo, path: Path, monkeypatch) -> set[str]:
    algo.train()
    algo.save_to_path(path)
    saved = {_state(algo): "old"}
    algo.train()
    probe = path.parent / "probe"
    algo.save_to_path(probe)
    with monkeypatch.context() as m:  # the steps of a save over an existing checkpoint
        count = KillAt(m, None)
        _save_killed(algo, probe, count)
    assert count.steps >= 6  # before it, the seal, its manifest, 2 renames, the removals
    saved[_state(algo)] = "new"  # save() drains, so the state is read after it
    seen = set()
    for at in range(count.steps):
        with monkeypatch.context() as m:
            with pytest.raises(Killed):
                _save_killed(algo, path, KillAt(m, at))
        algo.restore_from_path(path)
        state = _state(algo)
        assert state in saved, f"killed at step {at}: restored {state}, saved {list(saved)}"
        seen.add(saved[state])
        algo.restore_from_path(probe)  # back to the newer state for the next kill
    return seen


def _save_killed(algo, path, kill):
    kill.tick()  # a kill before the save begins
    algo.save_to_path(path)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_algorithm_restores_a_whole_checkpoint_after_a_kill_at_any_step(mode, tiny_model_dir, tmp_path, monkeypatch):
    if mode == "sync":
        from _configs import tiny_config

        config = tiny_config(tiny_model_dir, staleness=2)
    else:
        from test_async import _async_config

        config = _async_config(tiny_model_dir)
    algo = config.build_algo()
    try:
        seen = _kill_every_save_step(algo, tmp_path / "ckpt", monkeypatch)
    finally:
        algo.stop()
    assert seen == {"old", "new"}


# -- a real kill -9 of `m2po train` in the middle of a save ----------------------------------
@pytest.mark.slow
def test_kill_9_during_a_save_of_m2po_train_loses_nothing_saved(tiny_model_dir, tmp_path, ray_session, capfd,
                                                                monkeypatch):
    import tempfile

    from _processes import assert_all_end, ray_processes_of
    from test_cli import _m2po_here, _overrides, _user_env

    run = tmp_path / "run"
    # the job's own local Ray, in a temp dir of its own (short: Ray's sockets live under it)
    env = {**_user_env(), "RAY_TMPDIR": tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp")}
    args = [sys.executable, "-m", "m2po_rllib.jobs.cli", "train", "--config", "configs/default.yaml",
            "--output", str(run), "--stop-iters", "50", "--checkpoint-every", "1", "--no-progress",
            *_overrides(tiny_model_dir), "evaluation.evaluation_interval=null", "run.eval_at_start=false"]
    repo = Path(__file__).resolve().parents[1]
    job = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    deadline = time.monotonic() + 240
    caught = False
    try:
        # Poll for a save in progress: its fresh directory exists only between the save's
        # first write and its switch-in (a few ms a save here, one a step). Past the second
        # checkpoint, so that a complete one exists to lose. Every 2 ms, not in a busy loop:
        # that took one of the machine's two cores from the job it watches.
        while time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.002)
            new = [p for p in run.glob("checkpoint.new-*")] if run.exists() else []
            if new and checkpoints.newest(run / "checkpoint") is not None and _iteration(run) >= 2:
                ray_processes = ray_processes_of(job.pid)
                job.kill()  # the driver alone, as a user's kill -9 PID (or a lost node) does
                caught = True
                break
        if caught:
            # the local Ray it started (raylet, GCS, agents, workers) ends with it
            job.wait(timeout=60)
            assert_all_end(ray_processes, after="the job's kill -9")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    assert caught, f"no save was caught in progress: {job.stderr.read().decode()[-2000:]}"
    found = checkpoints.newest(run / "checkpoint")
    assert found is not None
    saved_iteration = json.loads((found / checkpoints.MANIFEST).read_text())["iteration"]

    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    # resumed in this process, on the test session's Ray (the killed job above is the user's shell)
    monkeypatch.chdir(repo)
    code, stdout, err = _m2po_here(capfd, "train", "--resume", str(run), "--stop-iters", str(saved_iteration + 1),
                                   "--no-progress")
    assert code == 0, err[-3000:]
    assert f"resumed {run} at iteration {saved_iteration}" in stdout
    summary = json.loads((run / "summary.json").read_text())
    history = json.loads((run / "history.json").read_text())
    assert summary["iterations"] == saved_iteration + 1
    assert [h["iteration"] for h in history] == list(range(1, saved_iteration + 2))
    # 2 updates a step once the stale queue is full: an iteration trained twice (a mixed
    # checkpoint: new weights and version, old counters) would show as a step of 4
    versions = [0] + [h["policy_version"] for h in history]
    assert {b - a for a, b in zip(versions, versions[1:])} <= {0, 2} and versions[-1] > 0
    assert summary["policy_version"] == versions[-1]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]


def _iteration(run: Path) -> int:
    try:
        return json.loads((run / "summary.json").read_text())["iterations"]
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def test_classes_pickled_under_their_module_paths_before_the_root_was_grouped_load():
    """Checkpoints written before the root was grouped (driver/, config/, common/) pickle the
    old module paths (`m2po_rllib.m2po.M2PO` in RLlib's class_and_ctor_args.pkl): they
    resolve to the moved modules' classes, the very same objects."""
    from m2po_rllib.common.errors import ConfigError
    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.driver.m2po import M2PO
    from m2po_rllib.driver.pace import IterationPace

    for old_module, cls in [("m2po_rllib.m2po", M2PO), ("m2po_rllib.config", M2POConfig),
                            ("m2po_rllib.errors", ConfigError), ("m2po_rllib.pace", IterationPace)]:
        assert pickle.loads(f"c{old_module}\n{cls.__name__}\n.".encode()) is cls
    import importlib

    import m2po_rllib.config.validation.values as moved

    assert importlib.import_module("m2po_rllib.validation.values") is moved
