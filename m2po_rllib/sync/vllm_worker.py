"""Code that runs inside each vLLM worker process: `WeightSyncExtension`, mixed into the
worker (`LLM(worker_extension_cls=...)`), whose methods `LLM.collective_rpc` calls there
(the object-store weight path of `transports.py`). Of this package it imports only
`log_filters`, so the worker loads it without the learner's modules."""

from __future__ import annotations


class WeightSyncExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); its methods run in the worker
    process through `LLM.collective_rpc`. Prefixed names keep clear of the worker's own."""

    def m2po_pid(self) -> int:
        import os

        return os.getpid()

    def m2po_start_weight_sync(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from m2po_rllib.common.log_filters import quiet_vllm_rotary_reload

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
