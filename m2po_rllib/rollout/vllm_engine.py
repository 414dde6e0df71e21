"""`VLLMEngine`: a `vllm.LLM` behind `GenerationEngine`, with versioned in-place weight syncs.

Log-probs: the LLM runs with `logprobs_mode="processed_logprobs"`, so the log-prob vLLM returns
for a sampled token is taken after temperature scaling and top-p masking, i.e. of the
distribution it was sampled from; greedy requests get the raw log-softmax (vLLM's
`Sampler.sample`). Plain vLLM would return raw-logit log-probs whatever the temperature.

Weight sync - which path, when:
- Implemented here (CPU, and a single GPU for models up to a few GB): the trainer's tensors
  are cast to the served dtype, packed into safetensors byte strings of at most
  `sync_chunk_bytes` each (one tensor larger than that travels alone) and sent with
  `LLM.collective_rpc` to `WeightSyncExtension`, mixed into every vLLM worker through
  `worker_extension_cls`. The worker loads them in checkpoint format with vLLM's layerwise
  reload (`initialize_layerwise_reload` -> `model.load_weights` per chunk ->
  `finalize_layerwise_reload`, what `model_runner.reload_weights` does in one call), so
  fused or repacked kernel weights (qkv, CPU-packed linears) are rebuilt; one reload session
  spans all chunks, so a layer whose weights straddle two chunks is processed once, whole.
  Bytes go over vLLM's engine-core ZMQ socket (a copy per hop); the prefix cache is reset
  afterwards, since its KV entries were computed by the old weights.
- GPUs, large models (not wired here; needs a GPU to test): vLLM 0.32 ships
  `vllm.distributed.weight_transfer` - `LLM(..., weight_transfer_config={"backend": "nccl"})`
  (also "ipc" for a trainer on the same GPU, "sparse_nccl", "sharded_rdt", "nccl_m2n"), then
  `collective_rpc("init_weight_transfer_engine", args=(init_info,))` once and per sync
  `start_weight_update` / `update_weights(update_info)` / `finish_weight_update`; the trainer
  side is `WeightTransferTrainerFactory` (e.g. `NCCLTrainerWeightTransferEngine.trainer_init`
  then `send_weights`). That path moves tensors GPU-to-GPU; swap it in behind
  `_load_weights` keeping the version logic of `GenerationEngine.update_weights`.

Health: `is_healthy()` is False once vLLM flagged its engine core dead, or the engine-core
process or a worker process (pids recorded at start) is gone or a zombie; `generate` then
raises `EngineDeadError` instead of hanging on a dead socket.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator, Mapping

import torch

from m2po_rllib.rollout.engine import Completion, EngineDeadError, GenerationEngine, SamplingConfig

logger = logging.getLogger(__name__)

DEFAULT_SYNC_CHUNK_BYTES = 256 * 2**20


class WeightSyncExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); its methods run in the worker
    process through `LLM.collective_rpc`. Prefixed names keep clear of the worker's own."""

    def m2po_pid(self) -> int:
        return os.getpid()

    def m2po_start_weight_sync(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from m2po_rllib.log_filters import quiet_vllm_rotary_reload

        quiet_vllm_rotary_reload()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def m2po_load_weight_chunk(self, payload: bytes) -> int:
        """Loads one safetensors-serialised chunk; returns how many tensors it held."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = load(payload)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(iter(tensors.items()))
        return len(tensors)

    def m2po_finish_weight_sync(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        # What `model_runner.reload_weights` also drops: state derived from the old weights.
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()


def serialize_weight_chunks(
    weights: Mapping[str, torch.Tensor], chunk_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[bytes]:
    """Yields safetensors byte strings of at most `chunk_bytes` of tensor data each (a single
    larger tensor gets a chunk of its own); floating tensors are cast to `dtype` if given.

    Tensors sharing storage (tied embeddings, views of a fused parameter) are cloned, since
    safetensors refuses to serialise shared memory.
    """
    from safetensors.torch import save

    chunk: dict[str, torch.Tensor] = {}
    size, storages = 0, set()
    for name, tensor in weights.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield save(chunk)
            chunk, size, storages = {}, 0, set()
        storage = t.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != nbytes:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        chunk[name] = t
        size += nbytes
    if chunk:
        yield save(chunk)


def pid_alive(pid: int) -> bool:
    """True if `pid` runs and is not a zombie (a killed worker its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class VLLMEngine(GenerationEngine):
    """Serves a HF model directory with `vllm.LLM`; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        kv_cache_space_gb: int = 1,
        seed: int = 0,
        sync_chunk_bytes: int = DEFAULT_SYNC_CHUNK_BYTES,
        shutdown_timeout_s: float = 30.0,
        **llm_kwargs,
    ):
        """Defaults are chosen per platform:
        - `dtype`: "float32" on CPU (exact log-probs; tiny models gain nothing from bf16),
          vLLM's "auto" (the checkpoint's dtype) on GPU.
        - `max_model_len`: None lets vLLM take the model's maximum.
        - `gpu_memory_utilization`: None keeps vLLM's default; ignored on CPU.
        - `enforce_eager`: None means True on CPU (torch.compile costs ~40 s at start and pays
          back only for big models), False (CUDA graphs) on GPU.
        - `kv_cache_space_gb`: CPU KV-cache size, exported as VLLM_CPU_KVCACHE_SPACE unless
          that is already set.
        - `sync_chunk_bytes`: most tensor bytes per weight-sync RPC.
        - `shutdown_timeout_s`: how long `shutdown()` lets the engine core tear down before
          killing it (vLLM's own default, 5 s, is too short on a busy CPU and leaks its
          shared memory; a clean exit takes ~7 s there).
        Other keyword arguments go to `vllm.LLM` unchanged.
        """
        from vllm import LLM
        from vllm.platforms import current_platform

        super().__init__()
        if sync_chunk_bytes < 1:
            raise ValueError(f"`sync_chunk_bytes` ({sync_chunk_bytes}) must be >= 1")
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gb)))
        elif gpu_memory_utilization is not None:
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.sync_chunk_bytes = sync_chunk_bytes
        self.shutdown_timeout_s = shutdown_timeout_s
        self.last_sync_stats: dict[str, float] = {}
        self._dead_reason: str | None = None

        started = time.perf_counter()
        self.llm = LLM(
            model=model_path,
            dtype=dtype or ("float32" if on_cpu else "auto"),
            max_model_len=max_model_len,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            **llm_kwargs,
        )
        self.startup_seconds = time.perf_counter() - started
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype
        self._core_processes = list(self._engine_manager_processes())
        self.worker_pids: list[int] = self.llm.collective_rpc("m2po_pid")

    # --- generation -----------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingConfig, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            # vLLM refuses n > 1 when greedy; the n samples would be identical anyway, so
            # one is generated and copied (`_completions`).
            n=1 if sampling.temperature == 0 else sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
        )

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        self._check_alive()
        if not prompt_token_ids:
            return []
        if sampling.seed is None:
            params = self._sampling_params(sampling, None)
        else:
            # vLLM seeds child j of a request seeded s with s + j, so s = seed + i * n gives
            # sample j of prompt i the seed `SamplingConfig.request_seed(i, j)`.
            params = [
                self._sampling_params(sampling, sampling.request_seed(i, 0))
                for i in range(len(prompt_token_ids))
            ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self._call(self.llm.generate, prompts, params, use_tqdm=False)
        return [self._completions(out, sampling.n) for out in outputs]

    @staticmethod
    def _completions(request_output, n: int) -> list[Completion]:
        samples = sorted(request_output.outputs, key=lambda c: c.index)
        if len(samples) == 1 < n:  # greedy
            samples = samples * n
        if len(samples) != n:
            raise RuntimeError(
                f"vLLM returned {len(samples)} samples for request "
                f"{request_output.request_id}; asked for {n}"
            )
        completions = []
        for c in samples:
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM ended request {request_output.request_id} with finish_reason "
                    f"{c.finish_reason!r}"
                )
            token_ids = list(c.token_ids)
            logprobs = [step[t].logprob for step, t in zip(c.logprobs, token_ids)]
            completions.append(Completion(token_ids, logprobs, c.text, c.finish_reason))
        return completions

    # --- weights --------------------------------------------------------------------------

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._check_alive()
        started = time.perf_counter()
        num_chunks = num_bytes = 0
        self._call(self.llm.collective_rpc, "m2po_start_weight_sync")
        try:
            for payload in serialize_weight_chunks(weights, self.sync_chunk_bytes, self.dtype):
                self._call(self.llm.collective_rpc, "m2po_load_weight_chunk", args=(payload,))
                num_chunks += 1
                num_bytes += len(payload)
        finally:
            if self.is_healthy():
                self._call(self.llm.collective_rpc, "m2po_finish_weight_sync")
        self._call(self.llm.reset_prefix_cache)
        self.last_sync_stats = {
            "seconds": time.perf_counter() - started,
            "bytes": num_bytes,
            "chunks": num_chunks,
        }

    # --- lifecycle ------------------------------------------------------------------------

    def _engine_manager_processes(self):
        """The engine-core processes (multiprocessing.Process), if vLLM runs them out of
        process (VLLM_ENABLE_V1_MULTIPROCESSING=1, the default)."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return getattr(manager, "processes", None) or []

    def _find_death(self) -> str | None:
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        if getattr(resources, "engine_dead", False):
            return "vLLM flagged its engine core dead"
        for proc in self._core_processes:
            if not proc.is_alive():
                return f"engine-core process {proc.pid} exited with code {proc.exitcode}"
        for pid in self.worker_pids:
            if pid != os.getpid() and not pid_alive(pid):
                return f"worker process {pid} is gone"
        return None

    def is_healthy(self) -> bool:
        if self.llm is None or self._dead_reason is not None:
            return False
        self._dead_reason = self._find_death()
        return self._dead_reason is None

    def _check_alive(self) -> None:
        if self.llm is None:
            raise EngineDeadError("VLLMEngine was shut down; build a new engine")
        if not self.is_healthy():
            raise EngineDeadError(
                f"vLLM engine is dead ({self._dead_reason}); shut it down and build a new one"
            )

    def _call(self, fn, *args, **kwargs):
        """Runs a vLLM call, turning a failure of a dead engine into `EngineDeadError`."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if isinstance(e, VLLMEngineDeadError) or not self.is_healthy():
                self._dead_reason = self._dead_reason or f"{type(e).__name__}: {e}"
                raise EngineDeadError(
                    f"vLLM engine died ({self._dead_reason}); shut it down and build a new one"
                ) from e
            raise

    def shutdown(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        try:
            llm.llm_engine.engine_core.shutdown(timeout=self.shutdown_timeout_s)
        except Exception:  # a dead engine may fail to say goodbye; its processes still go
            logger.warning("vLLM engine shutdown raised", exc_info=True)
        del llm
        gc.collect()
