"""The real `m2po` CLI on a tiny config: what it writes, resume, eval, export, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _overrides(model_dir: str) -> list[str]:
    return [
        f"rl_module.model_config.model={model_dir}",
        "environment.env_config.digits=2",
        "env_runners.max_new_tokens=4",
        "training.prompts_per_step=4",
        "training.group_size=4",
        "training.minibatch_prompts=2",
        "training.staleness=2",
        "evaluation.evaluation_interval=2",
        "evaluation.evaluation_duration=8",
    ]


# The built-in model on its own task: a small job whose held-out accuracy is not 0.
ARITH = [
    "rl_module.model_config.model=builtin:arith-tiny",
    "training.prompts_per_step=4",
    "training.group_size=4",
    "training.minibatch_prompts=2",
    "training.staleness=2",
    "evaluation.evaluation_interval=2",
    "evaluation.evaluation_duration=24",
]
# Lines the job must not print (issue 10: noise on every run).
NOISE = ("Traceback", "RLModuleConfig", "Token authentication is enabled", "Failed to load weights")


def _user_env() -> dict:
    """The environment of a user's shell: without what Ray set in this process
    (`ray_session` makes Ray export RAY_AUTH_MODE=token)."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}


def _m2po(*args, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "m2po_rllib.jobs.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env=_user_env(), **kw,
    )


def heldout_greedy_accuracy(model_path: str, n: int) -> float:
    """The default config's held-out accuracy, recomputed without RLlib, the env or the
    engine: a plain greedy loop over the first `n` held-out problems, scored by math_reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs import ArithmeticTasks, math_reward, render_prompt
    from m2po_rllib.models.builtin import greedy_completions, resolve_model_path

    path = resolve_model_path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = ArithmeticTasks(digits=3, num_operands=2, operators="+").heldout()[:n]
    completions = greedy_completions(model, tokenizer, [render_prompt(p.question, "compact") for p in problems], 8)
    return sum(math_reward(c, p.answer) for c, p in zip(completions, problems)) / n


def test_help_lists_every_subcommand_with_its_purpose(capsys):
    from m2po_rllib.jobs.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listed = dict(re.findall(r"^    (\w+)\s+(\S.*)$", capsys.readouterr().out, flags=re.M))
    assert {"train", "eval", "export", "plan", "lab", "report"} <= set(listed)  # README's commands
    for name in ("train", "eval", "export", "plan", "lab", "report"):
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: m2po {name} ")


def _m2po_here(capfd, *args) -> tuple[int, str, str]:
    """`m2po ARGS` in this process (the console script calls the same `main`): exit code,
    stdout, stderr (file-descriptor level, so library log lines count too)."""
    from m2po_rllib.jobs.cli import main

    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.stalenes=64", "unknown setting `training.stalenes`; did you mean `staleness`?"),
        (
            "rl_module.model_config.model=/no/such/model",
            "Invalid M2POConfig: model_config['model'] ('/no/such/model'): no such directory, and it is "
            "not a hub name; pass a HF model directory, a hub name (org/name) or 'builtin:arith-tiny'",
        ),
        # valid config, fails while the algorithm is built (in the env): the run dir goes too
        ("environment.env_config.digits=0", "digits=0 must be an integer >= 1"),
        # a GPU for remote runners that do not exist
        ("env_runners.num_gpus_per_env_runner=1",
         "Invalid M2POConfig: `num_gpus_per_env_runner` (1) asks GPUs for each remote EnvRunner, and "
         "`num_env_runners` is 0: no runner would get them"),
    ],
)
@pytest.mark.usefixtures("ray_session")  # the last one builds the algorithm: on the session's Ray
def test_config_errors_are_one_line_and_leave_no_run_dir(tmp_path, capfd, monkeypatch, override, message):
    # (every message is tested through the API in test_config_checks.py; here: what the CLI makes of one)
    monkeypatch.chdir(REPO)
    code, _, err = _m2po_here(capfd, "train", "--output", str(tmp_path / "run"), override)
    assert code == 2, err[-3000:]
    assert err.startswith(f"m2po train: error: {message}"), err[-3000:]
    assert err.count("\n") == 1, err[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_local_learner_on_a_gpu_this_machine_lacks_is_one_line_before_anything_starts(tmp_path, capfd, monkeypatch):
    """`num_gpus_per_learner=1` with the learner in this process, on a GPU index past this
    machine's real GPUs (none here): refused before Ray starts or a run directory exists."""
    from m2po_rllib.driver.resources import visible_gpus

    gpus = visible_gpus()
    monkeypatch.chdir(REPO)
    import m2po_rllib.jobs.train as train_job

    ray_starts = []
    monkeypatch.setattr(train_job, "init_ray", lambda **kw: ray_starts.append(kw))
    past = [f"learners.local_gpu_idx={gpus}"] if gpus else []  # a GPU machine: the index past its last
    code, _, err = _m2po_here(capfd, "train", "--output", str(tmp_path / "run"), "--stop-iters", "1",
                              "learners.num_gpus_per_learner=1", *past)
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    seen = f"{gpus} GPUs" + ("" if gpus else " (no CUDA device)") if gpus != 1 else "1 GPU"
    assert err.startswith(f"m2po train: error: `num_gpus_per_learner` is 1 with `num_learners` 0: the learner runs "
                          f"in this process on GPU {gpus} (`local_gpu_idx`), and this process sees {seen}. Set "
                          "learners.num_gpus_per_learner=0 to train on CPU"), err
    assert not (tmp_path / "run").exists()
    assert ray_starts == []  # refused before Ray


def test_resuming_a_missing_directory_is_one_line_with_the_fix(tmp_path, capfd):
    code, _, err = _m2po_here(capfd, "train", "--resume", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    assert err == (f"m2po train: error: --resume {tmp_path / 'nope'}: no such directory; pass the directory a run was "
                   "written to (its --output, by default runs/<config>-<time>; `ls runs/` lists them)\n")
    assert not (tmp_path / "nope").exists()


def test_an_empty_heldout_split_is_refused_before_anything_is_made(tmp_path, capfd, monkeypatch):
    """A dataset whose held-out split is empty (here: heldout_fraction 0) is refused in one
    line before Ray starts or a run directory exists, not after the build."""
    data = tmp_path / "ten.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(10)))
    monkeypatch.chdir(REPO)
    # Whether this process already has a Ray (the suite's session fixture) says nothing about
    # the job: what counts is that the job never asked for one.
    import m2po_rllib.jobs.train as train_job

    ray_starts = []
    monkeypatch.setattr(train_job, "init_ray", lambda **kw: ray_starts.append(kw))
    code, _, err = _m2po_here(
        capfd, "train", "--output", str(tmp_path / "run"), "environment.env=m2po/MathDataset-v0",
        f"environment.env_config={{path: {data}, heldout_fraction: 0.0}}",
    )
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    assert "the heldout split of 'm2po/MathDataset-v0' holds no problems" in err and "heldout_path" in err, err
    assert not (tmp_path / "run").exists()
    assert ray_starts == []  # refused before Ray


def test_bad_override_is_a_clear_error(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = _m2po_here(capfd, "train", "--output", str(tmp_path / "r"), "lr=1e-5")
    assert code == 2
    assert "needs a section" in err and "training.lr=1e-5" in err


def test_a_malformed_override_value_is_one_line_naming_it(tmp_path, capfd, monkeypatch):
    """A value YAML cannot read (an unclosed brace) is a user error: one line that names the
    override, what is wrong and where, and the fix; not yaml's 60-line traceback."""
    monkeypatch.chdir(REPO)
    code, _, err = _m2po_here(capfd, "train", "--output", str(tmp_path / "r"), "environment.env_config={digits: 3")
    assert code == 2, err[-3000:]
    assert err.count("\n") == 1, err[-3000:]
    assert err.startswith(
        "m2po train: error: override 'environment.env_config={digits: 3': its value is not valid YAML "
        "(expected ',' or '}', but got '<stream end>', at the end of the value); close every bracket and quote"
    ), err
    assert not (tmp_path / "r").exists()


def test_the_restart_command_of_a_run_without_checkpoint_pastes_back(tmp_path, capfd):
    """`--resume` of a run that stopped before its first checkpoint prints the command that
    starts it again: shell-quoted, so that pasting it gives back every argument (a path with
    a space, an override with braces and spaces), with the loop settings it ran with."""
    run = tmp_path / "my run"
    run.mkdir()
    overrides = ["environment.env_config={digits: 3, num_operands: 2}", "training.lr=1e-5", "run.tensorboard=all"]
    meta = {"config_path": "configs/default.yaml", "overrides": overrides, "spec": {},
            "run": {"stop_iters": 5, "stop_minutes": None, "checkpoint_every": 10, "tensorboard": "all"}}
    (run / "run.json").write_text(json.dumps(meta))
    code, _, err = _m2po_here(capfd, "train", "--resume", str(run))
    assert code == 2 and err.count("\n") == 1, err[-3000:]
    printed = re.search(r"start it again with `(.+)`$", err.strip())
    assert printed, err
    assert shlex.split(printed.group(1)) == [
        "m2po", "train", "--config", "configs/default.yaml", "--output", str(run),
        "--stop-iters", "5", "--checkpoint-every", "10", *overrides,
    ]


def test_a_bug_keeps_its_traceback(capfd, monkeypatch):
    """Only a ConfigError (or a missing file) is a one-line user error: any other exception
    is a bug, and the CLI lets it through with its traceback."""
    import m2po_rllib.jobs.report as report

    def broken(dirs, out=None, **options):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(report, "run_report", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        _m2po_here(capfd, "report", "somewhere")


def assert_resume_sets_the_optimizer_lr(run: Path, saved_lr: float) -> None:
    """Restoring a checkpoint loads the optimizer's old lr (RLlib would set the new one only
    after the first update): the first update after `--resume ... training.lr=x` uses x."""
    from m2po_rllib.jobs.run_dir import restore, resume_run

    for overrides, lr in (([], saved_lr), (["training.lr=0.25"], 0.25)):
        run_dir, _, _, config, changes = resume_run(str(run), overrides)
        algo = restore(run_dir, config, changes)
        try:
            learner = algo.learner_group._learner
            lrs = [g["lr"] for _, opt in learner.get_optimizers_for_module("default_policy") for g in opt.param_groups]
            assert algo.iteration == 3 and lrs == [lr]
        finally:
            algo.stop()


@pytest.mark.usefixtures("ray_session")
def test_train_resume_eval_export(tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    # a relative --output (run from tmp_path), with a checkpoint inside the loop
    out = _m2po(
        "train", "--stop-iters", "2", "--checkpoint-every", "1", "--output", "run", "--no-progress", *ARITH,
        "training.lr=1e-3", cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [n for n in NOISE if n in out.stdout + out.stderr], (out.stdout + out.stderr)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["policy_version"] == 2  # step 1 fills the queue
    assert summary["start_heldout_accuracy"] == heldout_greedy_accuracy("builtin:arith-tiny", 24)
    assert "end_heldout_accuracy" in summary and "held-out accuracy (end)" in out.stdout
    assert (run / "checkpoint" / "rllib_checkpoint.json").exists()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    history = json.loads((run / "history.json").read_text())
    assert [h["iteration"] for h in history] == [1, 2]

    # Settings the checkpoint was made for cannot change; the message lists those that can.
    code, _, err = _m2po_here(capfd, "train", "--resume", str(run), "training.staleness=4", "env_runners.temperature=0.5")
    assert code == 2
    assert err.startswith(
        "m2po train: error: cannot change `env_runners.temperature`, `training.staleness` when resuming"
    ) and "run.*, training.lr," in err
    # (in this process, on the session's Ray: the first run above is the user's shell)
    code, stdout, err = _m2po_here(capfd, "train", "--resume", str(run), "--stop-iters", "3", "--no-progress",
                                   "training.lr=5e-4")
    assert code == 0, err[-3000:]
    assert "resumed" in stdout and "  training.lr: 0.001 -> 0.0005" in stdout
    meta = json.loads((run / "run.json").read_text())
    assert meta["spec"]["training"]["lr"] == 5e-4
    assert meta["resumes"] == [{"iteration": 2, "overrides": ["training.lr=5e-4"]}]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["policy_version"] == 4
    assert [h["iteration"] for h in json.loads((run / "history.json").read_text())] == [1, 2, 3]
    assert_resume_sets_the_optimizer_lr(run, saved_lr=5e-4)

    hf_dir = tmp_path / "hf"
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    code, _, err = _m2po_here(capfd, "export", "--checkpoint", "run", "--out", "hf")
    assert code == 0, err[-3000:]
    import torch
    from transformers import AutoModelForCausalLM

    from m2po_rllib.jobs.export import load_policy_module
    from m2po_rllib.models.builtin import resolve_model_path

    exported = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    trained = load_policy_module(run).model.state_dict()
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:arith-tiny")).state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    assert any(not torch.equal(exported[k], base[k]) for k in base), "export holds the base weights"

    code, stdout, err = _m2po_here(capfd, "eval", "--checkpoint", "run", "--num", "24")
    assert code == 0, err[-3000:]
    result = json.loads(stdout[stdout.index("{") :])
    assert result["problems"] == 24
    assert result["greedy_accuracy"] == heldout_greedy_accuracy(str(hf_dir), 24)


def _interrupt(args: list[str], when) -> tuple[int, str]:
    """Starts `m2po ARGS` as a user's shell would, sends Ctrl-C once `when(line)` holds for
    a line it printed, and returns (exit code, everything it printed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2po_rllib.jobs.cli", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_user_env(),
    )
    deadline = time.time() + 300
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if when(line) or time.time() > deadline:
            break
    time.sleep(1.0)  # inside what the line announced
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + rest


def test_ctrl_c_saves_a_checkpoint_anywhere_and_the_run_resumes(tmp_path, capfd):
    """Ctrl-C before the loop (in the held-out evaluation before training, made slow with
    mean@64) saves a checkpoint, prints the --resume command, exits 130 with no traceback;
    --resume then evaluates and trains, and a Ctrl-C inside the loop saves a checkpoint too."""
    run = tmp_path / "run"
    code, output = _interrupt(
        ["train", "--stop-iters", "1", "--output", str(run), "--no-progress", *ARITH,
         "evaluation.evaluation_duration=500", "evaluation.eval_samples=64"],
        lambda line: line.startswith("evaluating held-out accuracy before training"),
    )
    assert code == 130, output[-3000:]
    assert "Traceback" not in output and "held-out accuracy before training:" not in output, output[-3000:]
    assert f"checkpoint saved in {run / 'checkpoint'}; continue with `m2po train --resume {run}`" in output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["iterations"] == 0
    assert "start_heldout_accuracy" not in summary

    # A run directory without a checkpoint says so plainly.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "run.json").write_text((run / "run.json").read_text())
    code, _, err = _m2po_here(capfd, "train", "--resume", str(bare))
    assert code == 2 and "the run has no checkpoint yet" in err, err[-3000:]

    # Resumed: it evaluates, trains, and a Ctrl-C in the loop stops after the iteration.
    code, output = _interrupt(
        ["train", "--resume", str(run), "--no-progress", "--stop-iters", "1000", "evaluation.eval_samples=1",
         "evaluation.evaluation_duration=24"],
        lambda line: line.startswith("iter 2:"),
    )
    assert code == 130, output[-3000:]
    assert "checkpoint saved" in output and "--resume" in output and "Traceback" not in output
    assert (run / "checkpoint" / "rllib_checkpoint.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and 2 <= summary["iterations"] < 1000
    assert summary["start_heldout_accuracy"] == heldout_greedy_accuracy("builtin:arith-tiny", 24)


@pytest.mark.usefixtures("ray_session")
def test_the_record_survives_a_crash_like_the_checkpoint(tmp_path, capfd, monkeypatch):
    """A job killed between checkpoints (here: a crash injected into iteration 4, after the
    checkpoint of iteration 2) leaves history.json and summary.json as of that checkpoint;
    --resume redoes iteration 3 and the record runs on: one history from iteration 1, the
    start accuracy kept, the training time of both parts."""
    from m2po_rllib.driver.m2po import M2PO

    run = tmp_path / "run"
    train = M2PO.train

    def crash_in_iteration_4(algo):
        if algo.iteration == 3:
            raise SystemExit("killed")  # no handler runs: as kill -9, for the record
        return train(algo)

    monkeypatch.setattr(M2PO, "train", crash_in_iteration_4)
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        _m2po_here(capfd, "train", "--stop-iters", "5", "--checkpoint-every", "2", "--output", str(run), "--no-progress",
                   *ARITH)
    history = json.loads((run / "history.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert [h["iteration"] for h in history] == [1, 2] and summary["iterations"] == 2
    start, seconds = summary["start_heldout_accuracy"], summary["train_seconds"]
    assert start is not None and seconds > 0

    monkeypatch.setattr(M2PO, "train", train)
    code, out, err = _m2po_here(capfd, "train", "--resume", str(run), "--stop-iters", "4", "--no-progress")
    assert code == 0, err[-3000:]
    history = json.loads((run / "history.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert [h["iteration"] for h in history] == [1, 2, 3, 4]
    assert summary["start_heldout_accuracy"] == start and summary["train_seconds"] > seconds
    assert summary["iterations"] == 4 and re.search(r"change \(points\)\s+[+-]\d", out)


def test_a_ctrl_c_that_lands_in_a_finalizer_is_delivered_after_it():
    """Python drops an exception raised inside `__del__` (it prints "Exception ignored in"):
    a Ctrl-C that arrives while a finalizer runs is raised again just after it, not lost."""
    from m2po_rllib.jobs.ctrl_c import CtrlC

    raised_inside = []

    class Finalized:
        def __del__(self):
            try:
                ctrl_c._handle(signal.SIGINT, sys._getframe())
            except KeyboardInterrupt:
                raised_inside.append(True)

    with CtrlC() as ctrl_c:
        Finalized()  # its __del__ runs here and receives the Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            time.sleep(5)  # the re-delivered SIGINT interrupts this
    assert raised_inside == [] and ctrl_c.requested
