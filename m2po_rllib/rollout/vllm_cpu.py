"""The settings `VLLMEngine` gives vLLM 0.32 on CPU, beside those it takes from the user.

- The KV cache's size (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it) and, for a
  runner given a CPU allocation, the worker's OpenMP threads, unbound (vLLM's "auto"
  binding would pin them to cores other processes of the job use).
- **Every prompt prefilled whole.** vLLM 0.32's CPU worker crashes the engine when a seeded
  request's prefill is split across two steps (chunked prefill, once a step's prompts pass
  `max_num_batched_tokens`, 4096 by default on CPU): it rewinds the request's generator with
  `gen.set_offset`, which a CPU generator does not have (`gpu_model_runner._bookkeeping_sync`:
  "CPU Generator does not use offset"). Every sample here is seeded, so a round of more than
  ~4096 prompt tokens (or a streaming runner's running batch) killed the engine. Chunked
  prefill is therefore off on CPU unless the user sets `enable_chunked_prefill`; vLLM then
  sizes the step to hold the longest sequence itself (`EngineArgs`: max(max_model_len, its
  default)). What vLLM warns of then ("does not officially support disabling chunked
  prefill"): the engine's log-probs are checked against the learner's in the tests with vLLM
  runners (equal to 1e-3).
- **Where the engine core runs** (`core`): vLLM's default puts the engine core and its worker
  in processes of their own ("process"), which on CPU costs two more imports of torch and
  vLLM (the worker is a process of its own too: vLLM forces its "mp" executor there) and a
  worker that spins for 1 s after each message: an engine starts in 21-26 s and stops in
  5-6 s here. "inline" runs them in the caller's process (vLLM's
  VLLM_ENABLE_V1_MULTIPROCESSING=0): 9-11 s and ~1.6 s (docs/guide/gpus-and-clusters.md).
  The worker then takes the process over: it seeds the global random generators, opens torch.distributed's default group, makes
  `torch.set_num_threads` a no-op and freezes vLLM's environment variables (read once, then
  cached), so "inline" is for a process that is the engine's own, as an EnvRunner actor is.
  "auto" is "inline" on CPU and "process" elsewhere (on a GPU the separate core overlaps
  scheduling with the caller's Python). A crash in an inline engine takes its runner with
  it, which RLlib then restarts (`restart_failed_env_runners`).
"""

from __future__ import annotations

import contextlib
import os

CORES = ("process", "inline", "auto")


def cpu_llm_kwargs(llm_kwargs: dict, *, kv_cache_space_gb: int, num_threads: int | None) -> dict:
    """`llm_kwargs` with this package's CPU settings added (the user's own kept), and the
    environment vLLM's CPU worker reads set."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gb)))
    if num_threads is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(int(num_threads))
    return {"enable_chunked_prefill": False, **llm_kwargs}


def runs_inline(core: str, on_cpu: bool) -> bool:
    """Whether `core` (one of `CORES`) puts the engine core in the caller's process."""
    if core not in CORES:
        raise ValueError(f"`core` ({core!r}) must be one of {CORES}: 'process' (vLLM's default), "
                         "'inline' (in this process), 'auto' (inline on CPU)")
    return core == "inline" or (core == "auto" and on_cpu)


@contextlib.contextmanager
def core_placement(inline: bool):
    """vLLM's switch for the engine core's process, set while an `LLM` is built (vLLM reads it
    there). Refused where vLLM already froze its environment (an inline engine was built in
    this process) with the other value: the new engine would silently run where that one did."""
    from vllm import envs

    wanted = "0" if inline else "1"
    if envs._is_envs_cache_enabled() and envs.VLLM_ENABLE_V1_MULTIPROCESSING != (not inline):
        raise ValueError(
            f"`core` asks for the engine core {'inline' if inline else 'in a process of its own'}, but an "
            "earlier inline engine froze vLLM's environment in this process the other way; build every "
            "engine of one process with the same `core`"
        )
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = wanted
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
