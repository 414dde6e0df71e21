"""The settings `VLLMEngine` gives vLLM 0.32 on CPU, beside those it takes from the user.

- The KV cache's size (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it) and, for a
  runner given a CPU allocation, the worker's OpenMP threads, unbound (vLLM's "auto"
  binding would pin them to cores other processes of the job use).
- **Every prompt prefilled whole.** vLLM 0.32's CPU worker crashes the engine when a seeded
  request's prefill is split across two steps (chunked prefill, once a step's prompts pass
  `max_num_batched_tokens`, 4096 by default): it rewinds the request's generator with
  `gen.set_offset`, which a CPU generator does not have (`gpu_model_runner._bookkeeping_sync`:
  "CPU Generator does not use offset"). Every sample here is seeded, so a round of more than
  ~4096 prompt tokens (or a streaming runner's running batch) killed the engine. Chunked
  prefill is therefore off on CPU unless the user sets `enable_chunked_prefill`, with a step
  budget that holds the longest sequence (vLLM's own rule when it is off). What vLLM warns
  of then ("does not officially support disabling chunked prefill"): the engine's log-probs
  are checked against the learner's in the tests with vLLM runners (equal to 1e-3).
"""

from __future__ import annotations

import os

CPU_STEP_TOKENS = 4096  # vLLM's default step budget on CPU (max_num_batched_tokens)


def cpu_llm_kwargs(model_path: str, llm_kwargs: dict, *, max_model_len: int | None, kv_cache_space_gb: int,
                   num_threads: int | None) -> dict:
    """`llm_kwargs` with this package's CPU settings added (the user's own kept), and the
    environment vLLM's CPU worker reads set."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gb)))
    if num_threads is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(int(num_threads))
    if "enable_chunked_prefill" in llm_kwargs:
        return llm_kwargs
    longest = max_model_len or model_max_len(model_path, bool(llm_kwargs.get("trust_remote_code")))
    if not longest:  # a context this cannot read: vLLM's own defaults (it says what is wrong with the model)
        return llm_kwargs
    return {"max_num_batched_tokens": max(CPU_STEP_TOKENS, longest), **llm_kwargs, "enable_chunked_prefill": False}


def model_max_len(model_path: str, trust_remote_code: bool = False) -> int:
    """The model's own context length (what vLLM takes when `max_model_len` is None); 0 when
    its config cannot be read here."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    except (OSError, ValueError):
        return 0
    return int(getattr(config, "max_position_embeddings", 0) or 0)
