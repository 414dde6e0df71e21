"""`m2po plan`: a dry run of a config for a cluster, without loading any weights.

Validates the config (the same `validate()` that `m2po train` runs), prints the resources
RLlib will ask Ray for (`M2PO.default_resource_request`), the model's parameter count from
its config.json alone (built on the meta device), and the estimated peak memory of each
learner with the chosen micro-batch, under DDP (a full replica per learner) and under FSDP
(states sharded over the learners), against a device of `--gpu-memory-gb`, and the GPUs the
config asks for against the node's (`--gpus`, default this machine's).

Hub names resolve to the hub's config.json when reachable (or cached), else to the copy
shipped in m2po_rllib/assets/model_configs/ (written from the public architecture numbers).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from m2po_rllib.common.errors import ConfigError

GiB = 2**30
SHIPPED_CONFIGS = Path(__file__).parents[1] / "assets" / "model_configs"
DEFAULT_PROMPT_LEN = 1024  # when engine_kwargs.max_model_len does not bound the prompt
HEADROOM = 0.9  # of device memory usable by tensors (CUDA context, allocator fragmentation, NCCL)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    source: str  # where config.json came from
    model_type: str
    num_params: int
    embedding_params: int  # input embedding + an untied output head
    layer_params: int  # one decoder layer
    hidden: int
    intermediate: int
    kv_dim: int  # key/value width: num_key_value_heads x head_dim
    layers: int
    vocab: int
    tied: bool
    max_positions: int


def resolve_model_config(name: str):
    """(transformers config, where it came from) for a directory, builtin or hub name."""
    from transformers import AutoConfig

    from m2po_rllib.models.builtin import resolve_model_path

    if name.startswith("builtin:") or os.path.isdir(name):
        path = resolve_model_path(name)
        return AutoConfig.from_pretrained(path), f"{path}/config.json"
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), "the local Hugging Face cache"
    except (OSError, ValueError):
        pass
    online = _hub_reachable()
    if online:
        try:
            return AutoConfig.from_pretrained(name), "the Hugging Face hub"
        except (OSError, ValueError):
            pass
    shipped = SHIPPED_CONFIGS / name
    if (shipped / "config.json").exists():
        why = "the hub has no such model" if online else (
            "offline: HF_HUB_OFFLINE is set" if _offline_env() else "offline: the hub is not reachable"
        )
        where = shipped.relative_to(SHIPPED_CONFIGS.parents[2])
        return AutoConfig.from_pretrained(shipped), f"the shipped copy {where}/config.json ({why})"
    raise ConfigError(
        f"no config.json for model {name!r}: not a directory, not in the HF cache, "
        f"{'not on the hub' if online else 'the hub is not reachable'}, and no shipped copy under "
        f"{SHIPPED_CONFIGS}; pass a local model directory"
    )


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connect to the hub (transformers' own retries take ~1 min to give up)."""
    if _offline_env():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def model_shape(name: str) -> ModelShape:
    """Parameter counts (of the model built on the meta device: no memory) and the sizes
    the memory estimate needs."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = resolve_model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    embedding = sum(p.numel() for p in {model.get_input_embeddings().weight, model.get_output_embeddings().weight})
    layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        name=name, source=source, model_type=config.model_type, num_params=total, embedding_params=embedding,
        layer_params=layer, hidden=config.hidden_size, intermediate=config.intermediate_size,
        kv_dim=getattr(config, "num_key_value_heads", heads) * head_dim, layers=config.num_hidden_layers,
        vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=getattr(config, "max_position_embeddings", 0),
    )


def estimate_learner_memory(
    m: ModelShape, *, dtype_bytes: int, micro_batch_size: int, seq_len: int, chunk_size: int,
    gradient_checkpointing: bool, num_learners: int, ddp_bucket_copy: bool = True,
) -> dict[str, dict[str, float]]:
    """Peak bytes per learner, by component, for "ddp" and "fsdp". An upper estimate: the
    components are added although some peak at different moments.

    b = dtype_bytes (the compute dtype), P = parameters, T = micro_batch_size x seq_len
    tokens, H, I, kv, V, L as in `ModelShape`:
      float32 master weights 4 P, float32 gradients 4 P, AdamW moments 8 P (the learner
        keeps all three in float32 whatever the compute dtype: `HFCausalLMModule`);
      DDP: + 4 P gradient buckets (DDP copies gradients unless gradient_as_bucket_view);
      FSDP over n learners: (weights + gradients + moments) / n, plus the unsharded working
        set 2 b (2 layer_params + embedding_params) (a layer and its prefetched successor,
        the embedding/head, and their unsharded gradients);
      activations of one decoder layer per token, HF Llama/Qwen layer with SDPA (no T x T):
        a = b (6H + 2kv + 4I) + 8H  (attention 3H + 2kv, MLP H + 4I, two RMSNorms saving a
        float32 input 4H and a normalised copy bH each);
        with gradient checkpointing T (L b H + a) (each layer's input, one layer recomputed),
        without T L a; plus T H (4 + 3b) (embedding output, final norm, response hidden);
      chunked log-probs: 3 x chunk x V x 4 (float32 logits chunk and its temporaries) and the
        head's float32 gradient accumulator 4 V H (+ b V H product when b != 4).
    """
    b, P, T = dtype_bytes, m.num_params, micro_batch_size * seq_len
    H, I, kv, V, L = m.hidden, m.intermediate, m.kv_dim, m.vocab, m.layers
    per_layer = b * (6 * H + 2 * kv + 4 * I) + 8 * H
    layers = T * (L * b * H + per_layer) if gradient_checkpointing else T * L * per_layer
    activations = layers + T * H * (4 + 3 * b)
    logp = 3 * chunk_size * V * 4 + 4 * V * H + (b * V * H if b != 4 else 0)
    states = {"weights (fp32 master)": 4 * P, "gradients (fp32)": 4 * P, "AdamW moments (fp32)": 8 * P}
    n = max(1, num_learners)
    common = {"activations (one micro-batch)": activations, "chunked log-probs + head grad": logp}
    ddp = {**states, "DDP gradient buckets": 4 * P if ddp_bucket_copy else 0, **common}
    fsdp = {k: v / n for k, v in states.items()}
    fsdp["FSDP unsharded working set"] = 2 * b * (2 * m.layer_params + m.embedding_params)
    fsdp.update(common)
    return {"ddp": ddp, "fsdp": fsdp}


def _count(n: int) -> str:
    """1.72 B, 0.80 M, 950 K: a parameter count in the unit that shows it."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def largest_micro_batch(parts_for, limit: float, sequences: int) -> int:
    """Largest micro_batch_size dividing `sequences` (equal micro-batches) whose total
    fits `limit` bytes; 0 if none does."""
    fitting = [m for m in range(1, sequences + 1) if sequences % m == 0 and sum(parts_for(m).values()) <= limit]
    return max(fitting, default=0)


def plan(config_path: str, gpu_memory_gb: float = 80.0, overrides=None, prompt_len: int | None = None,
         gpus: int | None = None) -> dict:
    """Everything `m2po plan` prints, as data. `gpus`: the GPUs of the node or cluster planned
    for (None: this machine's)."""
    from m2po_rllib.config.algorithm_config import M2POConfig
    from m2po_rllib.driver.m2po import M2PO

    config = M2POConfig.from_yaml(config_path, overrides=overrides)
    bundles = M2PO.default_resource_request(config).bundles  # validates the config
    runners, learners = config.num_env_runners, config.num_learners
    groups = {"main process": bundles[:1], "EnvRunners": bundles[1 : 1 + runners]}
    groups["evaluation EnvRunners"] = bundles[1 + runners : len(bundles) - learners]
    groups["learners"] = bundles[len(bundles) - learners :] if learners else []

    model_config = dict(config.model_config or {})
    dtype = model_config["dtype"]
    shape = model_shape(model_config["model"])
    per_learner = config.minibatch_size_per_learner
    micro = config.micro_batch_size or per_learner
    chunk = config.logp_chunk_size
    if not (isinstance(micro, int) and 1 <= micro <= per_learner):
        raise ConfigError(
            f"`micro_batch_size` ({micro}) must be an int in [1, {per_learner}] (the sequences of one "
            "learner's minibatch: minibatch_prompts x group_size / num_learners)"
        )
    max_model_len = (config.engine_kwargs or {}).get("max_model_len")
    if prompt_len is None and max_model_len:
        prompt_len = max_model_len - config.max_new_tokens
    elif prompt_len is None:
        # vLLM's bound without max_model_len: the model's own positions (the built-in model's 128)
        prompt_len = min(DEFAULT_PROMPT_LEN, (shape.max_positions or 10**9) - config.max_new_tokens)
    seq_len = prompt_len + config.max_new_tokens
    ddp_kwargs = getattr(config, "torch_ddp_kwargs", None) or {}

    def parts_for(micro_batch: int):
        return estimate_learner_memory(
            shape, dtype_bytes=_DTYPE_BYTES[dtype], micro_batch_size=micro_batch, seq_len=seq_len,
            chunk_size=chunk, gradient_checkpointing=bool(model_config.get("gradient_checkpointing")),
            # RLlib wraps the module in DDP only with several learners
            num_learners=learners, ddp_bucket_copy=learners > 1 and not ddp_kwargs.get("gradient_as_bucket_view", False),
        )

    gpus_needed = sum(b.get("GPU", 0) for b in bundles)
    if gpus is None:
        from m2po_rllib.driver.resources import visible_gpus

        gpus, gpus_from = visible_gpus(), "this machine"
    else:
        gpus_from = "the node planned for (--gpus)"
    limit = HEADROOM * gpu_memory_gb * GiB
    memory = parts_for(micro)
    fits = {mode: sum(parts.values()) <= limit for mode, parts in memory.items()}
    best = {mode: largest_micro_batch(lambda m, mode=mode: parts_for(m)[mode], limit, per_learner) for mode in memory}
    engine_kwargs = dict(config.engine_kwargs or {})
    engine_dtype = engine_kwargs.get("dtype", dtype)
    colocated = None
    if config.colocate:
        from m2po_rllib.rollout.engine_host import COLOCATED_GPU_MEMORY_UTILIZATION

        util = float(engine_kwargs.get("gpu_memory_utilization", COLOCATED_GPU_MEMORY_UTILIZATION))
        colocated = colocated_memory(shape, memory["ddp"], util=util, device=gpu_memory_gb * GiB, limit=limit,
                                     engine_dtype_bytes=_DTYPE_BYTES.get(engine_dtype, 2), seq_len=seq_len)
    return {
        "config": config_path, "groups": groups, "bundles": bundles, "dtype": dtype, "model": shape,
        "micro_batch_size": micro, "per_learner_sequences": per_learner, "logp_chunk_size": chunk,
        "prompt_len": prompt_len, "seq_len": seq_len, "gradient_checkpointing": bool(model_config.get("gradient_checkpointing")),
        "num_learners": learners, "sharding": config.learner_sharding, "gpu_memory_gb": gpu_memory_gb, "memory": memory, "fits": fits,
        "largest_micro_batch": best, "engine_gpu_memory_utilization": (config.engine_kwargs or {}).get("gpu_memory_utilization"),
        "rollout_engine": config.resolved_rollout_engine() if config.rollout_engine != "auto" else "auto",
        "engine_dtype": (config.engine_kwargs or {}).get("dtype", dtype), "minibatch_sequences": config.minibatch_prompts * config.group_size,
        "gpus_needed": gpus_needed, "gpus": gpus, "gpus_from": gpus_from, "colocated": colocated,
    }


LEARNER_STATES = ("weights (fp32 master)", "gradients (fp32)", "AdamW moments (fp32)")


def colocated_memory(m: ModelShape, learner: dict[str, float], *, util: float, device: float, limit: float,
                     engine_dtype_bytes: int, seq_len: int) -> dict[str, float | bool]:
    """One GPU holding the learner and a vLLM engine that sleeps during updates
    (`colocate=True`): the two phases' bytes against `limit`.

    rollouts: the learner's states stay (fp32 weights, gradients, AdamW moments: 16 P) and
      vLLM takes `util` x device (its weights in the served dtype, the rest KV cache:
      2 L kv b bytes a token);
    updates: the learner's peak (`learner`, the estimate above); the engine asleep holds no
      weights or KV cache (its CUDA context, ~0.5 GiB, is inside the headroom)."""
    states = sum(learner[k] for k in LEARNER_STATES)
    engine = util * device
    engine_weights = m.num_params * engine_dtype_bytes
    kv_per_token = 2 * m.layers * m.kv_dim * engine_dtype_bytes
    kv_tokens = max(0.0, engine - engine_weights) / kv_per_token
    rollouts, updates = states + engine, sum(learner.values())
    return {
        "utilization": util, "learner_states": states, "engine": engine, "engine_weights": engine_weights,
        "kv_per_token": kv_per_token, "kv_tokens": kv_tokens, "kv_sequences": kv_tokens / seq_len, "rollouts": rollouts, "updates": updates,
        "fits": rollouts <= limit and updates <= limit and kv_tokens >= seq_len,
        "max_utilization": max(0.0, (limit - states) / device),
    }


def _resources(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def recommendation(p: dict) -> str:
    c = p.get("colocated")
    if c and p["fits"][p["sharding"]] and not c["fits"]:  # the update fits: the engine's share is the problem
        if c["max_utilization"] * p["gpu_memory_gb"] * GiB < c["engine_weights"] + p["seq_len"] * c["kv_per_token"]:
            return ("the learner's states leave the engine no room for its weights and one sequence's KV cache: "
                    "use a larger GPU, or colocate=False with the engine on a GPU of its own")
        return (f"set env_runners.engine_kwargs.gpu_memory_utilization={c['max_utilization'] - 0.005:.2f} (or lower): "
                "the learner's states stay on the GPU while vLLM serves")
    micro, best, n, mode = p["micro_batch_size"], p["largest_micro_batch"], max(1, p["num_learners"]), p["sharding"]
    if p["fits"][mode]:
        over = f" over {n} learners" if mode == "fsdp" else ""
        beside = f", vLLM at gpu_memory_utilization {c['utilization']:g} beside it" if c else ""
        return f"fits as configured ({mode.upper()}{over}, micro_batch_size={micro}{beside})"
    if best[mode]:
        lower = " (or lower)" if best[mode] > 1 else ""
        return f"set training.micro_batch_size={best[mode]}{lower}; {mode.upper()} then fits"
    if mode == "ddp" and best["fsdp"] and n > 1:
        also = f" and training.micro_batch_size={best['fsdp']}" if best["fsdp"] < micro else ""
        return (
            f"a full replica does not fit even at micro_batch_size=1: set training.learner_sharding=fsdp{also} "
            f"(weights, gradients and AdamW moments sharded over the {n} learners)"
        )
    tip = "" if p["gradient_checkpointing"] else "enable gradient_checkpointing, "
    return f"does not fit even with FSDP at micro_batch_size=1: {tip}add learners, or use a larger device"


def gpu_fit(p: dict) -> str:
    """The GPUs the config asks for against those planned for (`--gpus`, or this machine's),
    with the settings that change the count when they are short."""
    need, have, where = p["gpus_needed"], p["gpus"], p["gpus_from"]
    if need <= have + 1e-9:
        return f"  GPUs: {need:g} needed, {have} on {where}: enough"
    fix = ("num_gpus_per_env_runner / num_gpus_per_learner (0 runs on CPU; a fraction shares a GPU), "
           "num_env_runners / num_learners")
    return (f"  warning: the config needs {need:g} GPUs and {where} has {have}: Ray would never place it there. "
            f"Lower {fix}, or plan for the node it will run on (--gpus N)")


def format_plan(p: dict) -> str:
    m: ModelShape = p["model"]
    lines = [f"m2po plan: {p['config']} (config valid)", "Ray resources (M2PO.default_resource_request):"]
    for name, bundles in p["groups"].items():
        if bundles:
            lines.append(f"  {name:<22} {len(bundles):>3} x {_resources(bundles[0])}")
    total_cpu = sum(b.get("CPU", 0) for b in p["bundles"])
    runner_gpus = sum(b.get("GPU", 0) for b in p["groups"]["EnvRunners"] + p["groups"]["evaluation EnvRunners"])
    learner_gpus = sum(b.get("GPU", 0) for b in p["groups"]["learners"] + p["groups"]["main process"])
    main_cpus = sum(b.get("CPU", 0) for b in p["groups"]["main process"])
    actor_cpus = total_cpu - main_cpus
    lines.append(f"  total: {total_cpu:g} CPUs ({actor_cpus:g} for the actors + {main_cpus:g} for the main process), "
                 f"{runner_gpus + learner_gpus:g} GPUs ({runner_gpus:g} EnvRunner GPUs + {learner_gpus:g} learner GPUs)")
    here = os.cpu_count() or 1
    if not os.environ.get("RAY_ADDRESS") and actor_cpus > here:
        lines.append(
            f"  warning: the actors need {actor_cpus:g} CPUs (the main process {main_cpus:g} more) and this machine "
            f"has {here}: a local run fails at build (Ray would queue them forever); lower num_cpus_per_env_runner / "
            "num_env_runners / num_learners, or run it on a cluster (RAY_ADDRESS)"
        )
    lines.append(gpu_fit(p))
    lines += [
        f"Model {m.name} ({m.model_type}): {_count(m.num_params)} parameters, {_count(m.num_params - m.embedding_params)} "
        f"without embeddings ({'tied' if m.tied else 'untied'} head); {m.layers} layers, hidden {m.hidden}, vocab {m.vocab}",
        f"  config.json from {m.source}",
        f"Learner: minibatch {p['minibatch_sequences']} sequences = {p['per_learner_sequences']} per learner x {max(1, p['num_learners'])}; "
        f"micro_batch_size {p['micro_batch_size']}; sequences up to {p['seq_len']} tokens (prompt {p['prompt_len']} + response "
        f"{p['seq_len'] - p['prompt_len']}); logp_chunk_size {p['logp_chunk_size']}; {p['dtype']}; gradient checkpointing "
        f"{'on' if p['gradient_checkpointing'] else 'off'}",
    ]
    if m.max_positions and p["seq_len"] > m.max_positions:
        lines.append(f"  warning: sequences of {p['seq_len']} tokens exceed the model's max_position_embeddings ({m.max_positions})")
    n = max(1, p["num_learners"])
    lines.append("Estimated peak memory per learner (GiB; an upper estimate, see m2po_rllib/jobs/plan.py):")
    lines.append(f"  {'':<34} {'DDP (replica)':>14} {f'FSDP ({n} shards)':>17}")
    keys = list(dict.fromkeys([*p["memory"]["ddp"], *p["memory"]["fsdp"]]))
    for key in keys:
        cells = [f"{p['memory'][mode][key] / GiB:.1f}" if key in p["memory"][mode] else "-" for mode in ("ddp", "fsdp")]
        lines.append(f"  {key:<34} {cells[0]:>14} {cells[1]:>17}")
    totals = {mode: sum(parts.values()) / GiB for mode, parts in p["memory"].items()}
    lines.append(f"  {'total':<34} {totals['ddp']:>14.1f} {totals['fsdp']:>17.1f}")
    usable = HEADROOM * p["gpu_memory_gb"]
    verdict = ", ".join(f"{mode.upper()} {'fits' if p['fits'][mode] else 'does not fit'}" for mode in ("ddp", "fsdp"))
    best = ", ".join(f"{mode.upper()} {p['largest_micro_batch'][mode] or 'none'}" for mode in ("ddp", "fsdp"))
    lines += [
        f"Device {p['gpu_memory_gb']:g} GiB (--gpu-memory-gb; {usable:.0f} usable): {verdict}; largest micro_batch_size dividing {p['per_learner_sequences']} that fits: {best}",
        f"Recommendation: {recommendation(p)}",
        f"  * this config runs {p['sharding'].upper()} (training.learner_sharding)",
    ]
    c = p["colocated"]
    if c:
        usable_gib, fit = HEADROOM * p["gpu_memory_gb"], lambda b: "fits" if b <= HEADROOM * p["gpu_memory_gb"] * GiB else "does not fit"
        lines += [
            f"Colocated GPU (colocate=True: vLLM beside the learner, asleep during updates; {usable_gib:.0f} GiB usable):",
            f"  rollouts: learner states {c['learner_states'] / GiB:.1f} + vLLM {c['utilization']:g} x {p['gpu_memory_gb']:g} = "
            f"{c['engine'] / GiB:.1f} GiB (weights {c['engine_weights'] / GiB:.1f}, KV cache {c['kv_tokens'] / 1e3:.0f}K tokens = "
            f"{c['kv_sequences']:.0f} sequences of {p['seq_len']}) -> {c['rollouts'] / GiB:.1f} GiB: {fit(c['rollouts'])}",
            f"  updates: the learner's peak {c['updates'] / GiB:.1f} GiB (vLLM asleep): {fit(c['updates'])}",
            f"  vLLM may take up to gpu_memory_utilization {c['max_utilization']:.2f} beside the learner's states",
        ]
    util = p["engine_gpu_memory_utilization"]
    if p["rollout_engine"] == "vllm" and util and not c:
        weights = m.num_params * _DTYPE_BYTES.get(p["engine_dtype"], 2) / GiB
        lines.append(f"EnvRunner GPU: vLLM takes {util:g} x {p['gpu_memory_gb']:g} = {util * p['gpu_memory_gb']:.0f} GiB; weights {weights:.1f} GiB, the rest KV cache")
    return "\n".join(lines)


def run_plan(config_path: str, gpu_memory_gb: float, overrides=None, prompt_len: int | None = None,
             gpus: int | None = None) -> int:
    print(format_plan(plan(config_path, gpu_memory_gb, overrides=overrides, prompt_len=prompt_len, gpus=gpus)))
    return 0
