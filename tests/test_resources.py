"""What each config asks Ray for, built without GPUs and without loading a model.

`M2PO.default_resource_request(config)` is the placement group a Tune trial (or `m2po
train` under a cluster's scheduler) reserves: one bundle for the driver, then one per
EnvRunner, then one per learner (RLlib's order). The paper configs put 8 vLLM runners and 8
learners on 16 separate GPUs: every GPU bundle holds exactly one GPU, so no two actors share
one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from m2po_rllib.config import M2POConfig
from m2po_rllib.config.from_yaml import load_spec
from m2po_rllib.driver.m2po import M2PO

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = sorted(p.stem for p in CONFIGS.glob("paper_*.yaml"))


def resource_request(name: str):
    spec = load_spec(str(CONFIGS / f"{name}.yaml"))
    spec.pop("run", None)
    config = M2POConfig.from_spec(spec)
    return config, M2PO.default_resource_request(config)


def test_there_are_paper_configs():
    assert len(PAPER_CONFIGS) == 3, PAPER_CONFIGS


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_places_8_runners_and_8_learners_on_separate_gpus(name):
    config, pgf = resource_request(name)
    bundles = pgf.bundles
    assert len(bundles) == 1 + 8 + 8
    driver, runners, learners = bundles[0], bundles[1:9], bundles[9:]

    # The driver runs the algorithm loop only: CPU, no GPU.
    assert driver == {"CPU": config.num_cpus_for_main_process}
    # Each vLLM EnvRunner: its own GPU and the CPUs the config gives it.
    assert runners == [{"CPU": float(config.num_cpus_per_env_runner), "GPU": 1.0}] * 8
    # Each learner: its own GPU (RLlib's "auto" CPUs are 0 next to a GPU).
    cpus = config.num_cpus_per_learner if config.num_cpus_per_learner != "auto" else 0
    expected_learner = {"GPU": 1.0, **({"CPU": float(cpus)} if cpus else {})}
    assert learners == [expected_learner] * 8

    assert sum(b.get("GPU", 0) for b in bundles) == 16
    assert all(b.get("GPU", 0) in (0, 1) for b in bundles)
    # Evaluation runs on the training runners: no extra bundles for it.
    assert config.evaluation_num_env_runners == 0
    assert pgf.strategy == config.placement_strategy


def test_default_config_is_one_process_with_both_laptop_cpus():
    _, pgf = resource_request("default")  # it samples and trains in the driver, 2 torch threads
    assert pgf.bundles == [{"CPU": 2.0}]
    assert pgf.required_resources == {"CPU": 2.0}


def test_gpu_counts_follow_the_config():
    """Changing the counts changes the request: 2 runners x 1 GPU, 4 learners x 0.5 GPU."""
    spec = load_spec(str(CONFIGS / "paper_qwen3_1.7b_stale256.yaml"))
    spec.pop("run", None)
    spec["env_runners"].update(num_env_runners=2, num_cpus_per_env_runner=4)
    spec["learners"].update(num_learners=4, num_gpus_per_learner=0.5, num_cpus_per_learner=2)
    pgf = M2PO.default_resource_request(M2POConfig.from_spec(spec))
    assert pgf.bundles[1:] == [{"CPU": 4.0, "GPU": 1.0}] * 2 + [{"CPU": 2.0, "GPU": 0.5}] * 4
    assert pgf.required_resources == {"CPU": 1.0 + 8 + 8, "GPU": 4.0}


# -- actors that cannot fit ------------------------------------------------------------------
def _actor_config(tiny_model_dir, runners: int, runner_cpus: float, learners: int) -> M2POConfig:
    return (
        M2POConfig()
        .environment("m2po/Arithmetic-v0", env_config={"digits": 1})
        .env_runners(num_env_runners=runners, num_cpus_per_env_runner=runner_cpus, rollout_engine="hf")
        .learners(num_learners=learners)
        .rl_module(model_config={"model": tiny_model_dir})
        .training(group_size=2, prompts_per_step=6, minibatch_prompts=2)
    )


def test_actors_larger_than_a_local_cluster_fail_with_the_arithmetic(tiny_model_dir):
    from m2po_rllib.common.errors import ConfigError
    from m2po_rllib.driver.resources import check_actors_fit

    config = _actor_config(tiny_model_dir, runners=2, runner_cpus=1, learners=1)
    bundles = M2PO.default_resource_request(config).bundles
    with pytest.raises(ConfigError) as err:
        check_actors_fit(config, bundles, cluster={"CPU": 2.0}, local=True)
    message = str(err.value)
    assert "need 3 CPUs (2 EnvRunner(s) x 1 CPU + 1 Learner(s) x 1 CPU)" in message
    assert "this local Ray cluster has 2 CPUs" in message and "num_cpus_per_env_runner" in message
    assert "num_cpus_per_env_runner" in err.value.settings
    # the same on a cluster this process joined: it may grow, so no error (a notice instead)
    check_actors_fit(config, bundles, cluster={"CPU": 2.0}, local=False)
    # half a CPU per runner fits the 2-CPU machine
    half = _actor_config(tiny_model_dir, runners=2, runner_cpus=0.5, learners=1)
    check_actors_fit(half, M2PO.default_resource_request(half).bundles, cluster={"CPU": 2.0}, local=True)


def test_waiting_actors_are_announced_until_the_resources_are_free():
    import time

    from m2po_rllib.driver.resources import WaitingNotice

    free = [{"CPU": 1.0}]
    lines: list[str] = []
    notice = WaitingNotice({"CPU": 3.0, "GPU": 0.0}, lambda: free[0], every_s=0.02, log=lines.append)
    with notice:
        deadline = time.monotonic() + 5
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        free[0] = {"CPU": 3.0}  # the autoscaler added a node
        n = len(lines)
        time.sleep(0.1)
    assert n >= 2 and len(lines) == n  # announced at the start and every period, then quiet
    assert lines[0] == ("waiting for Ray to place the algorithm's actors: they need 3 CPUs; free now: 1 CPUs "
                        "(an autoscaling cluster adds nodes; otherwise other jobs hold them)")
    assert WaitingNotice({"CPU": 1.0, "GPU": 0.0}, lambda: {"CPU": 2.0}).notice() is None


@pytest.mark.slow
def test_build_algo_fails_at_once_when_the_actors_cannot_fit(ray_session, tiny_model_dir):
    """The session's local Ray has 4 CPUs: 3 runners and 2 learners at 1 CPU each would wait
    forever; `build_algo()` says so before creating any actor."""
    import time

    import ray

    from m2po_rllib.common.errors import ConfigError

    before = ray.available_resources().get("CPU")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"need 5 CPUs \(3 EnvRunner\(s\) x 1 CPU \+ 2 Learner\(s\) x 1 CPU\) and this "
                                          r"local Ray cluster has 4 CPUs"):
        _actor_config(tiny_model_dir, runners=3, runner_cpus=1, learners=2).build_algo()
    assert time.monotonic() - t0 < 60 and ray.available_resources().get("CPU") == before


def _refused(config, cluster: dict[str, float]):
    """The `ConfigError` with which `check_actors_fit` refuses `config` on a local Ray of `cluster`."""
    from m2po_rllib.common.errors import ConfigError
    from m2po_rllib.driver.resources import check_actors_fit

    with pytest.raises(ConfigError) as err:
        check_actors_fit(config, M2PO.default_resource_request(config).bundles, cluster=cluster, local=True)
    return err.value


def test_a_custom_resource_no_node_offers_is_refused_with_how_to_offer_it(tiny_model_dir):
    """Runners pinned to nodes with `{"rollout_node": 1}` (a cluster's worker nodes) on a
    local Ray without that resource would wait forever: refused, with the arithmetic and the
    two fixes (start nodes that offer it, or drop it)."""
    from m2po_rllib.driver.resources import check_actors_fit

    config = _actor_config(tiny_model_dir, runners=2, runner_cpus=0.5, learners=0).env_runners(
        custom_resources_per_env_runner={"rollout_node": 1})
    err = _refused(config, {"CPU": 4.0})
    message = str(err)
    assert message.startswith("the algorithm's actors need 2 rollout_nodes (2 EnvRunner(s) x 0.5 CPU and 1 rollout_node) "
                              "and this local Ray cluster has 0 rollout_nodes")
    assert """ray start --resources='{"rollout_node": 2}'""" in message and "num_cpus" not in message
    assert err.settings == ("custom_resources_per_env_runner", "custom_resources_per_learner")
    # a node that offers two is enough
    check_actors_fit(config, M2PO.default_resource_request(config).bundles,
                     cluster={"CPU": 4.0, "rollout_node": 2.0}, local=True)


def test_the_run_says_which_runners_are_down_every_period_and_when_they_are_back(tiny_model_dir):
    from m2po_rllib.rollout.runners_down import RunnersDown

    config = _actor_config(tiny_model_dir, runners=2, runner_cpus=1, learners=0).env_runners(
        custom_resources_per_env_runner={"rollout_node": 1}, sample_timeout_s=120).training(async_rollouts=True)
    now, lines = [0.0], []
    down = RunnersDown(config, every_s=30, log=lines.append, clock=lambda: now[0])
    down.observe([])  # all healthy: nothing said
    for t, ids in [(0, [2]), (10, [1, 2]), (31, [1, 2]), (40, [1])]:
        now[0] = t
        down.observe(ids)
    now[0] = 52.4
    down.observe([])
    assert lines == [
        "EnvRunner(s) [2] down for 0 s (crashed, or their node left the cluster): Ray restarts each where 1 CPU, "
        "1 rollout_node is free, the run going on with the others meanwhile; with none left, it fails once no "
        "round has come for `sample_timeout_s` (120 s)",
        "EnvRunner(s) [1, 2] down for 31 s (crashed, or their node left the cluster): Ray restarts each where 1 CPU, "
        "1 rollout_node is free, the run going on with the others meanwhile; with none left, it fails once no "
        "round has come for `sample_timeout_s` (120 s)",
        "EnvRunner(s) [1] back after 52 s",
    ]
    # the synchronous protocol waits for the restore first
    sync = RunnersDown(config.copy(copy_frozen=False).training(async_rollouts=False), log=lines.append)
    sync.observe([1])
    assert lines[-1].endswith("it fails after `env_runner_restore_timeout_s` + `sample_timeout_s` (1920 s) "
                              "without samples")


def test_placement_reads_as_one_line_per_node():
    from m2po_rllib.driver.resources import describe_placement

    where = {"driver": "aaaa1111ffff", "env_runners": {1: "bbbb2222ffff", 2: "bbbb2222ffff", 3: "aaaa1111ffff"},
             "learners": ["aaaa1111ffff", "aaaa1111ffff"]}
    names = {"aaaa1111ffff": "head", "bbbb2222ffff": "127.0.0.1:4321"}
    assert describe_placement(where, names) == (
        "EnvRunners 1,2 on node bbbb2222 (127.0.0.1:4321); EnvRunner 3 on node aaaa1111 (head, this driver); "
        "2 Learners on node aaaa1111 (head, this driver)")
    assert describe_placement({"driver": "aaaa1111ffff", "env_runners": {}, "learners": []}, names) == (
        "the Learner in this driver on node aaaa1111 (head, this driver)")


# -- GPUs: requests this machine (or its local Ray) cannot serve ---------------------------------
def test_a_gpu_shortage_names_the_gpu_settings_not_the_cpu_ones(tiny_model_dir):
    config = _actor_config(tiny_model_dir, runners=1, runner_cpus=0.5, learners=0).env_runners(num_gpus_per_env_runner=1)
    err = _refused(config, {"CPU": 2.0})
    message = str(err)
    assert message.startswith("the algorithm's actors need 1 GPUs (1 EnvRunner(s) x 0.5 CPU and 1 GPU) and this local "
                              "Ray cluster has 0 GPUs: Ray would queue them forever. Lower `num_gpus_per_env_runner`")
    assert "ray.init(num_gpus=...)" in message and "num_cpus" not in message
    assert err.settings[0] == "num_gpus_per_env_runner" and "num_cpus_per_env_runner" not in err.settings
    # short of both: each with its own fix, GPUs first
    many = _actor_config(tiny_model_dir, runners=3, runner_cpus=1, learners=0).env_runners(num_gpus_per_env_runner=1)
    message = str(_refused(many, {"CPU": 2.0}))
    assert "need 3 CPUs, 3 GPUs" in message and "ray.init(num_gpus=...)" in message
    assert "ray.init(num_cpus=...)" in message


def test_a_local_learner_asks_for_a_gpu_this_process_has(tiny_model_dir):
    """With this machine's real GPUs (none here): a learner in this process on a GPU index
    past them is refused at build, before Ray or the learner starts, naming what it saw."""
    from m2po_rllib.common.errors import ConfigError
    from m2po_rllib.driver.resources import visible_gpus

    gpus = visible_gpus()
    config = _actor_config(tiny_model_dir, runners=0, runner_cpus=1, learners=0).learners(
        num_gpus_per_learner=1, local_gpu_idx=gpus)
    with pytest.raises(ConfigError) as err:
        config.build_algo()
    assert f"on GPU {gpus} (`local_gpu_idx`), and this process sees {gpus} GPU" in str(err.value)
    assert err.value.settings[0] == "num_gpus_per_learner"
    assert config.learner_gpus == 1  # the local learner's GPUs are num_gpus_per_learner, as RLlib's main bundle


def test_gpus_for_runners_that_do_not_exist_are_refused(tiny_model_dir):
    from m2po_rllib.common.errors import ConfigError

    config = _actor_config(tiny_model_dir, runners=0, runner_cpus=1, learners=0).env_runners(num_gpus_per_env_runner=1)
    with pytest.raises(ConfigError, match=r"`num_env_runners` is 0: no runner would get them") as err:
        config.validate()
    assert err.value.settings == ("num_gpus_per_env_runner", "num_env_runners")
    # with a runner (or a dedicated evaluation runner) the request has someone to go to
    config.copy(copy_frozen=False).env_runners(num_env_runners=1).validate()
    config.copy(copy_frozen=False).evaluation(evaluation_num_env_runners=1, evaluation_interval=1).validate()


@pytest.mark.slow
def test_build_algo_fails_at_once_when_the_gpus_are_missing(ray_session, tiny_model_dir):
    """The session's local Ray has this machine's GPUs (none here): a runner asking for one
    more than that is refused before any actor is made, with the GPU settings as the fix."""
    import ray

    from m2po_rllib.common.errors import ConfigError

    have = ray.cluster_resources().get("GPU", 0.0)
    config = _actor_config(tiny_model_dir, runners=1, runner_cpus=0.5, learners=0).env_runners(
        num_gpus_per_env_runner=have + 1)
    with pytest.raises(ConfigError, match=r"Ray would queue them forever. Lower `num_gpus_per_env_runner`"):
        config.build_algo()


# -- the Ray a Python script's algorithm starts ---------------------------------------------------
@pytest.mark.slow
def test_a_local_ray_started_for_a_python_script_ends_with_its_kill_9(tiny_model_dir, tmp_path):
    """A script that builds the algorithm without `ray.init()` gets a local Ray (as RLlib's
    users expect); killed with kill -9, that Ray ends with it: the raylet's dashboard and
    runtime-env agents and the runner's worker included, as with `m2po train`."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from _processes import assert_all_end, ray_processes_of
    from test_cli import _user_env

    script = tmp_path / "build.py"
    script.write_text(
        "import time\n"
        "from m2po_rllib.config import M2POConfig\n"
        "config = (M2POConfig().environment('m2po/Arithmetic-v0', env_config={'digits': 1})\n"
        "          .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, rollout_engine='hf')\n"
        f"          .rl_module(model_config={{'model': {tiny_model_dir!r}}})\n"
        "          .training(group_size=2, prompts_per_step=2, minibatch_prompts=2))\n"
        "algo = config.build_algo()\n"
        "print('built', flush=True)\n"
        "time.sleep(600)\n"
    )
    # its own temp dir (short: Ray's sockets live under it); ray.init() picks free ports
    env = {**_user_env(), "RAY_TMPDIR": tempfile.mkdtemp(prefix="m2po-ray-", dir="/tmp")}
    job = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        line = job.stdout.readline()
        assert line == "built\n", job.stderr.read()[-3000:] if job.poll() is not None else line
        ray_processes = ray_processes_of(job.pid)
        names = " ".join(" ".join(p.cmdline()) for p in ray_processes)
        assert "raylet" in names and "dashboard/agent.py" in names, names  # what lingered before
        job.kill()  # the script alone, as a user's kill -9 PID does
        job.wait(timeout=60)
        assert_all_end(ray_processes, after="the script's kill -9")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        import shutil

        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
