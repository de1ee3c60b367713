"""Per-card device memory of a training job, by region, from its recipe.

Six regions, in bytes per card, for every pipeline stage (the worst stage is what must fit):

* ``parameters`` — the weights in their dtype (``param_init_type``), split by tensor and
  pipeline parallelism; sharded over data parallel with ZeRO stage 3.
* ``gradients`` — one gradient per parameter in ``memopt.grad_dtype``; sharded with ZeRO >= 2.
* ``optimizer`` — Adam's FP32 master copy (when the parameters are 16-bit and
  ``memopt.master_weights``), first and second moments m, v; sharded with ZeRO >= 1
  (MindSpore's parallel optimizer). Mixed-precision Adam is 2 + 2 + 12 = 16 bytes/parameter;
  sharded over N_d cards: 4 + 12/N_d (stage 1), 2 + 14/N_d (stage 2), 16/N_d (stage 3)
  (Rajbhandari et al., "ZeRO", 2019).
* ``activations`` — what the forward pass keeps for the backward pass, per Transformer layer
  and micro-batch (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", 2022), times the micro-batches in flight on the stage under 1F1B.
* ``communication`` — gradient buckets (AllReduce, ReduceScatter, AllGather) and pipeline
  send/receive buffers.
* ``workspace`` — operator workspaces and framework scratch (``memopt.workspace``).

All functions are pure; the formulas are summarized in docs/recipes.md.

Example:
    >>> zero_model_state_bytes(7_500_000_000, data_parallel=64, stage=1) / 1e9
    31.40625
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ms_memopt.config.recipe import DTYPE_BYTES, ModelConfig, Recipe, RecomputeConfig

__all__ = [
    "layer_split",
    "REGIONS", "NOTHING_FITS", "StageEstimate", "Estimate", "estimate", "zero_model_state_bytes",
    "korthikanti_layer_activation_bytes", "layer_activation_bytes", "layer_input_bytes",
    "layer_params", "attention_params", "expert_params", "embedding_params", "output_layer_params",
    "model_params", "stage_params", "stage_param_split", "StageParams", "in_flight_chunks", "logits_bytes",
    "routed_tokens", "alltoall_bytes", "routed_activation_bytes", "stage_moe_layers",
    "in_flight_micro_batches", "stage_activation_bytes", "recompute_group_bytes", "communication_bytes",
    "FUSION_BUCKET", "optimizer_shard_ways", "gathered_layer_bytes",
]

#: the region names, in report order
REGIONS = ("parameters", "gradients", "optimizer", "activations", "communication", "workspace")
#: how the note of :func:`estimate` begins when no ``checkpoint_every`` fits
NOTHING_FITS = "does not fit with any checkpoint_every"
#: MindSpore's default communication fusion threshold (64 MB) used as the default bucket size
FUSION_BUCKET = 64 * 2**20


# ---------------------------------------------------------------------------------------------
# published formulas
# ---------------------------------------------------------------------------------------------

def zero_model_state_bytes(params: int, *, data_parallel: int = 1, stage: int = 0,
                           param_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12) -> float:
    """Model-state bytes per card for mixed-precision Adam under ZeRO (Rajbhandari et al. 2019).

    ``stage`` 0: nothing sharded, ``(2 + 2 + 12) P``; 1: optimizer states sharded,
    ``4P + 12P/N_d``; 2: + gradients, ``2P + 14P/N_d``; 3: + parameters, ``16P/N_d``.

    Example:
        >>> [round(zero_model_state_bytes(7.5e9, data_parallel=64, stage=s) / 1e9, 1) for s in range(4)]
        [120.0, 31.4, 16.6, 1.9]
    """
    d = data_parallel
    return (param_bytes * params / (d if stage >= 3 else 1)
            + grad_bytes * params / (d if stage >= 2 else 1)
            + optimizer_bytes * params / (d if stage >= 1 else 1))


def korthikanti_layer_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, *,
                                       tensor_parallel: int = 1, sequence_parallel: bool = False,
                                       recompute: str = "none") -> float:
    """Activation bytes one GPT layer keeps per micro-batch, 16-bit (Korthikanti et al. 2022).

    s = ``seq``, b = ``micro_batch``, h = ``hidden``, a = ``heads``, t = ``tensor_parallel``:

    * no parallelism ``sbh(34 + 5as/h)``;
    * tensor parallel ``sbh(10 + 24/t + 5as/(ht))``;
    * tensor + sequence parallel ``sbh/t (34 + 5as/h)``;
    * ``recompute="selective"`` drops the ``5as/h`` attention-score term (TP+SP: ``34sbh/t``);
    * ``recompute="full"`` keeps only the layer input, ``2sbh``.

    Example:
        >>> korthikanti_layer_activation_bytes(2048, 1, 12288, 96, tensor_parallel=8,
        ...     sequence_parallel=True, recompute="selective") / 2**20
        102.0
    """
    s, b, h, a, t = seq, micro_batch, hidden, heads, tensor_parallel
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if sequence_parallel:
        return sbh / t * (34.0 + scores)
    return sbh * (10.0 + 24.0 / t + scores / t)


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------

def attention_params(model: ModelConfig) -> int:
    """Attention weights of one layer (unsharded): Q, K, V, O projections, K and V
    ``n_kv_heads`` wide (grouped-query attention); with MLA (:class:`~ms_memopt.config.recipe.MlaConfig`)
    the low-rank Q path (``q_lora_rank``), the KV latent (``kv_lora_rank`` + the shared RoPE key),
    its up-projection to per-head keys and values, their norms, and O."""
    h, a = model.hidden_size, model.num_heads
    mla = model.mla
    if mla is None:
        q = a * model.head_dim
        return 2 * h * q + 2 * h * model.kv_size
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query = (h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * a * qk) if mla.q_lora_rank else h * a * qk
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank \
        + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)
    return query + kv + a * mla.v_head_dim * h


def _ffn_params(model: ModelConfig, width: int) -> int:
    return (3 if model.ffn_gated else 2) * model.hidden_size * width


def expert_params(model: ModelConfig) -> int:
    """Weights of one routed expert (0 for a dense model)."""
    return 0 if model.moe is None else _ffn_params(model, model.moe.expert_ffn)


def layer_params(model: ModelConfig, layer: int | None = None) -> int:
    """Parameters of one Transformer layer (unsharded): attention (:func:`attention_params`),
    the FFN (three matrices when gated, SwiGLU; two otherwise) and two norms. Biases are not
    counted (LLaMA has none). With MoE, layer ``layer`` (0-based; ``None``: a dense layer) is a
    MoE layer when ``MoeConfig`` says so: the router, every routed expert and the shared experts
    instead of the dense FFN.

    Example:
        >>> from ms_memopt.config.recipe import recipe_from_dict
        >>> m = recipe_from_dict({"model": {"model_config": {"num_layers": 32, "hidden_size": 4096,
        ...     "num_heads": 32, "seq_length": 4096, "vocab_size": 32000}}}).model
        >>> layer_params(m)          # LLaMA-7B layer
        202383360
    """
    dense, experts = layer_split(model, _is_moe_layer(model, layer), 1, 1)
    return int(dense + experts)


def layer_split(model: ModelConfig, moe_layer: bool, t: int, ep: int) -> tuple[float, float]:
    """One card's share of one layer: (weights split by ``t`` + replicated norms, routed
    experts split by ``ep``)."""
    h = model.hidden_size
    if moe_layer:
        moe = model.moe
        split = attention_params(model) + h * moe.num_experts + _ffn_params(model, moe.shared_ffn)
        return split / t + 2 * h, moe.num_experts / ep * expert_params(model)
    return (attention_params(model) + _ffn_params(model, model.intermediate_size)) / t + 2 * h, 0.0


def _is_moe_layer(model: ModelConfig, layer: int | None) -> bool:
    moe = model.moe
    return moe is not None and layer is not None and moe.moe_layers_below(layer + 1) > moe.moe_layers_below(layer)


def _mtp_split(model: ModelConfig, t: int, ep: int) -> tuple[float, float]:
    """One multi-token-prediction layer, per card: a Transformer layer like the last one, the
    projection of [embedding; hidden] (``2h x h``, split by ``t``) and three norms."""
    h = model.hidden_size
    dense, experts = layer_split(model, _is_moe_layer(model, model.num_layers - 1), t, ep)
    return dense + 2 * h * h / t + 3 * h, experts


def embedding_params(model: ModelConfig) -> int:
    """The vocabulary embedding: ``vocab_size * hidden_size``."""
    return model.vocab_size * model.hidden_size


def output_layer_params(model: ModelConfig) -> int:
    """The output projection (0 when tied to the embedding) plus the final norm."""
    head = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return head + model.hidden_size


def model_params(model: ModelConfig) -> int:
    """All parameters of the model (unsharded), MTP layers included.

    Example: MindFormers' LLaMA-2 70B config gives about 6.9e10; DeepSeek-V3 about 6.8e11.
    """
    moe_layers = 0 if model.moe is None else model.moe.moe_layers_below(model.num_layers)
    dense, moe = sum(layer_split(model, False, 1, 1)), sum(layer_split(model, True, 1, 1)) if moe_layers else 0.0
    total = (model.num_layers - moe_layers) * dense + moe_layers * moe
    return int(total + model.mtp_layers * sum(_mtp_split(model, 1, 1))) + embedding_params(model) \
        + output_layer_params(model)


@dataclass(frozen=True)
class StageParams:
    """Parameters one card of a pipeline stage holds, before ZeRO sharding: ``dense`` (split
    by tensor parallel, replicated over data parallel) and ``experts`` (routed experts, split
    by expert parallel, replicated over ``data_parallel x model_parallel / expert_parallel``)."""
    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def stage_param_split(recipe: Recipe) -> list[StageParams]:
    """:class:`StageParams` of each pipeline stage.

    Layer weights are split over tensor parallel (norms replicated); routed experts over expert
    parallel only (MindFormers 2.x shards the expert weights by ``expert_parallel`` alone); the
    embedding sits on the first stage (split over tensor parallel unless ``vocab_emb_dp``), the
    output layer and the MTP layers on the last (with MTP and pipeline parallel, also a copy of
    the embedding, which MTP reads). ``memopt.params`` rescales every stage so the model totals
    that count.
    """
    model, par = recipe.model, recipe.parallel
    t, ep, p = par.model_parallel, par.expert_parallel, par.pipeline_stage
    h = model.hidden_size
    moe = model.moe
    dense_layer = layer_split(model, False, t, ep)
    moe_layer = layer_split(model, True, t, ep) if moe is not None else dense_layer
    emb = embedding_params(model) / (1 if par.vocab_emb_dp else t)
    out = (output_layer_params(model) - h) / t + h
    chunks = recipe.chunk_layers()
    counts = []
    for stage in range(p):
        dense, experts = 0.0, 0.0
        for c, row in enumerate(chunks):
            n = row[stage]
            first = recipe.chunk_first_layer(stage, c)
            moe_n = 0 if moe is None else moe.moe_layers_below(first + n) - moe.moe_layers_below(first)
            dense += (n - moe_n) * dense_layer[0] + moe_n * moe_layer[0]
            experts += moe_n * moe_layer[1]
        counts.append([dense, experts])
    counts[0][0] += emb
    counts[-1][0] += out
    if model.mtp_layers:
        mtp_dense, mtp_experts = _mtp_split(model, t, ep)
        counts[-1][0] += model.mtp_layers * mtp_dense + (emb if p > 1 else 0)
        counts[-1][1] += model.mtp_layers * mtp_experts
    if recipe.memopt.params is not None:
        scale = recipe.memopt.params / model_params(model)
        counts = [[d * scale, e * scale] for d, e in counts]
    return [StageParams(int(round(d)), int(round(e))) for d, e in counts]


def stage_params(recipe: Recipe) -> list[int]:
    """Parameters held by one card of each pipeline stage, before ZeRO sharding
    (:func:`stage_param_split`, dense and expert together)."""
    return [s.total for s in stage_param_split(recipe)]


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------

def layer_input_bytes(model: ModelConfig, *, seq: int, micro_batch: int, tensor_parallel: int = 1,
                      sequence_parallel: bool = False) -> int:
    """What a fully recomputed layer keeps: its input, ``2sbh`` (``/t`` with sequence parallel;
    ``4sbh`` with ``fp32_residual_connection``)."""
    width = 4 if model.fp32_residual else DTYPE_BYTES[model.compute_dtype]
    nbytes = width * seq * micro_batch * model.hidden_size
    return nbytes // tensor_parallel if sequence_parallel else nbytes


def layer_activation_bytes(model: ModelConfig, *, seq: int, micro_batch: int, tensor_parallel: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           comm_kept: bool = False, moe_layer: bool = False) -> int:
    """Activation bytes one layer keeps for one micro-batch on one card.

    Korthikanti et al.'s per-element count, generalized to the shapes real configs use; for a
    GPT layer (FFN 4h with GeLU, dropout, multi-head attention, 16-bit norms, no flash
    attention) it equals :func:`korthikanti_layer_activation_bytes`. Per token, with 2-byte
    (``compute_dtype``) tensors:

    * outside the tensor-parallel region (split by t only with sequence parallel): two norm
      inputs (``layernorm_compute_type`` bytes each, 4h at 16-bit), the QKV input 2h, the FFN
      input 2h, and with dropout two 1-byte masks (h each);
    * inside it (split by t): Q 2h, K and V ``2 n_kv_heads h / a`` each, the attention output 2h,
      the FFN's 4f (two tensors: fc1 output and GeLU output, 16h for f = 4h) or 8f when gated
      (gate, up, act(gate), product); attention scores ``a s`` per token: softmax output 2, with
      attention dropout + mask 1 + output 2 (``5as/h`` per sbh); none with flash attention, which
      keeps a 4-byte log-sum-exp per head instead.

    ``recompute``: ``"selective"`` drops the attention scores, ``"full"`` keeps only the layer
    input (:func:`layer_input_bytes`). ``comm_kept``: with sequence parallel, the all-gathered
    QKV and FFN inputs are kept whole (no communication recompute), adding ``4h (1 - 1/t)``.

    Attention widths follow the heads: Q and the attention output are ``a x head_dim`` wide
    (``h`` unless ``head_dim`` says otherwise); with MLA, Q and K are ``a (nope + rope)``, V and
    the output ``a v_head_dim``, and the low-rank latents (``q_lora_rank``, ``kv_lora_rank +
    rope``) sit outside the tensor-parallel region. ``moe_layer``: the FFN is the shared experts
    (inside, their width) plus the routed part, outside the tensor-parallel region (split by t
    only with sequence parallel): per token ``top_k`` copies of the dispatched input and of the
    expert output (h each) and the expert's four ``expert_ffn``-wide tensors, and the FP32 router
    logits and probabilities (8 bytes per expert).

    Example (GPT-3 175B layer, s 2048, TP 8 + SP, selective): 34 sbh / t bytes, 102 MiB.
    """
    s, b, t = seq, micro_batch, tensor_parallel
    if recompute == "full":
        return layer_input_bytes(model, seq=s, micro_batch=b, tensor_parallel=t, sequence_parallel=sequence_parallel)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    h, a, kv = model.hidden_size, model.num_heads, model.kv_size
    c = DTYPE_BYTES[model.compute_dtype]
    norm = DTYPE_BYTES[model.layernorm_compute_type]
    masks = 2 * h if model.hidden_dropout else 0
    outside = 2 * norm * h + c * h + c * h + masks
    gate = 4 if model.ffn_gated else 2
    if model.mla is None:
        q = out = a * model.head_dim
        k = v = kv
    else:
        mla = model.mla
        q = k = a * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        v = out = a * mla.v_head_dim
        outside += c * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim)
    inside = c * (q + k + v + out)
    moe = model.moe
    if moe_layer and moe is not None:
        inside += gate * c * moe.shared_ffn
        outside += _routed_per_token(model)
    else:
        inside += gate * c * model.intermediate_size
    if model.use_flash_attention:
        inside += 4 * a
    elif recompute == "none":
        inside += a * s * (c + (1 + c if model.attention_dropout else 0))
    per_token = inside / t + (outside / t if sequence_parallel else outside)
    if comm_kept and sequence_parallel:
        per_token += 2 * c * h * (1 - 1 / t)
    return int(round(per_token * s * b))


def _routed_per_token(model: ModelConfig) -> int:
    """Routed bytes one token keeps in a MoE layer: ``top_k`` copies of the dispatched input and
    of the expert output (h each) and the expert's four ``expert_ffn``-wide tensors, plus the FP32
    router logits and probabilities (8 bytes per expert)."""
    moe, c = model.moe, DTYPE_BYTES[model.compute_dtype]
    return moe.top_k * c * (2 * model.hidden_size + 4 * moe.expert_ffn) + 8 * moe.num_experts


def routed_activation_bytes(recipe: Recipe) -> int:
    """The routed part of one MoE layer's activations for one micro-batch at the balanced load
    (included in :func:`layer_activation_bytes` with ``moe_layer``); 0 for a dense model."""
    model, par = recipe.model, recipe.parallel
    if model.moe is None:
        return 0
    tokens = model.seq_length * recipe.train.batch_size
    if par.use_seq_parallel:
        tokens /= par.model_parallel
    return int(round(tokens * _routed_per_token(model)))


def stage_moe_layers(recipe: Recipe, stage: int) -> tuple[int, ...]:
    """Indices (0-based, in execution order: chunk after chunk) of the stage's MoE layers."""
    model = recipe.model
    if model.moe is None:
        return ()
    out, local = [], 0
    for c, row in enumerate(recipe.chunk_layers()):
        first = recipe.chunk_first_layer(stage, c)
        for j in range(row[stage]):
            if _is_moe_layer(model, first + j):
                out.append(local)
            local += 1
    return tuple(out)


def in_flight_micro_batches(stage: int, pipeline_stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak under 1F1B:
    ``min(m, p - stage)``; the first stage holds ``p`` (Narayanan et al. 2021)."""
    return max(1, min(micro_batches, pipeline_stages - stage))


def in_flight_chunks(stage: int, pipeline_stages: int, micro_batches: int, chunks: int = 1) -> list[int]:
    """Micro-batches each interleaved chunk of ``stage`` holds at its peak.

    One chunk: :func:`in_flight_micro_batches`. With ``chunks = v > 1`` (interleaved 1F1B,
    MindFormers' ``pp_interleave_num``), the stage runs ``2 (p - stage - 1) + (v - 1) p + 1``
    chunk forwards before its first backward (Narayanan et al. 2021, at most ``m v``), ``p`` at
    a time per chunk in turn; so the first stage holds ``1 + (p - 1)/(p v)`` times the
    activations of plain 1F1B.

    Example:
        >>> in_flight_chunks(0, 8, 32, 2)        # 23 chunk forwards, 8 per chunk in turn
        [15, 8]
    """
    p, m, v = pipeline_stages, micro_batches, chunks
    if v <= 1:
        return [in_flight_micro_batches(stage, p, m)]
    forwards = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    # forward k runs chunk (k // p) % v: whole blocks of p, then a partial one
    blocks, partial = divmod(forwards, p)
    return [p * (blocks // v + (1 if c < blocks % v else 0)) + (partial if blocks % v == c else 0)
            for c in range(v)]


@dataclass(frozen=True)
class _StageActivations:
    bytes: int
    recomputed_layers: int
    selective_layers: int


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    """Length of the intersection of the half-open ranges ``a`` and ``b``."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def recompute_group_bytes(n_layers: int, k: int, per_layer_bytes: int, input_bytes: int, *,
                          micro_batches: int = 1) -> int:
    """Activation bytes of ``n_layers`` layers recomputed in groups of ``k`` (``checkpoint_every = k``).

    Consecutive layers are grouped ``k`` at a time and each group is recomputed in the
    backward pass from its input: every in-flight micro-batch keeps only the ``ceil(n/k)``
    group inputs (``input_bytes`` each), and the backward regenerates one group's full
    activations (``min(k, n) * per_layer_bytes``) on top, once (groups are recomputed one
    after the other, not per micro-batch). ``k = 1`` is full recompute; ``k = n`` keeps one
    input per micro-batch but regenerates the whole stack at once. Not monotone in ``k``.

    Example (12 layers of 1000 bytes, inputs of 50 bytes, k = 6): 2 inputs + 6 layers.
        >>> recompute_group_bytes(12, 6, 1000, 50)
        6100
        >>> recompute_group_bytes(12, 6, 1000, 50, micro_batches=4)
        6400
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n_layers <= 0:
        return 0
    return micro_batches * math.ceil(n_layers / k) * input_bytes + min(k, n_layers) * per_layer_bytes


def stage_activation_bytes(recipe: Recipe, stage: int, *, checkpoint_every: int | None = None,
                           layers: int | None = None) -> _StageActivations:
    """Activation bytes on one card of ``stage`` at its peak (start of the first backward).

    ``recompute_config`` first: its fully recomputed layers (the first of a stage, as in
    MindFormers) keep their input, every other layer keeps :func:`layer_activation_bytes`;
    the stage holds :func:`in_flight_micro_batches` micro-batches; when every layer is
    recomputed, the backward regenerates one layer's activations on top.

    ``checkpoint_every = k`` (pool mode's meaning, :func:`recompute_group_bytes`) then groups
    the layers ``recompute_config`` did not already recompute, ``k`` at a time: per in-flight
    micro-batch they keep only their ``ceil(n'/k)`` group inputs, and the backward regenerates
    one group (``min(k, n')`` layers at the largest per-layer amount among them) once. The
    layers recompute_config recomputes keep their inputs as before; their one-at-a-time
    recompute overlaps no group's. ``None`` (the argument and ``memopt.checkpoint_every``) =
    no checkpointing. ``k = 1`` is full recompute.

    The last stage adds the logits (compute dtype + an FP32 copy for the loss).
    ``memopt.activation_factor`` scales the total. ``layers``: the stage's layer count when the
    caller has it (``recipe.stage_layers()[stage]``).

    The cost does not grow with the layers: a layer keeps one of four amounts (selective
    recompute or not, communication inputs kept or not, each a prefix or suffix of the stage),
    so the sums are counts times those amounts.
    """
    k = checkpoint_every if checkpoint_every is not None else recipe.memopt.checkpoint_every
    return _activations_for(_activation_terms(recipe, stage), k)


@dataclass(frozen=True)
class _ChunkTerms:
    """What one interleaved chunk of a stage keeps, independent of ``checkpoint_every``."""
    held: int           # micro-batches in flight
    layers: int
    full: int           # layers recompute_config recomputes
    selective: int
    kept_sum: int       # activations of the other layers, one micro-batch
    kept_max: int       # the largest per-layer amount of the chunk
    group_max: int      # the largest per-layer amount among the other layers


@dataclass(frozen=True)
class _ActivationTerms:
    chunks: tuple[_ChunkTerms, ...]
    input_bytes: int
    extra: float        # the last stage's LM head and MTP layers
    factor: float


def _activation_terms(recipe: Recipe, stage: int) -> _ActivationTerms:
    """The per-chunk sums of :func:`stage_activation_bytes` (computed once per stage; the
    recommendation in :func:`estimate` then tries every ``checkpoint_every`` on them)."""
    model, par, rc = recipe.model, recipe.parallel, recipe.recompute
    chunk_rows = recipe.chunk_layers()
    held = in_flight_chunks(stage, par.pipeline_stage, par.micro_batch_num, len(chunk_rows))
    shape = dict(seq=model.seq_length, micro_batch=recipe.train.batch_size,
                 tensor_parallel=par.model_parallel, sequence_parallel=par.use_seq_parallel)
    inp = layer_input_bytes(model, **shape)
    amounts: dict[tuple[bool, bool, bool], int] = {}

    def amount(is_selective: bool, is_comm_kept: bool, is_moe: bool) -> int:
        key = (is_selective, is_comm_kept, is_moe)
        if key not in amounts:
            amounts[key] = layer_activation_bytes(model, **shape, recompute="selective" if is_selective else "none",
                                                  comm_kept=is_comm_kept, moe_layer=is_moe)
        return amounts[key]

    chunks = []
    for c, row in enumerate(chunk_rows):
        n = row[stage]
        if n <= 0:
            continue
        first = recipe.chunk_first_layer(stage, c)
        full = RecomputeConfig.layers(rc.recompute, stage, n, c)
        selective = RecomputeConfig.layers(rc.select_recompute, stage, n, c)
        comm = n if rc.mp_comm_recompute else RecomputeConfig.layers(rc.select_comm_recompute, stage, n, c)
        # layer j keeps one of eight amounts: selective (j < selective) or not, comm inputs kept
        # (j >= comm) or not, MoE layer or not; each a range, so the sums are counts x amounts
        kept_sum, kept_max, group_max = 0, 0, 0
        for is_selective, sel_range in ((True, (0, selective)), (False, (selective, n))):
            for is_comm_kept, comm_range in ((True, (comm, n)), (False, (0, comm))):
                kind = (max(sel_range[0], comm_range[0]), min(sel_range[1], comm_range[1]))
                if kind[1] <= kind[0]:
                    continue
                for is_moe in (False, True):
                    if not _moe_count(model, first, kind, is_moe):
                        continue
                    value = amount(is_selective, is_comm_kept, is_moe)
                    kept_max = max(kept_max, value)
                    lo, hi = max(kind[0], full), kind[1]
                    kept = _moe_count(model, first, (lo, hi), is_moe) if hi > lo else 0
                    if kept:
                        kept_sum += value * kept
                        group_max = max(group_max, value)
        chunks.append(_ChunkTerms(held[c], n, full, selective, kept_sum, kept_max, group_max))
    extra = 0.0
    if stage == par.pipeline_stage - 1:
        extra += logits_bytes(recipe)
        if model.mtp_layers:       # the MTP layers' own activations, recomputed like the stage's last
            extra += model.mtp_layers * held[-1] * (inp if rc.recompute else amount(False, False, model.moe is not None))
    return _ActivationTerms(tuple(chunks), inp, extra, recipe.memopt.activation_factor)


def _activations_for(terms: _ActivationTerms, k: int | None) -> _StageActivations:
    """:func:`stage_activation_bytes` from a stage's terms, with ``checkpoint_every = k``."""
    inp = terms.input_bytes
    total = terms.extra
    regenerate = 0          # what the backward regenerates on top, once (the largest of the chunks)
    recomputed = selective = 0
    for ch in terms.chunks:
        m, n, full = ch.held, ch.layers, ch.full
        grouped = n - full if k is not None else 0
        if grouped > 0:
            total += m * full * inp + recompute_group_bytes(grouped, k, 0, inp, micro_batches=m)
            regenerate = max(regenerate, min(k, grouped) * ch.group_max)
            recomputed += n
        else:
            total += m * (full * inp + ch.kept_sum)
            if full == n:
                regenerate = max(regenerate, ch.kept_max - inp)
            recomputed += full
        selective += ch.selective
    total += regenerate
    return _StageActivations(int(round(total * terms.factor)), recomputed, selective)


def _moe_count(model: ModelConfig, first: int, span: tuple[int, int], is_moe: bool) -> int:
    """How many layers of the chunk-local range ``span`` (the chunk starting at global layer
    ``first``) are MoE layers (``is_moe``) or dense ones."""
    n = span[1] - span[0]
    if model.moe is None:
        return 0 if is_moe else n
    moe = model.moe.moe_layers_below(first + span[1]) - model.moe.moe_layers_below(first + span[0])
    return moe if is_moe else n - moe


def logits_bytes(recipe: Recipe) -> int:
    """The last stage's LM head output for one micro-batch at the config's sequence length:
    the logits in the compute dtype, their FP32 cast and the FP32 log-probabilities the loss
    keeps for its backward, ``s b V / t x (c + 8)``; once more per MTP layer (each has its own
    head pass and loss).

    Example: Qwen3-32B's last stage (s 4096, V 151,936, t 4, BF16): 2.3 GiB.
    """
    model, par = recipe.model, recipe.parallel
    per = model.seq_length * recipe.train.batch_size * model.vocab_size / par.model_parallel
    return int(per * (DTYPE_BYTES[model.compute_dtype] + 8) * (1 + model.mtp_layers))


# ---------------------------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------------------------

def routed_tokens(recipe: Recipe) -> int:
    """Token copies one card sends to routed experts per MoE layer and micro-batch at the
    balanced (mean) load: ``s b k`` (``/t`` with sequence parallel); 0 for a dense model."""
    model, par = recipe.model, recipe.parallel
    if model.moe is None:
        return 0
    tokens = model.seq_length * recipe.train.batch_size * model.moe.top_k
    return tokens // par.model_parallel if par.use_seq_parallel else tokens


def alltoall_bytes(recipe: Recipe, tokens: int | None = None) -> int:
    """The MoE all-to-all's send and receive buffers (dispatch, then combine reuses them):
    ``2 x tokens x h`` in the compute dtype, ``tokens`` the routed copies
    (:func:`routed_tokens` unless given: the simulator varies it step to step)."""
    model = recipe.model
    if model.moe is None:
        return 0
    copies = routed_tokens(recipe) if tokens is None else tokens
    return 2 * copies * model.hidden_size * DTYPE_BYTES[model.compute_dtype]


def optimizer_shard_ways(recipe: Recipe) -> tuple[int, int]:
    """Over how many cards ZeRO / MindSpore's parallel optimizer shards one card's dense weights
    and its routed-expert weights: ``(dense, experts)``.

    A weight is sharded over its replicas. Dense weights are replicated over data parallel.
    Routed experts: MindFormers 2.0.0's ``FFNGroupedGEMM.shard`` lays the expert weights out as
    ``(ep, None)`` on the MoE device matrix ``(dp x tp / ep, ep)`` (``device_matrix.py``,
    ``MoeLayoutManager.init_dp_cp_tp_ep_layout``): split by ``expert_parallel`` only, replicated
    over ``data_parallel x model_parallel / expert_parallel``. ``optimizer_weight_shard_size``
    caps the ways when it divides the replicas (MindSpore: otherwise it "will not be effective").

    Example: DeepSeek-V3 671B (d 4, t 8, ep 32, shard size 256) -> ``(4, 1)``: its experts
    have no replica to shard over.
    """
    par = recipe.parallel
    size = par.optimizer_weight_shard_size

    def capped(replicas: int) -> int:
        return size if 0 < size < replicas and replicas % size == 0 else replicas
    return capped(par.data_parallel), capped(max(1, par.data_parallel * par.model_parallel // par.expert_parallel))


def gathered_layer_bytes(recipe: Recipe) -> int:
    """What the parallel optimizer all-gathers to run the largest layer: the layer's sharded
    weights whole again (0 without ``enable_parallel_optimizer``, or when nothing of the layer is
    sharded). Under pipeline parallel MindSpore moves the all-gather after the weight's cast to
    the compute dtype (``InsertAllGatherAfterCast`` in ``mindspore/ccsrc/frontend/parallel``), so the gathered copy
    is 16-bit; without, it gathers the stored dtype and casts (both copies).

    One layer at a time is a lower bound: with ``parallel_optimizer_comm_recompute`` False the
    gathered weights stay for the backward.

    Example: TeleChat3-105B's MoE layer (192 experts of 3 x 2560 x 1536, ep 1, replicas 32):
    4.2 GiB in BF16.
    """
    par, model = recipe.parallel, recipe.model
    if not par.enable_parallel_optimizer:
        return 0
    dense_ways, expert_ways = optimizer_shard_ways(recipe)
    t, ep = par.model_parallel, par.expert_parallel
    moe_layers = 0 if model.moe is None else model.moe.moe_layers_below(model.num_layers)
    kinds = [layer_split(model, False, t, ep)] if moe_layers < model.num_layers else []
    if moe_layers:
        kinds.append(layer_split(model, True, t, ep))
    most = max((dense if dense_ways > 1 else 0.0) + (experts if expert_ways > 1 else 0.0) for dense, experts in kinds)
    width = DTYPE_BYTES[model.compute_dtype]
    if par.pipeline_stage == 1 and DTYPE_BYTES[model.param_init_type] != width:
        width += DTYPE_BYTES[model.param_init_type]
    return int(round(most * width))


def communication_bytes(recipe: Recipe, grad_bytes: int) -> dict[str, int]:
    """Communication buffers per card by kind; explicit ``memopt.communication`` values win.

    Defaults: with data parallel, one fused gradient bucket of MindSpore's 64 MB fusion
    threshold (no larger than the gradients): AllReduce without ZeRO, ReduceScatter + AllGather
    with it (with MindSpore's parallel optimizer the AllGather holds at least one layer's
    gathered weights, :func:`gathered_layer_bytes`); with pipeline parallel, send and receive buffers for one boundary activation in
    each direction (``4 sbh`` bytes, ``/t`` with sequence parallel); with MoE, the all-to-all
    buffers (:func:`alltoall_bytes`).
    """
    par, mem, model = recipe.parallel, recipe.memopt, recipe.model
    cfg = mem.communication
    dp = par.data_parallel > 1
    bucket = min(FUSION_BUCKET, grad_bytes)
    boundary = layer_input_bytes(model, seq=model.seq_length, micro_batch=recipe.train.batch_size,
                                 tensor_parallel=par.model_parallel, sequence_parallel=par.use_seq_parallel)
    defaults = {
        "allreduce_bucket": bucket if dp and mem.zero_stage == 0 else 0,
        "reduce_scatter_bucket": bucket if dp and mem.zero_stage >= 1 else 0,
        "allgather_bucket": max(bucket if dp and mem.zero_stage >= 1 else 0, gathered_layer_bytes(recipe)),
        "p2p_buffers": 2 * boundary if par.pipeline_stage > 1 else 0,
        "alltoall_buffers": alltoall_bytes(recipe),
    }
    given = dataclasses.asdict(cfg)
    return {key: (given[key] if given[key] is not None else value) for key, value in defaults.items()}


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageEstimate:
    """One card of one pipeline stage. Bytes everywhere; ``params`` is a count."""
    stage: int
    layers: int
    in_flight: int
    params: int
    recomputed_layers: int
    regions: dict[str, int]
    parameters_by_dtype: dict[str, int]
    optimizer_states: dict[str, int]
    communication: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.regions.values())

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "layers": self.layers, "in_flight": self.in_flight,
                "params": self.params, "recomputed_layers": self.recomputed_layers,
                "regions": dict(self.regions), "parameters_by_dtype": dict(self.parameters_by_dtype),
                "optimizer_states": dict(self.optimizer_states),
                "communication_buffers": dict(self.communication), "total": self.total}


@dataclass(frozen=True)
class Estimate:
    """Per-card memory of every pipeline stage; the worst stage decides ``fits``.

    ``checkpoint_every`` is the recommended recompute-group size ``k`` (see
    :func:`recompute_group_bytes`): ``None`` when the plan fits without checkpointing (or
    nothing fits, with a note, or no capacity is known), else the largest k that fits.
    """
    stages: list[StageEstimate]
    capacity: int | None
    checkpoint_every: int | None
    model_params: int
    source: str = "<recipe>"
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> StageEstimate:
        return max(self.stages, key=lambda s: (s.total, -s.stage))

    @property
    def regions(self) -> dict[str, int]:
        return dict(self.worst.regions)

    @property
    def total(self) -> int:
        return self.worst.total

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.total

    def to_dict(self, *, per_stage: bool = True) -> dict[str, Any]:
        """JSON-ready: sizes in bytes."""
        worst = self.worst
        out: dict[str, Any] = {
            "recipe": self.source, "regions": self.regions, "total": self.total,
            "capacity": self.capacity, "fits": self.fits, "headroom": self.headroom,
            "checkpoint_every": self.checkpoint_every, "worst_stage": worst.stage,
            "parameters_by_dtype": dict(worst.parameters_by_dtype),
            "optimizer_states": dict(worst.optimizer_states),
            "communication_buffers": dict(worst.communication),
            "model_params": self.model_params, "params_per_card": worst.params,
            "layers": worst.layers, "in_flight": worst.in_flight,
            "recomputed_layers": worst.recomputed_layers, "notes": list(self.notes),
        }
        if per_stage:
            out["stages"] = [s.to_dict() for s in self.stages]
        return out


def _shard(nbytes: float, ways: int, sharded: bool) -> int:
    return int(math.ceil(nbytes / ways)) if sharded else int(round(nbytes))


def _stage_estimate(recipe: Recipe, stage: int, params: StageParams, checkpoint_every: int | None,
                    layers: int) -> StageEstimate:
    model, par, mem = recipe.model, recipe.parallel, recipe.memopt
    d, z = par.data_parallel, mem.zero_stage
    # ZeRO shards a parameter over its replicas: dense weights over data parallel, routed
    # experts over data_parallel x model_parallel / expert_parallel (capped by
    # optimizer_weight_shard_size): optimizer_shard_ways
    dense_ways, expert_ways = optimizer_shard_ways(recipe)

    def sharded(per_param: float, stage_from: int) -> int:
        return (_shard(params.dense * per_param, dense_ways, z >= stage_from)
                + _shard(params.experts * per_param, expert_ways, z >= stage_from))

    p_dtype = model.param_init_type
    # MindSpore's parallel optimizer (level1) stores the weights sharded too, gathered for the
    # forward (gathered_layer_bytes); its gradients are reduce-scattered to the shard, except
    # the pipeline's accumulation buffer. That buffer is MindFormers' MFPipelineWithLossScaleCell
    # accu_grads = optimizer.parameters.clone(init="zeros") (mindformers/wrapper/wrapper.py):
    # one per parameter, in the parameter's dtype, and MindSpore's SetClonedTensorShapeForOptimizer
    # (mindspore/ccsrc/frontend/parallel/parameter_manager.cc) gives "accu_grads" clones the
    # parameter's model-parallel slice shape (whole over data parallel) unless
    # grad_accumulation_shard (optimizer_level level2/level3), then the optimizer shard's shape
    po = par.enable_parallel_optimizer
    param_bytes = sharded(DTYPE_BYTES[p_dtype], 1 if po else 3)
    grads_split = po and (par.pipeline_stage == 1 or par.gradient_accumulation_shard)
    grad_bytes = sharded(DTYPE_BYTES[mem.grad_dtype], 1 if grads_split else 2)
    master = 4 if (mem.master_weights and DTYPE_BYTES[p_dtype] < 4) else 0
    moment = DTYPE_BYTES[mem.optimizer_dtype]
    states = {"master": sharded(master, 1), "m": sharded(moment, 1), "v": sharded(moment, 1)}
    if recipe.train.optimizer_swap:        # optimizer.swap: the states live in host memory
        states = {name: 0 for name in states}
    acts = stage_activation_bytes(recipe, stage, checkpoint_every=checkpoint_every, layers=layers)
    comm = communication_bytes(recipe, _shard(params.total * DTYPE_BYTES[mem.grad_dtype], d, False))
    regions = {"parameters": param_bytes, "gradients": grad_bytes, "optimizer": sum(states.values()),
               "activations": acts.bytes, "communication": sum(comm.values()), "workspace": mem.workspace}
    return StageEstimate(stage=stage, layers=layers,
                         in_flight=sum(in_flight_chunks(stage, par.pipeline_stage, par.micro_batch_num,
                                                        model.pp_interleave_num)),
                         params=params.total, recomputed_layers=acts.recomputed_layers, regions=regions,
                         parameters_by_dtype={p_dtype: param_bytes}, optimizer_states=states,
                         communication=comm)


def _stages(recipe: Recipe, checkpoint_every: int | None) -> list[StageEstimate]:
    layers = recipe.stage_layers()
    return [_stage_estimate(recipe, i, p, checkpoint_every, layers[i])
            for i, p in enumerate(stage_param_split(recipe))]


def _over_budget_notes(recipe: Recipe, stages: list[StageEstimate]) -> list[str]:
    """Why a plan does not fit, when one of MindSpore's sharding switches explains it: the
    pipeline's whole FP32 accumulation buffer, routed experts held whole on every card."""
    par, model = recipe.parallel, recipe.model
    worst = max(stages, key=lambda s: (s.total, -s.stage))
    notes = []
    if model.moe is not None and par.expert_parallel == 1:
        notes.append(f"expert_parallel 1: every card holds all {model.moe.num_experts} routed experts of its layers "
                     f"(MindFormers shards expert weights by expert_parallel only)")
    if par.enable_parallel_optimizer and par.pipeline_stage > 1 and not par.gradient_accumulation_shard:
        sharded = dataclasses.replace(recipe, parallel=dataclasses.replace(par, gradient_accumulation_shard=True))
        alt = max(s.total for s in _stages(sharded, recipe.memopt.checkpoint_every))
        notes.append(f"gradients: the pipeline's accumulation buffer (accu_grads, {worst.regions['gradients'] / 2**30:.1f} "
                     f"GiB on stage {worst.stage}) is whole over data parallel with "
                     f"gradient_accumulation_shard False; with True the worst stage is {alt / 2**30:.1f} GiB")
    return notes


def estimate(recipe: Recipe) -> Estimate:
    """Per-card bytes by region for every pipeline stage of ``recipe``, and the worst stage.

    The stages use ``memopt.checkpoint_every`` as given. The recommended ``checkpoint_every``
    is ``None`` when the recipe fits without checkpointing; otherwise the LARGEST k
    (1 .. layers on a stage) whose worst stage fits: the coarsest grouping, fewest recompute
    boundaries (every k recomputes each grouped layer's forward once). Memory is not monotone
    in k (``ceil(n/k)`` kept inputs shrink, the ``k`` regenerated layers grow), so every k is
    evaluated; each is a closed form per stage, O(layers x stages) in all.

    Example:
        >>> from ms_memopt.config.recipe import recipe_from_dict
        >>> r = recipe_from_dict({"model": {"model_config": {"num_layers": 2, "hidden_size": 64,
        ...     "num_heads": 4, "seq_length": 32, "vocab_size": 256}},
        ...     "memopt": {"device": {"hbm": "1GiB"}, "workspace": "16MiB"}})
        >>> e = estimate(r); e.fits, e.checkpoint_every
        (True, None)
    """
    stages = _stages(recipe, None)
    capacity = recipe.capacity
    recommended = None
    notes: list[str] = list(recipe.notes)
    if recipe.train.optimizer_swap:
        host = sum(_stage_estimate(dataclasses.replace(recipe, train=dataclasses.replace(
            recipe.train, optimizer_swap=False)), s.stage, p, None, s.layers).regions["optimizer"]
            for s, p in zip(stages[:1], stage_param_split(recipe)[:1]))
        notes.append(f"optimizer.swap: Adam states in host memory, not counted "
                     f"({host / 2**30:.1f} GiB per card on stage 0)")
    if capacity is not None:
        unchecked = recipe if recipe.memopt.checkpoint_every is None else dataclasses.replace(
            recipe, memopt=dataclasses.replace(recipe.memopt, checkpoint_every=None))
        if max(s.total for s in _stages(unchecked, None)) > capacity:
            fixed = [s.total - s.regions["activations"] for s in stages]
            layers = recipe.stage_layers()
            terms = [_activation_terms(recipe, i) for i in range(len(stages))]
            for k in range(max(layers, default=0), 0, -1):
                worst = max(f + _activations_for(t, k).bytes for f, t in zip(fixed, terms))
                if worst <= capacity:
                    recommended = k
                    break
            if recommended is None:
                notes.append(NOTHING_FITS + " (1 .. the layers on a stage): add parallelism or ZeRO sharding")
    else:
        notes.append("no capacity: set memopt.device.hbm or context.max_device_memory")
    if capacity is not None and max(s.total for s in stages) > capacity:
        notes.extend(_over_budget_notes(recipe, stages))
    if recipe.memopt.params is not None:
        notes.append(f"parameter count set by memopt.params ({recipe.memopt.params}); "
                     f"the shapes give {model_params(recipe.model)}")
    return Estimate(stages=stages, capacity=capacity, checkpoint_every=recommended,
                    model_params=recipe.memopt.params or model_params(recipe.model),
                    source=recipe.source, notes=notes)
