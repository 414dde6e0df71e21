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
"""

from __future__ import annotations

import os


def cpu_llm_kwargs(llm_kwargs: dict, *, kv_cache_space_gb: int, num_threads: int | None) -> dict:
    """`llm_kwargs` with this package's CPU settings added (the user's own kept), and the
    environment vLLM's CPU worker reads set."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gb)))
    if num_threads is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(int(num_threads))
    return {"enable_chunked_prefill": False, **llm_kwargs}
