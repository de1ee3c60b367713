"""MindFormers config layouts and key spellings, translated to the recipe's one vocabulary.

MindFormers writes the same model in several ways, and :mod:`ms_memopt.config.recipe` reads them all
through this module:

* **layouts** — ``model.model_config`` (1.x and 2.x graph-mode configs); a bare ``model:``
  mapping with ``parallelism:`` and ``training:`` sections (2.x PyNative configs); the shape in
  a Hugging Face ``config.json`` under ``pretrained_model_dir`` (2.x templates), which the YAML's
  own keys override, as MindFormers merges them;
* **key spellings** — legacy (``num_layers``, ``num_heads``, ``n_kv_heads``,
  ``param_init_type``), Hugging Face (``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``), Megatron-style (``params_dtype``, ``ffn_hidden_size``,
  ``num_experts``) and GLM (``multi_query_group_num``, ``kv_channels``, ``padded_vocab_size``);
  :data:`ALIASES` lists them, first spelling first;
* **model_type defaults** — what MindFormers' config classes default to when a key is absent
  (:data:`MODEL_TYPE_DEFAULTS`; facts read from mindformers 2.0.0's ``configuration_*.py``).

Nothing here validates a value: it only finds which key holds it, so that the recipe reader's
messages name the key the user wrote.

Example:
    >>> mc, notes = model_mapping({"model": {"model_config": {"model_type": "qwen3",
    ...     "num_hidden_layers": 4}}}, source="x.yaml")
    >>> pick(mc, "num_layers"), pick(mc, "num_heads"), pick(mc, "head_dim")
    (('num_hidden_layers', 4), ('num_attention_heads', 32), ('head_dim', 128))
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import parse_json
from ms_memopt.core.lines import open_text

__all__ = ["ALIASES", "MODEL_TYPE_DEFAULTS", "model_mapping", "pick", "close_key", "parallel_mapping",
           "not_a_training_config"]

#: canonical recipe key -> the MindFormers spellings that may hold it, most common first
ALIASES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_layers", "num_hidden_layers", "n_layer", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "dim"),
    "num_heads": ("num_heads", "num_attention_heads", "n_head", "n_heads"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads", "multi_query_group_num", "kv_heads",
                   "num_query_groups"),
    "head_dim": ("head_dim", "kv_channels"),
    "seq_length": ("seq_length",),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "param_init_type": ("param_init_type", "params_dtype"),
    "layernorm_compute_type": ("layernorm_compute_type", "layernorm_compute_dtype"),
    "hidden_dropout_rate": ("hidden_dropout_rate", "hidden_dropout"),
    "attention_dropout_rate": ("attention_dropout_rate", "attention_dropout"),
    # MoE
    "num_experts": ("num_experts", "n_routed_experts", "expert_num", "num_moe_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_router_topk", "num_experts_chosen"),
    "n_shared_experts": ("n_shared_experts", "shared_expert_num"),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size",
                                            "shared_expert_intermediate_size"),
    "first_k_dense_replace": ("first_k_dense_replace",),
    "moe_layer_freq": ("moe_layer_freq", "decoder_sparse_step"),
    # MTP
    "mtp_layers": ("num_nextn_predict_layers", "mtp_num_layers", "mtp_depth"),
}

#: what MindFormers' config classes default to, by ``model_type`` (HF key names); the
#: training-side defaults (``seq_length``, ``compute_dtype``, ...) are MindFormers' own
#: ``register_mf_model_parameter`` values
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
              "seq_length": 2048, "multiple_of": 256, "hidden_act": "silu",
              "compute_dtype": "float16", "param_init_type": "float16"},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "seq_length": 4096, "hidden_act": "silu"},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "head_dim": 128, "seq_length": 4096, "hidden_act": "silu", "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128},
    "deepseek_v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
                    "num_attention_heads": 128, "n_shared_experts": 1,
                    "n_routed_experts": 256, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
                    "hidden_act": "silu", "seq_length": 4096, "use_flash_attention": True,
                    "multi_latent_attention": True},
}
# Qwen3 is Qwen2 with a per-head width of its own; TeleChat3 is Qwen3 with another vocabulary;
# TeleChat3-MoE's config class is DeepSeek-V3's with other sizes
MODEL_TYPE_DEFAULTS["qwen3"] = {**MODEL_TYPE_DEFAULTS["qwen2"], "head_dim": 128}
MODEL_TYPE_DEFAULTS["telechat"] = {**MODEL_TYPE_DEFAULTS["qwen3"], "vocab_size": 131072}
MODEL_TYPE_DEFAULTS["telechat3_moe"] = {
    **MODEL_TYPE_DEFAULTS["deepseek_v3"], "vocab_size": 131072, "hidden_size": 2560, "intermediate_size": 7680,
    "moe_intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 32, "n_routed_experts": 192}
_TYPE_ALIASES = {"telechat2": "telechat", "telechat3": "telechat", "deepseek3": "deepseek_v3",
                 "deepseekv3": "deepseek_v3", "llama2": "llama", "llama3": "llama"}

#: recipe keys whose absence makes a plan impossible (the did-you-mean targets)
_REQUIRED = ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size")


def canonical_type(model_type: Any) -> str | None:
    """``"DeepSeekV3"`` -> ``"deepseek_v3"``; ``None`` for an unknown or missing type."""
    if not isinstance(model_type, str):
        return None
    name = model_type.strip().lower().replace("-", "_")
    name = _TYPE_ALIASES.get(name, name)
    return name if name in MODEL_TYPE_DEFAULTS else None


def pick(mc: dict, key: str) -> tuple[str, Any] | None:
    """The first spelling of ``key`` (:data:`ALIASES`) present in ``mc`` with a value:
    ``(spelling, value)``; ``None`` when no spelling is there."""
    for name in ALIASES.get(key, (key,)):
        value = mc.get(name)
        if value is not None:
            return name, value
    return None


def close_key(mc: dict, key: str) -> str | None:
    """A key of ``mc`` that looks like a typo of ``key`` or one of its spellings
    (``num_layerz`` for ``num_layers``), for a did-you-mean; ``None`` when nothing is close."""
    spellings = set(ALIASES.get(key, (key,)))
    candidates = [str(k) for k in mc if str(k) not in spellings]
    for name in ALIASES.get(key, (key,)):
        hit = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
        if hit:
            return hit[0]
    return None


def _read_hf_config(directory: Any, source: str) -> tuple[dict, str | None]:
    """``pretrained_model_dir/config.json`` (relative to the recipe's folder or the working
    directory) as a mapping, and a note when it is named but not found."""
    if not isinstance(directory, str) or not directory.strip():
        return {}, None
    candidates = [Path(directory) / "config.json"]
    if source and not Path(directory).is_absolute():
        candidates.insert(0, Path(source).parent / directory / "config.json")
    for path in candidates:
        if path.is_file():
            # bounded lines and size, JSON nesting bounded (a 5000-deep config.json raised RecursionError)
            with open_text(path, expected="the model's config.json") as handle:
                data = parse_json(handle.read(), source=str(path))
            if not isinstance(data, dict):
                raise InputError("expected a JSON object", source=str(path))
            return data, None
    return {}, f"pretrained_model_dir {directory!r} has no config.json here"


_CANONICAL = {name: key for key, names in ALIASES.items() for name in names}


def _underlay(top: dict, below: dict) -> dict:
    """``top`` over ``below``, where a key of ``below`` also yields to any other spelling of
    the same setting in ``top`` (a YAML's ``num_hidden_layers`` hides a default ``num_layers``)."""
    merged = dict(top)
    for name, value in below.items():
        if name in merged:
            continue
        canonical = _CANONICAL.get(name)
        if canonical is not None and pick(top, canonical) is not None:
            continue
        merged[name] = value
    return merged


def model_mapping(data: dict, *, source: str) -> tuple[dict, list[str]]:
    """The model's keys as one mapping, whatever the layout, and notes on where they came from.

    Order of precedence (later wins): ``model_type`` defaults, ``pretrained_model_dir``'s
    ``config.json``, the YAML's own keys. A template with neither a shape nor a readable
    ``config.json`` nor a ``model_type`` is planned with the Qwen3 defaults (``qwen3_moe`` when
    it sets MoE keys), the family MindFormers 2.x's general templates are written for; a note
    says so.

    Raises:
        InputError: a multi-modal config (``llm_model``/``vision_model``), with a one-line
            reason naming the key.
    """
    model = data.get("model")
    if not isinstance(model, dict):
        return {}, []
    if isinstance(model.get("model_config"), dict):
        mc = dict(model["model_config"])
        base = "model.model_config"
    elif any(k in model for k in ("model_type", "num_hidden_layers", "num_layers", "hidden_size")):
        mc = dict(model)          # 2.x PyNative layout: the model's keys directly under model:
        base = "model"
    else:
        return {}, []
    for nested in ("llm_model", "vision_model", "text_config"):
        if isinstance(mc.get(nested), dict):
            raise InputError("a multi-modal model: plan covers decoder-only language models "
                             "(plan the language model's own config instead)", source=source,
                             key=f"{base}.{nested}")
    if any(k in mc for k in ("encoder_layers", "decoder_layers", "num_encoder_layers")):
        raise InputError("an encoder-decoder model: plan covers decoder-only language models",
                         source=source, key=f"{base}.{next(k for k in ('encoder_layers', 'decoder_layers', 'num_encoder_layers') if k in mc)}")
    notes: list[str] = []
    hf, missing_note = _read_hf_config(data.get("pretrained_model_dir"), source)
    merged = _underlay(mc, hf)
    mtype = canonical_type(merged.get("model_type"))
    trainer = data.get("trainer")
    if mtype is None and isinstance(trainer, dict):      # trainer.model_name: 'deepseekV3'
        mtype = canonical_type(trainer.get("model_name"))
    has_shape = pick(merged, "num_layers") is not None or pick(merged, "hidden_size") is not None
    if mtype is None and not has_shape and missing_note is not None:
        mtype = "qwen3_moe" if pick(merged, "num_experts") is not None else "qwen3"
        notes.append(f"{missing_note}: the model's shape is MindFormers' {mtype} defaults "
                     f"(give the shape keys or a config.json for the real model)")
    if mtype is not None:
        merged = _underlay(merged, MODEL_TYPE_DEFAULTS[mtype])
    if merged.get("seq_length") is None:
        # MindFormers trains at the dataset's length; the position table's size is only the
        # model's limit, used when nothing else says
        dataset = _dataset_seq_length(data)
        fallback = next((merged[k] for k in ("max_position_embeddings", "max_position_embedding", "n_positions")
                         if merged.get(k) is not None), None)
        if dataset is not None or fallback is not None:
            merged["seq_length"] = dataset if dataset is not None else fallback
    merged["__base__"] = base
    return merged, notes


def _dataset_seq_length(data: dict) -> Any:
    """``train_dataset.data_loader.config.seq_length`` (2.x) or ``train_dataset.seq_length``."""
    dataset = data.get("train_dataset")
    if not isinstance(dataset, dict):
        return None
    for loader_key in ("data_loader", "dataloader"):
        loader = dataset.get(loader_key)
        if isinstance(loader, dict) and isinstance(loader.get("config"), dict):
            if loader["config"].get("seq_length") is not None:
                return loader["config"]["seq_length"]
    return dataset.get("seq_length")


def parallel_mapping(data: dict) -> tuple[dict, dict, str]:
    """``(parallel_config, parallel, path)`` in the recipe's keys. The 2.x PyNative layout's
    ``parallelism:`` (FSDP over ``data_parallel_shard`` ranks, ``tensor_parallel``,
    ``pipeline_parallel``, ...) is translated; its data parallel size comes from
    ``training.global_batch_size / local_batch_size`` when ``data_parallel_shard`` is -1."""
    par = data.get("parallelism")
    if not isinstance(par, dict) or "parallel_config" in data:
        pc = data.get("parallel_config")
        return (pc if isinstance(pc, dict) else {}), (data.get("parallel") if isinstance(data.get("parallel"), dict)
                                                      else {}), "parallel_config"
    training = data.get("training") if isinstance(data.get("training"), dict) else {}
    dp = par.get("data_parallel_shard", -1)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        local, total = training.get("local_batch_size", 1), training.get("global_batch_size", 1)
        dp = max(1, total // local) if isinstance(local, int) and isinstance(total, int) and local > 0 else 1
    pc = {"data_parallel": dp,
          "model_parallel": par.get("tensor_parallel", 1),
          "pipeline_stage": par.get("pipeline_parallel", 1),
          "expert_parallel": par.get("expert_parallel", 1),
          "micro_batch_num": par.get("pipeline_parallel_microbatch_size", 1),
          "use_seq_parallel": par.get("sequence_parallel", False)}
    strategy = str(par.get("data_parallel_shard_strategy", "optim_grads_params"))
    zero = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(strategy, 0)
    return pc, {"enable_parallel_optimizer": zero > 0, "__zero_stage__": zero}, "parallelism"


def not_a_training_config(data: dict) -> str | None:
    """A one-line reason when ``data`` is no training config (``run_mode: predict``/``eval``,
    a checkpoint conversion), else ``None``."""
    mode = data.get("run_mode")
    if isinstance(mode, str) and mode.lower() in ("predict", "eval"):
        return (f"run_mode is {mode!r}: plan estimates training memory (weights, gradients, "
                f"optimizer states, activations); this config runs inference")
    if "model" not in data and any(k in data for k in ("convert_config", "reversed_convert")):
        return "a checkpoint conversion config, not a training config"
    return None
