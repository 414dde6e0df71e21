"""`VLLMEngine`: a `vllm.LLM` behind `GenerationEngine`, with versioned in-place weight syncs.

Log-probs: the LLM runs with `logprobs_mode="processed_logprobs"`, so the log-prob vLLM returns
for a sampled token is taken after temperature scaling and top-k / top-p masking, i.e. of the
distribution it was sampled from; greedy requests get the raw log-softmax (vLLM's
`Sampler.sample`). Plain vLLM would return raw-logit log-probs whatever the temperature.

Weight sync: `m2po_rllib/sync/transports.py` holds both paths behind `WeightTransport`. A Mapping of
tensors goes the object-store path (`ObjectStoreTransport`: safetensors chunks of at most
`sync_chunk_bytes` through `collective_rpc`); a `BroadcastWeights` notice goes vLLM's native
weight-transfer path (`NativeTransport`, after `join_weight_group`: "nccl" on CUDA, "gloo"
anywhere), set up at start only when asked for (`weight_transport` "nccl", "gloo", or "auto"
on CUDA). Training turns it on with `env_runners(weight_sync="native")`: the learners' sender
(`sync/sender.py`) broadcasts after each update; the engine's own default is "object_store".
The prefix cache is reset after either, since its KV entries were
computed by the old weights; versions stay with `GenerationEngine`. A load with streamed
groups in flight (`update_weights(..., mid_sequence=True)`) happens between two of our engine
steps: the running requests are then preempted (`reset_prefix_cache(reset_running_requests=
True)`), so vLLM recomputes their KV from the prompt and the tokens so far with the new
weights when they resume, and the tokens sampled from then on carry the new version's label.

Streaming (`submit` / `step`, `vllm_stream.py`): vLLM's own continuous batching, one request
per group, stepped by the runner; the groups in flight are handed over as far as they got
(`partials()`, read from vLLM's output processor) and continued (`submit(..., resume=...)`),
each continued sample with a random stream of its own.

Health: `is_healthy()` is False once vLLM flagged its engine core dead, or the engine-core
process or a worker process (pids recorded at start) is gone or a zombie; `generate` then
raises `EngineDeadError` instead of hanging on a dead socket.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Mapping

import torch

from m2po_rllib.common.log_filters import quiet_vllm_logging
from m2po_rllib.rollout.engine import Completion, EngineDeadError, GenerationEngine, SamplingConfig
from m2po_rllib.rollout.vllm_cpu import core_placement, cpu_llm_kwargs, runs_inline
from m2po_rllib.rollout.vllm_health import engine_core_processes, find_death
from m2po_rllib.rollout.vllm_outputs import check_versions, completions
from m2po_rllib.rollout.vllm_stream import VLLMStream
from m2po_rllib.sync.vllm_worker import WeightSyncExtension
from m2po_rllib.sync.transports import (  # noqa: F401  (serialize_weight_chunks: re-exported)
    DEFAULT_SYNC_CHUNK_BYTES,
    TRANSPORTS,
    BroadcastWeights,
    NativeTransport,
    ObjectStoreTransport,
    serialize_weight_chunks,
)

logger = logging.getLogger(__name__)


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
        weight_transport: str = "object_store",
        shutdown_timeout_s: float = 30.0,
        num_threads: int | None = None,
        sleep_mode: bool = False,
        head_dtype: str | None = None,
        core: str | None = None,
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
          that is already set. On CPU every prompt is prefilled whole (vllm_cpu.py says why).
        - `sync_chunk_bytes`: most tensor bytes per weight-sync RPC (object-store path).
        - `weight_transport`: "object_store" (default: the path training uses) sets up no
          native receive path; "auto" enables the NCCL one on CUDA, "nccl" requires CUDA,
          "gloo" works anywhere (no learner-side sender is wired into training yet).
        - `shutdown_timeout_s`: how long `shutdown()` lets the engine core tear down before
          killing it (vLLM's own default, 5 s, is too short on a busy CPU and leaks its
          shared memory; a clean exit takes ~7 s there).
        - `num_threads`: CPU only: the worker's OpenMP threads, unbound (the EnvRunner passes
          its CPU allocation; vLLM's own "auto" binding would pin threads to cores that other
          processes of the job use). None keeps vLLM's binding.
        - `sleep_mode`: build vLLM with its sleep mode (`enable_sleep_mode`), so that `sleep()`
          offloads the weights to CPU and frees the KV cache (level 1) while a colocated
          learner updates. Where vLLM has none (CPU), `sleep()` does nothing and
          `sleep_unavailable` says so.
        - `head_dtype`: "float32" computes the LM head in fp32 (vLLM's `hf_overrides`
          `head_dtype`: the bf16 hidden states and weights cast up, fp32 logits), the learner's
          rule with the same setting; None: the model's dtype.
        - `core`: where vLLM's engine core and its worker run: "process" (processes of their
          own), "inline" (this process, which they then take over: for a process that is the
          engine's own, such as a runner actor), "auto" (inline on CPU, where it starts ~2.5x
          faster); None leaves it to vLLM's environment (a process unless
          VLLM_ENABLE_V1_MULTIPROCESSING=0). vllm_cpu.py says what inline costs.
        Other keyword arguments go to `vllm.LLM` unchanged. vLLM logs warnings only, less
        the advisories of `log_filters.VLLM_ADVISORIES`, unless they set its logging
        (`log_level="INFO"`) or the environment does (VLLM_LOGGING_LEVEL).
        """
        from vllm import LLM
        from vllm.platforms import current_platform
        from vllm.v1.engine.core_client import InprocClient

        super().__init__()
        self.object_store = ObjectStoreTransport(sync_chunk_bytes)
        on_cpu = current_platform.is_cpu()
        if weight_transport not in TRANSPORTS:
            raise ValueError(f"`weight_transport` ({weight_transport!r}) must be one of {TRANSPORTS}")
        on_cuda = current_platform.is_cuda()
        if weight_transport == "nccl" and not on_cuda:
            raise ValueError(
                f"`weight_transport='nccl'` needs vLLM on CUDA (platform: {current_platform.device_type}); "
                "use 'auto' or 'object_store'"
            )
        native = {"auto": "nccl" if on_cuda else None, "object_store": None}.get(weight_transport, weight_transport)
        self.native = NativeTransport(native) if native else None
        extension = f"{WeightSyncExtension.__module__}.WeightSyncExtension"
        if self.native is not None:
            llm_kwargs = {**self.native.llm_kwargs, **llm_kwargs}
            extension = llm_kwargs.pop("worker_extension_cls", extension)
        if on_cpu:
            llm_kwargs = cpu_llm_kwargs(llm_kwargs, kv_cache_space_gb=kv_cache_space_gb, num_threads=num_threads)
        elif gpu_memory_utilization is not None:
            llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.sleep_unavailable = (
            "built without sleep_mode" if not sleep_mode
            else None if current_platform.is_sleep_mode_available()
            else f"vLLM has no sleep mode on {current_platform.device_type} (CUDA, ROCm and XPU have one)"
        )
        if self.sleep_unavailable is None:
            llm_kwargs.setdefault("enable_sleep_mode", True)
        if head_dtype is not None:
            llm_kwargs["hf_overrides"] = {**(llm_kwargs.get("hf_overrides") or {}), "head_dtype": head_dtype}
        self._asleep = False
        self._stream = VLLMStream(self)  # the streamed groups (vllm_stream.py)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.last_sync_stats: dict = {}
        self._dead_reason: str | None = None

        # Warnings only (log_filters), and no checkpoint-loading bar: the job prints its own progress.
        llm_kwargs = quiet_vllm_logging({"use_tqdm_on_load": False, **llm_kwargs})
        placement = core_placement(runs_inline(core, on_cpu)) if core is not None else contextlib.nullcontext()
        started = time.perf_counter()
        with placement:
            self.llm = LLM(
                model=model_path,
                dtype=dtype or ("float32" if on_cpu else "auto"),
                max_model_len=max_model_len,
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                seed=seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=extension,
                **llm_kwargs,
            )
        self.startup_seconds = time.perf_counter() - started
        self.model_path = model_path
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype
        self._core_processes = engine_core_processes(self.llm)
        # an inline core steps only when this process calls it (`step`, `generate`)
        self.core_inline = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        self.worker_pids: list[int] = self.llm.collective_rpc("m2po_pid")
        self._label_weight_version()

    # --- generation -----------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingConfig, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            # vLLM refuses n > 1 when greedy; the n samples would be identical anyway, so
            # one is generated and copied (`vllm_outputs.completions`).
            n=1 if sampling.temperature == 0 else sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
        )

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        self._check_alive()
        self.wake_up()  # a sleeping engine serves nothing (colocated: woken after the update)
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
        self._check_idle("generate a batch")  # vLLM would run (and return) the streamed requests too
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self._call(self.llm.generate, prompts, params, use_tqdm=False)
        groups = [completions(out, sampling.n) for out in outputs]
        for group in groups:
            check_versions(group, self._version, "a round")
        return groups

    # --- streaming: vLLM's own continuous batching (vllm_stream.py) -------------------------

    resumes_partial = True

    def submit(self, key, prompt_token_ids: list[int], sampling: SamplingConfig, index: int = 0,
               resume=None) -> None:
        self._check_alive()
        self.wake_up()
        self._stream.submit(key, prompt_token_ids, sampling, index, resume)

    def partials(self):
        return self._stream.partials()

    def step(self) -> list[tuple[object, list[Completion]]]:
        if not self._stream.in_flight:
            return []
        self._check_alive()
        return self._stream.step()

    @property
    def in_flight(self) -> int:
        return self._stream.in_flight

    # --- sleep (colocated training) ---------------------------------------------------------

    def sleep(self) -> bool:
        """vLLM's sleep, level 1: weights offloaded to CPU, KV cache (and prefix cache) freed."""
        if self.sleep_unavailable is not None:
            return False
        self._check_alive()
        self._check_idle("sleep")
        if not self._asleep:
            self._call(self.llm.sleep, level=1)
            self._asleep = True
        return True

    def wake_up(self) -> None:
        if self._asleep:
            self._call(self.llm.wake_up)
            self._asleep = False

    # --- weights --------------------------------------------------------------------------

    @property
    def sync_chunk_bytes(self) -> int:
        return self.object_store.chunk_bytes

    @sync_chunk_bytes.setter
    def sync_chunk_bytes(self, value: int) -> None:
        self.object_store = ObjectStoreTransport(value)

    def rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """`collective_rpc` into every vLLM worker (what the transports call)."""
        return self._call(self.llm.collective_rpc, method, args=args, kwargs=kwargs)

    def join_weight_group(self, init_info: dict) -> None:
        """Joins the learner's weight-transfer group (`NativeWeightSender.connect`)."""
        self._check_alive()
        if self.native is None:
            raise RuntimeError(
                "this VLLMEngine has no native weight path: build it with weight_transport "
                "'gloo', or 'nccl' / 'auto' on CUDA"
            )
        self.native.join(self, init_info)

    loads_mid_sequence = True

    def update_weights(self, weights: Mapping[str, torch.Tensor] | BroadcastWeights, version: int, *,
                       mid_sequence: bool = False) -> bool:
        """As `GenerationEngine.update_weights`, except that a native sync is always received:
        the learner is broadcasting it, and a rank that stayed out would hang the collective.
        The version then only moves forward (an engine that got a newer version another
        way, e.g. a checkpoint restore, keeps it). With groups in flight (`mid_sequence`) an
        engine core in a process of its own, which steps its requests on its own, is paused
        around the load (vLLM's `pause_scheduler(mode="keep")`: no forward pass meets
        half-loaded weights), and the new label is set before it resumes; an inline core steps
        only when the runner's generating thread calls it, which is parked meanwhile."""
        paused = bool(mid_sequence and self.in_flight and not self.core_inline)
        if paused:
            self._call(self.llm.llm_engine.engine_core.call_utility, "pause_scheduler", "keep", False)
        try:
            loaded = super().update_weights(weights, version, mid_sequence=mid_sequence,
                                            always=isinstance(weights, BroadcastWeights))
            if loaded:
                self._label_weight_version()
        finally:
            if paused:
                self._call(self.llm.llm_engine.engine_core.call_utility, "resume_scheduler")
        return loaded

    def _label_weight_version(self) -> None:
        """vLLM labels every token it samples from now on with this version (its per-token
        `weight_versions`), which `generate` checks against the version the rows are tagged with."""
        self._call(self.llm.llm_engine.set_weight_version, str(self._version))

    def _load_weights(self, weights: Mapping[str, torch.Tensor] | BroadcastWeights) -> None:
        self._check_alive()
        self.wake_up()  # the weights load into the woken model (level 1 kept the old ones on CPU)
        native = isinstance(weights, BroadcastWeights)
        transport = self.native if native else self.object_store
        if transport is None:
            raise RuntimeError("a native weight sync reached a VLLMEngine without the native path")
        if native and not weights.names:  # a delta round in which nothing changed: only the version moves
            self.last_sync_stats = {"seconds": 0.0, "bytes": 0, "tensors": 0, "transport": transport.name}
            return
        try:
            stats = transport.load(self, weights, self.dtype)
        except Exception as e:
            if not native:
                raise
            # The worker's layerwise reload did not finish: layers may be left unloaded.
            self._dead_reason = f"a {transport.name} weight sync failed part way ({type(e).__name__}: {e})"
            raise EngineDeadError(f"vLLM engine unusable: {self._dead_reason}; build a new one") from e
        self._call(self.llm.reset_prefix_cache)
        self.last_sync_stats = {**stats, "transport": transport.name}

    def _continue_after_load(self) -> None:
        """(paused) The running requests preempted: vLLM recomputes their KV with the new weights."""
        if not self._call(self.llm.llm_engine.reset_prefix_cache, reset_running_requests=True):
            raise RuntimeError("vLLM could not reset the KV cache of the requests in flight after a weight load")

    # --- lifecycle ------------------------------------------------------------------------

    def is_healthy(self) -> bool:
        if self.llm is None or self._dead_reason is not None:
            return False
        self._dead_reason = find_death(self.llm, self._core_processes, self.worker_pids)
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
