"""YAML recipes: MindFormers-style keys plus a ``memopt:`` section, validated into dataclasses.

A recipe is a MindFormers training config (``model.model_config``, ``parallel_config``,
``parallel``, ``recompute_config``, ``runner_config``, ``optimizer``, ``context``) with one
section of our own, ``memopt:``. A plain MindFormers config with no ``memopt:`` section loads
unchanged: every MindFormers section and key we do not use is ignored. Inside ``memopt:`` every
key is ours, so an unknown key is an error (with a did-you-mean). Every key, its default and its
meaning is documented in ``docs/recipes.md``.

Sizes in bytes, counts as integers; strings such as ``"4.2GB"``, ``"512MiB"``, ``"7.5e9"`` or
``"100B"`` are accepted where a size or count is expected (PyYAML reads ``7.5e9`` as a string,
because YAML 1.1 floats need a dot and a signed exponent). ``context.max_device_memory`` follows
MindSpore's meaning: ``"56GB"`` is 56 GiB.

Example:
    >>> r = recipe_from_dict({"model": {"model_config": {"num_layers": 2, "hidden_size": 64,
    ...     "num_heads": 4, "seq_length": 32, "vocab_size": 256}}})
    >>> r.model.intermediate_size, r.parallel.data_parallel, r.memopt.zero_stage
    (256, 1, 0)
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ms_memopt.config import mfconfig
from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_text
from ms_memopt.core.units import MAX_VALUE, parse_count, parse_size, short_repr
from ms_memopt.io.yamltext import parse_yaml

__all__ = [
    "DTYPE_BYTES", "ModelConfig", "ParallelConfig", "RecomputeConfig", "TrainConfig", "DeviceConfig",
    "CommunicationConfig", "AllocatorConfig", "ShapeCacheConfig", "ExtraAllocsConfig",
    "WorkloadConfig", "StandaloneTrainConfig", "MemoptConfig", "Recipe", "load_recipe",
    "recipe_from_dict", "llama_ffn_size", "LIMITS", "MoeConfig", "MlaConfig", "SEQ_DISTRIBUTIONS",
    "seq_range", "schema_keys", "TimingConfig",
]

#: bytes per element of the dtypes recipes may name
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                  "half": "float16"}
_GATED_ACTS = {"silu", "swiglu", "swish", "geglu"}
_PLAIN_ACTS = {"gelu", "fast_gelu", "relu", "gelu_new", "tanh", "sigmoid"}

_MISSING = object()

#: Upper bounds on a recipe's shape, far beyond any real job (the largest public models have
#: ~100-200 layers, hidden sizes of ~25k, vocabularies of ~256k, contexts of ~1M tokens and
#: thousands of micro-batches). They keep absurd inputs (``num_layers: 2**31``) from running
#: the estimator or simulator for hours or out of memory; docs/recipes.md lists them.
LIMITS: dict[str, int] = {
    "num_layers": 10_000,
    "hidden_size": 2**20,
    "num_heads": 2**16,
    "seq_length": 2**24,
    "vocab_size": 2**24,
    "intermediate_size": 2**24,
    "micro_batch_num": 100_000,
    "batch_size": 2**20,
    "num_experts": 2**16,
}
#: ``ffn_dim_multiplier`` and ``activation_factor`` beyond this are typos, not configurations
_MAX_FACTOR = 1000.0


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts: ``num_experts`` routed experts of FFN width ``expert_ffn``, each
    token sent to ``top_k`` of them, plus ``shared_experts`` always-on experts (their total FFN
    width ``shared_ffn``). Layer ``i`` is a MoE layer when ``i >= first_dense`` and
    ``i % layer_freq == 0`` (DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``)."""
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    shared_ffn: int = 0
    first_dense: int = 0
    layer_freq: int = 1

    def moe_layers_below(self, end: int) -> int:
        """How many of the layers ``0 .. end-1`` are MoE layers (closed form).

        Example:
            >>> MoeConfig(8, 2, 64, first_dense=3).moe_layers_below(10)
            7
        """
        if end <= self.first_dense:
            return 0
        first = -(-self.first_dense // self.layer_freq) * self.layer_freq   # first multiple >= first_dense
        return 0 if end <= first else (end - 1 - first) // self.layer_freq + 1


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a ``q_lora_rank``
    bottleneck (0: a plain projection), keys and values through a ``kv_lora_rank`` latent;
    per head ``qk_nope_head_dim + qk_rope_head_dim`` for Q and K, ``v_head_dim`` for V."""
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    """The Transformer's shape and dtypes (``model.model_config``).

    ``intermediate_size`` is resolved: given, or LLaMA's rule from ``ffn_dim_multiplier`` and
    ``multiple_of`` (gated FFN), or ``4 * hidden_size`` (plain FFN).
    """
    num_layers: int
    hidden_size: int
    num_heads: int
    n_kv_heads: int
    seq_length: int
    vocab_size: int
    intermediate_size: int
    ffn_gated: bool
    compute_dtype: str = "bfloat16"
    param_init_type: str = "bfloat16"
    layernorm_compute_type: str = "float32"
    use_flash_attention: bool = False
    hidden_dropout: bool = False
    attention_dropout: bool = False
    tie_word_embeddings: bool = False
    offset: tuple[tuple[int, ...], ...] = ()   # (pp_interleave_num x pipeline_stage); () = none
    pp_interleave_num: int = 1
    kv_channels: int | None = None       # per-head width when not hidden_size / num_heads (Qwen3)
    fp32_residual: bool = False          # fp32_residual_connection: layer inputs kept in FP32
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None
    mtp_layers: int = 0                  # multi-token prediction layers, on the last stage

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the K (and of the V) projection: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class ParallelConfig:
    """``parallel_config`` and ``parallel.enable_parallel_optimizer``."""
    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    use_seq_parallel: bool = False
    vocab_emb_dp: bool = True
    enable_parallel_optimizer: bool = False
    expert_parallel: int = 1
    # parallel.parallel_optimizer_config: MindSpore 2.10's context starts with
    # grad_accumulation_shard False (its reset() docstring says True; the running context says
    # False), and MindFormers' TrainingArguments default it to False too; optimizer_level
    # "level2"/"level3" turns it on
    gradient_accumulation_shard: bool = False
    # how many replicas of a weight the parallel optimizer shards it over: -1 = all of them
    # (parallel_optimizer_config.optimizer_weight_shard_size, MindSpore's default -1)
    optimizer_weight_shard_size: int = -1

    @property
    def cards(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage


# A recompute setting is a bool (all layers or none) or a per-pipeline-stage list of layer counts.
RecomputeSetting = bool | tuple[int, ...] | tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RecomputeConfig:
    """``recompute_config``: each setting a bool or a per-stage tuple of layer counts."""
    recompute: RecomputeSetting = False
    select_recompute: RecomputeSetting = False
    select_comm_recompute: RecomputeSetting = False
    mp_comm_recompute: bool = True

    @staticmethod
    def layers(setting: RecomputeSetting, stage: int, stage_layers: int, chunk: int = 0) -> int:
        """Number of a stage's layers (of its ``chunk``-th interleaved part) a setting covers:
        bool: all or none; a per-stage list: its entry (every chunk); a per-chunk list of
        per-stage lists (MindFormers' ``[[14, 14], [14, 14]]`` with ``pp_interleave_num``)."""
        if isinstance(setting, bool):
            return stage_layers if setting else 0
        entry = setting[stage] if not isinstance(setting[0], tuple) else setting[min(chunk, len(setting) - 1)][stage]
        return min(entry, stage_layers)


@dataclass(frozen=True)
class TrainConfig:
    """What the MindFormers sections say about the training step."""
    batch_size: int = 1                 # runner_config.batch_size: sequences per micro-batch
    optimizer_type: str | None = None   # optimizer.type; None: mixed-precision Adam, FP32 states
    max_device_memory: int | None = None  # context.max_device_memory, bytes (GiB-based)
    seed: int = 0
    optimizer_swap: bool = False        # optimizer.swap: Adam states kept in host memory


@dataclass(frozen=True)
class DeviceConfig:
    name: str = "Ascend910B"
    hbm: int | None = None
    cards: int | None = None


@dataclass(frozen=True)
class CommunicationConfig:
    """Communication buffers in bytes; ``None`` = the default derived from the parallel setup."""
    allreduce_bucket: int | None = None
    reduce_scatter_bucket: int | None = None
    allgather_bucket: int | None = None
    p2p_buffers: int | None = None
    alltoall_buffers: int | None = None


@dataclass(frozen=True)
class AllocatorConfig:
    """How the device pool is set up (consumed by the allocator models and the simulator).

    There is no alignment key: every model aligns as its allocator does (512 bytes for
    MindSpore's pools, PyTorch's caching allocator and pool mode); ``memopt.allocator.align``,
    once parsed and never read, is accepted at 512 with a note and refused otherwise."""
    name: str = "mindspore"
    increase_size: int = 2**30
    pregrow: bool = False
    init_size: int | None = None


def _derived(rule: str) -> dict:
    """Field metadata of a default that follows from other keys: ``rule`` is how
    docs/recipes.md states it (tests/test_schema.py holds the table to it)."""
    return {"default": rule}


@dataclass(frozen=True)
class ShapeCacheConfig:
    """Small long-lived tensors created once per new input shape (RoPE tables, workspaces)."""
    bytes_per_shape: int = 10 * 2**20
    max_shapes: int | None = None


@dataclass(frozen=True)
class ExtraAllocsConfig:
    """Odd allocations outside the step pattern (logging, checkpoint staging, eval)."""
    probability: float = 0.0
    size: int = 64 * 2**20
    lifetime_steps: int = 1


@dataclass(frozen=True)
class WorkloadConfig:
    """``memopt.workload``: the knobs of the synthetic per-step alloc/free pattern.

    The one schema of these keys: each field's default here is *the* default, read by the
    recipe loader, by :class:`~ms_memopt.workload.step.WorkloadSpec` (the simulator's form, whose
    fields take their defaults from these) and by ``ms-memopt run``'s sequence lengths
    (:func:`~ms_memopt.workload.step.draw_sequence_length`, the one rule for both). Every
    mechanism is off unless a recipe asks for it. ``seq_min``/``seq_max`` ``None``: derived
    from ``seq_length`` (:func:`seq_range`); ``seed``: the recipe's top-level ``seed``.
    """
    enabled: bool = True
    seed: int = field(default=0, metadata=_derived("seed"))
    steps: int = 1000
    dynamic_seq: bool = False
    seq_distribution: str = "uniform"
    seq_min: int | None = field(default=None, metadata=_derived("seq_length // 8"))
    seq_max: int | None = field(default=None, metadata=_derived("seq_length"))
    seq_buckets: tuple[int, ...] = ()
    seq_align: int = 1
    long_tail: float = 0.0
    shape_cache: ShapeCacheConfig = field(default_factory=ShapeCacheConfig)
    extra_allocs: ExtraAllocsConfig = field(default_factory=ExtraAllocsConfig)
    comm_jitter: float = 0.0
    moe_load_cv: float = 0.2            # MoE routing load variation; acts on MoE layers only
    #: a step template learned from recordings (``ms-memopt learn``): the steps are the user's
    #: model's instead of the hand-made workload's; a path relative to the recipe's folder
    template: str | None = None
    #: with a template, each step's dims from a CSV (one row a step, one column a dim; ``simulate
    #: T.template.json --schedule``) instead of drawn by the length rules; relative to the recipe
    schedule: str | None = None


#: ``memopt.workload.seq_distribution``'s choices
SEQ_DISTRIBUTIONS = ("uniform", "lognormal", "fixed")


def seq_range(seq_length: int, seq_min: int | None = None, seq_max: int | None = None) -> tuple[int, int]:
    """``(seq_min, seq_max)`` with the derived defaults filled in: ``seq_max = seq_length``,
    ``seq_min = max(1, seq_length // 8)`` (never above ``seq_max``).

    Example:
        >>> seq_range(8192), seq_range(8192, seq_max=512), seq_range(4)
        ((1024, 8192), (512, 512), (1, 4))
    """
    high = seq_length if seq_max is None else seq_max
    low = min(max(1, seq_length // 8), high) if seq_min is None else seq_min
    return low, high


def schema_keys(cls: type) -> dict[str, dataclasses.Field]:
    """The keys of a section's schema dataclass, nested sections joined by dots (``shape_cache.max_shapes``).

    Example:
        >>> sorted(schema_keys(ExtraAllocsConfig))
        ['lifetime_steps', 'probability', 'size']
    """
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out.update({f"{f.name}.{k}": v for k, v in schema_keys(f.default_factory).items()})
        else:
            out[f.name] = f
    return out


@dataclass(frozen=True)
class TimingConfig:
    """``memopt.timing``: the constants of the simulator's time model (:mod:`ms_memopt.simulation.timing`).

    The one schema of these keys: each default here is *the* default (the recipe loader reads
    them from here); docs/recipes.md gives each one's source. Rates are per card; the defaults
    describe an Ascend 910C (the field report's card) and ``base_efficiency`` is the one constant
    calibrated on the field report (pool mode's 3.8 s step, docs/simulation.md).
    """
    peak_flops: float = 800e12              # FLOP/s, FP16/BF16 dense: the field report's ~800 TFLOPS
    base_efficiency: float = 0.63           # share of peak the model's kernels reach (calibrated)
    hbm_bandwidth: float = 1.8e12           # bytes/s: the field report's 1.8 TB/s
    collective_bandwidth: float = 400e9     # bytes/s per card for the gradient AllReduce: HCCS 400 GB/s
    device_alloc_seconds: float = 1e-3      # one block taken from the device (pool growth)
    device_free_seconds: float = 1e-3       # one idle block given back to the device (ReleaseFreeBlocks)
    vmm_chunk_seconds: float = 2e-5         # one 2 MiB chunk mapped or unmapped (VMM)
    defrag_sweep_seconds: float = 5e-3      # one eager-free / defrag sweep (VMM)
    slow_path_seconds: float = 1e-2         # one request on the allocator's slow path (release, sync, retry)
    compaction_barrier_seconds: float = 1e-3   # the global sync point of one compaction
    request_seconds: float = 0.0            # host time per allocation request (the op dispatch that makes it)
    shape_build_seconds: float = 0.0        # per request of a step at a shape not run before (kernel builds)
    card_jitter: float = 0.0                # CV of each card's compute per step (host noise, links, clocks)
    compaction_tensor_seconds: float = 2e-5  # host work per live tensor of a compaction (measured here)
    host_requests_per_layer: float = 0.0    # the real pool's requests per layer pass (hand-made steps; 0: off)
    host_requests_per_step: float = 0.0     # and per step (embedding, head, loss, optimizer)


@dataclass(frozen=True)
class StandaloneTrainConfig:
    """``memopt.train``: the standalone run (``ms-memopt run``) on one device."""
    steps: int = 20
    learning_rate: float = 1e-3
    batch_size: int = 2
    seed: int = 0
    dataset: str = "synthetic"
    device: str = "CPU"
    checkpoint_every_steps: int | None = None


@dataclass(frozen=True)
class MemoptConfig:
    """The ``memopt:`` section (all keys ours; defaults documented in docs/recipes.md)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    params: int | None = None
    zero_stage: int = 0
    grad_dtype: str = "bfloat16"
    master_weights: bool = True
    optimizer_dtype: str = "float32"
    checkpoint_every: int | None = None
    activation_factor: float = 1.0
    pool_mode: bool = False
    #: the simulated ``pool`` policy recomputes every k layers (pool mode as the field ran it:
    #: ``enable_pool_mode(checkpoint_every=k)``); ``None``: it keeps ``checkpoint_every``
    pool_checkpoint_every: int | None = None
    scan_every: int = 100
    compact_every: int | None = None
    compact_when_frag_above: float | None = None
    compact_trigger: str | None = None      # the simulator's ``compact`` warning: forecast | margin
    watch: dict[str, int] = field(default_factory=dict)
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    workspace: int = 2**30
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    train: StandaloneTrainConfig = field(default_factory=StandaloneTrainConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. ``source`` is the file (or label) it came from."""
    model: ModelConfig
    parallel: ParallelConfig
    recompute: RecomputeConfig
    train: TrainConfig
    memopt: MemoptConfig
    source: str = "<recipe>"
    notes: tuple[str, ...] = ()     # how MindFormers keys were read (defaults used, ...)

    @property
    def capacity(self) -> int | None:
        """Per-card memory to fit in: ``memopt.device.hbm``, else ``context.max_device_memory``."""
        if self.memopt.device.hbm is not None:
            return self.memopt.device.hbm
        return self.train.max_device_memory

    def chunk_layers(self) -> tuple[tuple[int, ...], ...]:
        """Layers of each interleaved chunk (``pp_interleave_num``) on each stage: ``[chunk][stage]``.

        With a MindFormers ``offset``, MindFormers' rule: ``num_layers // (stages x chunks)``
        plus the offset of that (chunk, stage); without, an even split with the remainder on
        the last virtual stages (they hold fewer micro-batches in flight under 1F1B).

        Example:
            >>> r = recipe_from_dict({"model": {"model_config": {"num_layers": 10, "hidden_size": 64,
            ...     "num_heads": 4, "seq_length": 32, "vocab_size": 256, "offset": [1, -1]}},
            ...     "parallel_config": {"pipeline_stage": 2, "micro_batch_num": 2}})
            >>> r.chunk_layers(), r.stage_layers()
            (((6, 4),), [6, 4])
        """
        return self._chunk_layers

    @functools.cached_property
    def _chunk_layers(self) -> tuple[tuple[int, ...], ...]:
        p, v = self.parallel.pipeline_stage, self.model.pp_interleave_num
        base, extra = divmod(self.model.num_layers, p * v)
        if self.model.offset:
            return tuple(tuple(base + self.model.offset[c][s] for s in range(p)) for c in range(v))
        return tuple(tuple(base + (1 if c * p + s >= p * v - extra else 0) for s in range(p)) for c in range(v))

    def stage_layers(self) -> list[int]:
        """Transformer layers on each pipeline stage (all its interleaved chunks)."""
        chunks = self._chunk_layers
        return [sum(row[s] for row in chunks) for s in range(self.parallel.pipeline_stage)]

    def chunk_first_layer(self, stage: int, chunk: int) -> int:
        """Global index of the first layer of ``chunk`` on ``stage`` (virtual stage
        ``chunk x stages + stage``; layers are consecutive along virtual stages)."""
        return self._virtual_starts[chunk * self.parallel.pipeline_stage + stage]

    @functools.cached_property
    def _virtual_starts(self) -> tuple[int, ...]:
        """First global layer of each virtual stage (``chunk x stages + stage``)."""
        return tuple(itertools.accumulate((n for row in self._chunk_layers for n in row), initial=0))


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------

def load_recipe(path: str | Path) -> Recipe:
    """Load and validate a recipe file.

    Raises:
        InputError: unreadable file, YAML syntax error (with the line), or a bad value (with the
            key path, the value and what was expected).

    Example:
        >>> load_recipe("recipes/demo_cpu.yaml").model.hidden_size   # doctest: +SKIP
        64
    """
    path = Path(path)
    # bounded: lines of at most 1 MiB, 64 MiB in all; a pipe or gzip read as a stream
    with open_text(path, expected="a recipe (YAML)") as handle:
        text = handle.read()
    data = parse_yaml(text, source=str(path))
    return recipe_from_dict(data, source=str(path))


def recipe_from_dict(data: Any, *, source: str = "<recipe>") -> Recipe:
    """Validate an already-parsed recipe mapping (what ``yaml.safe_load`` returns)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"expected a mapping at the top level, got {type(data).__name__}", source=source)
    reason = mfconfig.not_a_training_config(data)
    if reason is not None:
        raise InputError(reason, source=source, key="run_mode" if "run_mode" in data else None)
    r = _Reader(source)
    notes: list[str] = []
    model = _read_model(r, data, notes)
    parallel, zero_stage = _read_parallel(r, data)
    recompute = _read_recompute(r, data, parallel.pipeline_stage)
    train = _read_train(r, data)
    memopt = _read_memopt(r, data, model, parallel, train, zero_stage, notes)
    recipe = Recipe(model=model, parallel=parallel, recompute=recompute, train=train,
                    memopt=memopt, source=source, notes=tuple(notes))
    return _check_consistency(r, recipe)


def llama_ffn_size(hidden_size: int, ffn_dim_multiplier: float | None = None,
                   multiple_of: int = 256) -> int:
    """LLaMA's FFN width: ``2/3 * 4h``, times ``ffn_dim_multiplier``, rounded up to ``multiple_of``.

    Example:
        >>> llama_ffn_size(8192, 1.3, 256)     # MindFormers' LLaMA-2 70B config
        28416
        >>> llama_ffn_size(4096)               # LLaMA-7B
        11008
    """
    width = int(2 * 4 * hidden_size / 3)
    if ffn_dim_multiplier is not None:
        width = int(ffn_dim_multiplier * width)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


class _Reader:
    """Typed access to nested mappings with error messages that name the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, value: Any, expected: str) -> InputError:
        return InputError(f"got {short_repr(value)}; expected {expected}", source=self.source, key=key)

    def section(self, data: dict, name: str, path: str) -> dict:
        value = data.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, value, "a mapping")
        return value

    def get(self, data: dict, name: str, path: str, conv: Callable[[Any, str], Any], default: Any = _MISSING) -> Any:
        value = data.get(name, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise InputError("missing required key", source=self.source, key=path)
            return default
        return conv(value, path)

    # converters -------------------------------------------------------------------------------
    def template_path(self, value: Any, path: str) -> str:
        """A ``.template.json`` file (``ms-memopt learn``), relative to the recipe's folder; it must exist."""
        if not isinstance(value, str) or not value.endswith(".template.json"):
            raise self.fail(path, value, "the path of a step template, NAME.template.json (ms-memopt learn)")
        return self._existing(value, path, "step template file")

    def schedule_path(self, value: Any, path: str) -> str:
        """A step schedule, ``.csv`` (one row a step, one column a dim), relative to the recipe's folder."""
        if not isinstance(value, str) or not value.endswith(".csv"):
            raise self.fail(path, value, "the path of a step schedule, NAME.csv (a header of dims, one row a step)")
        return self._existing(value, path, "schedule file")

    def _existing(self, value: str, path: str, what: str) -> str:
        where = Path(value) if Path(value).is_absolute() or self.source.startswith("<") else \
            Path(self.source).parent / value
        if not where.is_file():
            raise self.fail(path, value, f"an existing {what} ({where} is not one)")
        return str(where)

    def integer(self, minimum: int | None = 1, maximum: int | None = None) -> Callable[[Any, str], int]:
        """Whole numbers within bounds, and never beyond :data:`~ms_memopt.core.units.MAX_VALUE` (int64)."""
        bounds = _bounds_text(minimum, maximum)
        limit = MAX_VALUE if maximum is None else maximum

        def conv(value: Any, path: str) -> int:
            number: float | None = None
            if isinstance(value, bool):
                number = None
            elif isinstance(value, int):
                number = value
            elif isinstance(value, float) and value.is_integer():
                number = value
            elif isinstance(value, str):
                number = _integer_from_text(value)
            if number is None:
                raise self.fail(path, value, f"an integer{bounds}")
            number = int(number)
            if minimum is not None and number < minimum:
                raise self.fail(path, value, f"an integer{bounds}")
            if abs(number) > limit:
                raise self.fail(path, value, f"an integer{bounds}" if maximum is not None
                                else f"an integer{bounds} of at most 2**63 - 1 in magnitude")
            return number
        return conv

    def number(self, minimum: float | None = None, maximum: float | None = None,
               exclusive_min: bool = False) -> Callable[[Any, str], float]:
        def conv(value: Any, path: str) -> float:
            number: float | None = None
            try:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    number = float(value)
                elif isinstance(value, str):
                    number = float(value)
            except (ValueError, OverflowError):   # not a number; an int beyond float range
                number = None
            low = "" if minimum is None else (f" > {minimum}" if exclusive_min else f" >= {minimum}")
            high = "" if maximum is None else f" <= {maximum}"
            expected = f"a number{low}{' and' if low and high else ''}{high}"
            if number is None or not math.isfinite(number):
                raise self.fail(path, value, expected)
            if minimum is not None and (number <= minimum if exclusive_min else number < minimum):
                raise self.fail(path, value, expected)
            if maximum is not None and number > maximum:
                raise self.fail(path, value, expected)
            return number
        return conv

    def boolean(self, value: Any, path: str) -> bool:
        if isinstance(value, bool):
            return value
        raise self.fail(path, value, "true or false")

    def string(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            return value
        raise self.fail(path, value, "a string")

    def choice(self, *options: str) -> Callable[[Any, str], str]:
        def conv(value: Any, path: str) -> str:
            if isinstance(value, str) and value.lower() in options:
                return value.lower()
            raise self.fail(path, value, "one of " + ", ".join(options))
        return conv

    def dtype(self, value: Any, path: str) -> str:
        if isinstance(value, str):
            name = value.strip().lower().removeprefix("mstype.").removeprefix("ms.")
            name = _DTYPE_ALIASES.get(name, name)
            if name in DTYPE_BYTES:
                return name
        raise self.fail(path, value, "a dtype: float32, float16 or bfloat16")

    def size(self, positive: bool = True) -> Callable[[Any, str], int]:
        def conv(value: Any, path: str) -> int:
            nbytes = parse_size(value, source=self.source, key=path)
            if positive and nbytes <= 0:
                raise self.fail(path, value, "a positive size such as '4.2GB' or '512MiB'")
            return nbytes
        return conv

    def mindspore_size(self, value: Any, path: str) -> int:
        """MindSpore's ``max_device_memory``: ``"56GB"`` means 56 GiB."""
        text = value
        if isinstance(value, str) and value.strip().upper().endswith("GB"):
            text = value.strip()[:-2] + "GiB"
        nbytes = parse_size(text, source=self.source, key=path)
        if nbytes <= 0:
            raise self.fail(path, value, "a positive size such as '56GB' (GiB, as in MindSpore)")
        return nbytes

    def count(self, value: Any, path: str) -> int:
        number = parse_count(value, source=self.source, key=path)
        if number <= 0:
            raise self.fail(path, value, "a positive count such as '7.5e9' or '100B'")
        return number

    def recompute_setting(self, stages: int) -> Callable[[Any, str], RecomputeSetting]:
        def conv(value: Any, path: str) -> RecomputeSetting:
            if isinstance(value, bool):
                return value
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
                return True   # a list of op-name patterns: selective recompute on every layer
            if isinstance(value, dict):
                return True
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
                # one per-stage list per interleaved chunk (pp_interleave_num): exactly one level
                # deeper, each row a list of counts (a deeper row, [[[1]]], is refused here by
                # counts(), not found later as a tuple compared with an int)
                return tuple(counts(row, f"{path}[{c}]") for c, row in enumerate(value))
            if isinstance(value, (list, tuple)):
                return counts(value, path)
            raise self.fail(path, value, "a bool or a per-pipeline-stage list of layer counts")

        def counts(value: Any, path: str) -> tuple[int, ...]:
            if not isinstance(value, (list, tuple)):
                raise self.fail(path, value, f"a list of {stages} layer counts (one per pipeline stage)")
            out = tuple(self.integer(minimum=0)(item, f"{path}[{i}]") for i, item in enumerate(value))
            if len(out) != stages:
                raise self.fail(path, value, f"a bool or a list of {stages} layer counts "
                                f"(one per pipeline stage)")
            return out
        return conv

    def typos(self, data: dict, path: str, known: set[str], absent: set[str] | None = None) -> None:
        """In a MindFormers section (whose other keys we ignore), refuse a key that is a near
        miss of a key we read and that is absent (``pipline_stage`` for ``pipeline_stage``):
        ignoring it would plan silently with the default. ``absent``: the known keys whose
        setting is missing (default: the known keys not in ``data``)."""
        absent = sorted(absent if absent is not None else (k for k in known if k not in data))
        for key in data:
            if not isinstance(key, str) or key in known:
                continue
            hint = difflib.get_close_matches(key, absent, n=1, cutoff=_TYPO_CUTOFF)
            if hint:
                raise InputError(f"unknown key; did you mean {hint[0]}?", source=self.source, key=f"{path}.{key}")

    def strict(self, data: dict, path: str, known: set[str]) -> None:
        """Reject keys of our own sections that we do not know, with a did-you-mean."""
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(str(key), sorted(known), n=1)
                tip = f"; did you mean {hint[0]!r}?" if hint else ""
                raise InputError(f"unknown key{tip} (known: {', '.join(sorted(known))})",
                                 source=self.source, key=f"{path}.{key}")


_DEVICE_NAMES = {"cpu": "CPU", "ascend": "Ascend", "gpu": "GPU"}
#: how close (difflib ratio) an unknown MindFormers key must be to a key we read to be a typo;
#: high, because MindFormers' sections hold many keys we do not read (none of its 2.0.0 and
#: 1.3.2 configs trips it)
_TYPO_CUTOFF = 0.88
#: the keys read from each MindFormers section (the typo check's vocabulary)
_SECTION_KEYS = {
    "parallel_config": {"data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num", "use_seq_parallel",
                        "vocab_emb_dp", "expert_parallel"},
    "recompute_config": {"recompute", "select_recompute", "select_comm_recompute", "mp_comm_recompute"},
    "runner_config": {"batch_size"},
    "context": {"max_device_memory"},
    "parallel": {"enable_parallel_optimizer", "parallel_optimizer_config"},
}


def _integer_from_text(text: str) -> int | None:
    """``"4096"``, ``"7.5e9"``, ``"100B"`` -> int; ``None`` when not a whole number."""
    try:
        value = float(text)
    except ValueError:
        try:
            return parse_count(text)
        except InputError:
            return None
    return int(value) if math.isfinite(value) and value.is_integer() else None


def _limited(r: _Reader, name: str) -> Callable[[Any, str], int]:
    """A positive integer up to ``LIMITS[name]``, which no real job exceeds."""
    positive = r.integer(minimum=1)

    def conv(value: Any, path: str) -> int:
        number = positive(value, path)
        if number > LIMITS[name]:
            raise r.fail(path, value, f"at most {LIMITS[name]} (a bound far beyond any real job; "
                         "see docs/recipes.md)")
        return number
    return conv


def _bounds_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------

def _read_model(r: _Reader, data: dict, notes: list[str]) -> ModelConfig:
    model = r.section(data, "model", "model")
    if "model_config" in model:
        r.section(model, "model_config", "model.model_config")
    mc, found = mfconfig.model_mapping(data, source=r.source)
    notes.extend(found)
    p = mc.pop("__base__", "model.model_config")
    pos = r.integer(minimum=1)
    if not mc:
        raise InputError("missing section: the model's shape (num_layers, hidden_size, num_heads, "
                         "seq_length, vocab_size) is required", source=r.source, key=p)

    absent = {name for key, names in mfconfig.ALIASES.items() if mfconfig.pick(mc, key) is None for name in names}
    r.typos(mc, p, {name for names in mfconfig.ALIASES.values() for name in names} | _MODEL_KEYS,
            absent | {k for k in _MODEL_KEYS if k not in mc})

    def get(key: str, conv: Callable[[Any, str], Any], default: Any = _MISSING) -> Any:
        """The value of ``key`` under any MindFormers spelling, the message naming that spelling;
        a missing required key names a close typo (``num_layerz``) as a did-you-mean."""
        hit = mfconfig.pick(mc, key)
        if hit is None:
            if default is _MISSING:
                typo = mfconfig.close_key(mc, key)
                hint = f"; did you mean {key}? ({p}.{typo} is not a key plan reads)" if typo else ""
                spellings = mfconfig.ALIASES.get(key, (key,))
                also = f" (or {', '.join(spellings[1:])})" if len(spellings) > 1 else ""
                raise InputError(f"missing required key{also}{hint}", source=r.source, key=f"{p}.{key}")
            return default
        return conv(hit[1], f"{p}.{hit[0]}")

    num_layers = get("num_layers", _limited(r, "num_layers"))
    hidden = get("hidden_size", _limited(r, "hidden_size"))
    heads = get("num_heads", _limited(r, "num_heads"))
    kv_heads = get("n_kv_heads", pos, heads)
    if mc.get("multi_query_attention") is False or mc.get("multi_latent_attention") is True:
        kv_heads = heads      # GLM ignores the group count then; MLA has a key and a value per head
    seq = get("seq_length", _limited(r, "seq_length"))
    vocab = get("vocab_size", _limited(r, "vocab_size"))
    kv_channels = get("head_dim", pos, None)
    if kv_channels is None and hidden % heads:
        raise r.fail(f"{p}.num_heads", heads, f"a divisor of hidden_size ({hidden})")
    if heads % kv_heads:
        raise r.fail(f"{p}.n_kv_heads", kv_heads, f"a divisor of num_heads ({heads})")

    act = r.get(mc, "hidden_act", f"{p}.hidden_act", r.string, None)
    if act is not None:
        act_l = act.lower().removeprefix("fused")
        if act_l not in _GATED_ACTS | _PLAIN_ACTS:
            raise r.fail(f"{p}.hidden_act", act, "one of " + ", ".join(sorted(_GATED_ACTS | _PLAIN_ACTS)))
        gated = act_l in _GATED_ACTS
    else:
        gated = True   # LLaMA-style SwiGLU unless told otherwise
    gated = r.get(mc, "gated_linear_unit", f"{p}.gated_linear_unit", r.boolean, gated)
    multiplier = r.get(mc, "ffn_dim_multiplier", f"{p}.ffn_dim_multiplier",
                       r.number(minimum=0, maximum=_MAX_FACTOR, exclusive_min=True), None)
    multiple_of = r.get(mc, "multiple_of", f"{p}.multiple_of", pos, 256)
    default_ffn = llama_ffn_size(hidden, multiplier, multiple_of) if gated else 4 * hidden
    ffn = get("intermediate_size", _limited(r, "intermediate_size"), default_ffn)

    compute = r.get(mc, "compute_dtype", f"{p}.compute_dtype", r.dtype, "bfloat16")
    param_dtype = get("param_init_type", r.dtype, compute)
    norm_dtype = get("layernorm_compute_type", r.dtype, "float32")
    # MindFormers 2.x's models (use_legacy: false, the PyNative layout) default to flash attention
    mcore = data.get("use_legacy") is False or p == "model"
    flash = r.get(mc, "use_flash_attention", f"{p}.use_flash_attention", r.boolean, mcore)
    rate = r.number(minimum=0, maximum=1)
    hidden_drop = get("hidden_dropout_rate", rate, 0.0) > 0
    attn_drop = get("attention_dropout_rate", rate, 0.0) > 0
    tie = r.get(mc, "tie_word_embeddings", f"{p}.tie_word_embeddings", r.boolean, False)
    if "untie_embeddings_and_output_weights" in mc:
        tie = not r.get(mc, "untie_embeddings_and_output_weights",
                        f"{p}.untie_embeddings_and_output_weights", r.boolean, True)
    fp32_residual = r.get(mc, "fp32_residual_connection", f"{p}.fp32_residual_connection", r.boolean, False)
    interleave = r.get(mc, "pp_interleave_num", f"{p}.pp_interleave_num",
                       r.integer(minimum=1, maximum=LIMITS["num_layers"]), 1)
    offset = _read_offset(r, mc.get("offset"), f"{p}.offset")
    return ModelConfig(num_layers=num_layers, hidden_size=hidden, num_heads=heads, n_kv_heads=kv_heads,
                       seq_length=seq, vocab_size=vocab, intermediate_size=ffn, ffn_gated=gated,
                       compute_dtype=compute, param_init_type=param_dtype,
                       layernorm_compute_type=norm_dtype, use_flash_attention=flash,
                       hidden_dropout=hidden_drop, attention_dropout=attn_drop,
                       tie_word_embeddings=tie, offset=offset, pp_interleave_num=interleave,
                       kv_channels=kv_channels, fp32_residual=fp32_residual,
                       moe=_read_moe(r, mc, p, get, hidden, ffn), mla=_read_mla(r, mc, p),
                       mtp_layers=get("mtp_layers", r.integer(minimum=0, maximum=LIMITS["num_layers"]), 0))


#: model_config keys read under one spelling only (the others are in mfconfig.ALIASES)
_MODEL_KEYS = {"hidden_act", "gated_linear_unit", "ffn_dim_multiplier", "multiple_of", "compute_dtype",
               "use_flash_attention", "tie_word_embeddings", "untie_embeddings_and_output_weights",
               "fp32_residual_connection", "pp_interleave_num", "offset", "multi_latent_attention", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "multi_query_attention"}


def _read_offset(r: _Reader, raw: Any, path: str) -> tuple[tuple[int, ...], ...]:
    """``0``/absent -> ``()``; a per-stage list -> one row; a per-chunk list of per-stage lists."""
    if raw is None or (isinstance(raw, int) and not isinstance(raw, bool) and raw == 0):
        return ()
    if not isinstance(raw, (list, tuple)) or not raw:
        raise r.fail(path, raw, "0, a per-stage list of layer offsets, or one such list per interleaved chunk")
    rows = raw if isinstance(raw[0], (list, tuple)) else [raw]
    out = []
    for c, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise r.fail(path, raw, "a list of per-stage lists (one per pp_interleave_num chunk)")
        where = f"{path}[{c}]" if rows is raw else path
        out.append(tuple(r.integer(minimum=None, maximum=LIMITS["num_layers"])(v, f"{where}[{i}]")
                         for i, v in enumerate(row)))
    return tuple(out)


def _read_moe(r: _Reader, mc: dict, p: str, get: Callable, hidden: int, ffn: int) -> MoeConfig | None:
    experts = get("num_experts", r.integer(minimum=0, maximum=LIMITS["num_experts"]), 0)
    if experts <= 1:
        return None
    expert_ffn = get("moe_intermediate_size", _limited(r, "intermediate_size"), ffn)
    shared = get("n_shared_experts", r.integer(minimum=0, maximum=LIMITS["num_experts"]), 0)
    shared_ffn = get("moe_shared_expert_intermediate_size", _limited(r, "intermediate_size"), shared * expert_ffn)
    top_k = get("num_experts_per_tok", r.integer(minimum=1, maximum=experts), min(2, experts))
    first_dense = get("first_k_dense_replace", r.integer(minimum=0, maximum=LIMITS["num_layers"]), 0)
    freq = get("moe_layer_freq", r.integer(minimum=1, maximum=LIMITS["num_layers"]), 1)
    return MoeConfig(num_experts=experts, top_k=top_k, expert_ffn=expert_ffn, shared_experts=shared,
                     shared_ffn=shared_ffn if shared else 0, first_dense=first_dense, layer_freq=freq)


def _read_mla(r: _Reader, mc: dict, p: str) -> MlaConfig | None:
    if not r.get(mc, "multi_latent_attention", f"{p}.multi_latent_attention", r.boolean, False):
        return None
    width = r.integer(minimum=0, maximum=LIMITS["hidden_size"])
    return MlaConfig(
        q_lora_rank=r.get(mc, "q_lora_rank", f"{p}.q_lora_rank", width, 0),
        kv_lora_rank=r.get(mc, "kv_lora_rank", f"{p}.kv_lora_rank", width, 512),
        qk_nope_head_dim=r.get(mc, "qk_nope_head_dim", f"{p}.qk_nope_head_dim", width, 128),
        qk_rope_head_dim=r.get(mc, "qk_rope_head_dim", f"{p}.qk_rope_head_dim", width, 64),
        v_head_dim=r.get(mc, "v_head_dim", f"{p}.v_head_dim", width, 128))


def _read_parallel(r: _Reader, data: dict) -> tuple[ParallelConfig, int | None]:
    """The parallel layout, and the ZeRO stage the 2.x PyNative layout's FSDP strategy implies."""
    pc, par, p = mfconfig.parallel_mapping(data)
    if p == "parallel_config":
        pc = r.section(data, "parallel_config", "parallel_config")
        par = r.section(data, "parallel", "parallel")
        r.typos(pc, "parallel_config", _SECTION_KEYS["parallel_config"])
        r.typos(par, "parallel", _SECTION_KEYS["parallel"])
    pos = r.integer(minimum=1)
    poc = r.section(par, "parallel_optimizer_config", "parallel.parallel_optimizer_config")
    poc_path = "parallel.parallel_optimizer_config"
    # MindSpore's set_parallel_optimizer_config: level2 shards the gradients (the accumulation
    # buffer) too, level3 also the weights again before the backward
    level = r.get(poc, "optimizer_level", f"{poc_path}.optimizer_level", r.choice("level1", "level2", "level3"),
                  "level1")
    config = ParallelConfig(
        data_parallel=r.get(pc, "data_parallel", f"{p}.data_parallel", pos, 1),
        model_parallel=r.get(pc, "model_parallel", f"{p}.model_parallel", pos, 1),
        pipeline_stage=r.get(pc, "pipeline_stage", f"{p}.pipeline_stage", pos, 1),
        micro_batch_num=r.get(pc, "micro_batch_num", f"{p}.micro_batch_num", _limited(r, "micro_batch_num"), 1),
        use_seq_parallel=r.get(pc, "use_seq_parallel", f"{p}.use_seq_parallel", r.boolean, False),
        vocab_emb_dp=r.get(pc, "vocab_emb_dp", f"{p}.vocab_emb_dp", r.boolean, True),
        enable_parallel_optimizer=r.get(par, "enable_parallel_optimizer",
                                        "parallel.enable_parallel_optimizer", r.boolean, False),
        expert_parallel=r.get(pc, "expert_parallel", f"{p}.expert_parallel", pos, 1),
        gradient_accumulation_shard=r.get(poc, "gradient_accumulation_shard",
                                          f"{poc_path}.gradient_accumulation_shard", r.boolean, False)
        or level in ("level2", "level3"),
        optimizer_weight_shard_size=r.get(poc, "optimizer_weight_shard_size", f"{poc_path}.optimizer_weight_shard_size",
                                          _shard_size(r), -1),
    )
    return config, par.get("__zero_stage__")


def _shard_size(r: _Reader) -> Callable[[Any, str], int]:
    """``optimizer_weight_shard_size``: a positive integer or -1 (all replicas)."""
    positive = r.integer(minimum=1)

    def conv(value: Any, path: str) -> int:
        if value == -1 and not isinstance(value, bool):
            return -1
        return positive(value, path)
    return conv


def _read_recompute(r: _Reader, data: dict, stages: int) -> RecomputeConfig:
    pynative = data.get("recompute")
    if "recompute_config" not in data and isinstance(pynative, dict):
        # 2.x PyNative layout: recompute: {mode: None | full | select}
        mode = r.get(pynative, "mode", "recompute.mode", r.choice("none", "full", "select"), "none")
        return RecomputeConfig(recompute=mode == "full", select_recompute=mode == "select")
    rc = r.section(data, "recompute_config", "recompute_config")
    p = "recompute_config"
    r.typos(rc, p, _SECTION_KEYS[p])
    setting = r.recompute_setting(stages)
    return RecomputeConfig(
        recompute=r.get(rc, "recompute", f"{p}.recompute", setting, False),
        select_recompute=r.get(rc, "select_recompute", f"{p}.select_recompute", setting, False),
        select_comm_recompute=r.get(rc, "select_comm_recompute", f"{p}.select_comm_recompute", setting, False),
        mp_comm_recompute=r.get(rc, "mp_comm_recompute", f"{p}.mp_comm_recompute", r.boolean, True),
    )


def _read_train(r: _Reader, data: dict) -> TrainConfig:
    runner = r.section(data, "runner_config", "runner_config")
    opt = r.section(data, "optimizer", "optimizer")
    ctx = r.section(data, "context", "context")
    r.typos(runner, "runner_config", _SECTION_KEYS["runner_config"])
    r.typos(ctx, "context", _SECTION_KEYS["context"])
    # the 2.x PyNative layout's ContextConfig defaults max_device_memory to 59GB
    device_default = 59 * 2**30 if isinstance(data.get("parallelism"), dict) else None
    return TrainConfig(
        batch_size=r.get(runner, "batch_size", "runner_config.batch_size", _limited(r, "batch_size"), 1),
        optimizer_type=r.get(opt, "type", "optimizer.type", r.string, None),
        max_device_memory=r.get(ctx, "max_device_memory", "context.max_device_memory", r.mindspore_size,
                                device_default),
        seed=r.get(data, "seed", "seed", r.integer(minimum=0), 0),
        optimizer_swap=r.get(opt, "swap", "optimizer.swap", r.boolean, False),
    )


_MEMOPT_KEYS = {"device", "params", "zero_stage", "grad_dtype", "master_weights", "optimizer_dtype",
                "checkpoint_every", "pool_checkpoint_every", "activation_factor", "pool_mode", "scan_every",
                "compact_every",
                "compact_when_frag_above", "compact_trigger", "watch", "communication", "workspace", "allocator",
                "workload", "train", "timing"}
_DEVICE_KEYS = {"name", "hbm", "cards"}
_COMM_KEYS = {"allreduce_bucket", "reduce_scatter_bucket", "allgather_bucket", "p2p_buffers",
              "alltoall_buffers"}
_ALLOCATOR_KEYS = {f.name for f in dataclasses.fields(AllocatorConfig)}
#: keys accepted and ignored with a note (``memopt.allocator.align``: parsed, never read, now gone)
_RETIRED_ALLOCATOR_KEYS = {"align"}
#: the one alignment every allocator model uses (``allocators/mindspore.ALIGN``, PyTorch's 512 B blocks)
_MODEL_ALIGN = 512
_COMPACT_TRIGGERS = ("forecast", "margin")    # = ms_memopt.simulation.simulate.COMPACT_TRIGGERS (tests/test_simulate.py checks)
_ALLOCATOR_NAMES = ("mindspore", "mindspore_bestfit", "mindspore_vmm", "torch", "torch_expandable", "torch_npu",
                    "torch_npu_expandable", "pool")
_WORKLOAD_KEYS = {f.name for f in dataclasses.fields(WorkloadConfig)}
_SHAPE_CACHE_KEYS = {f.name for f in dataclasses.fields(ShapeCacheConfig)}
_EXTRA_KEYS = {f.name for f in dataclasses.fields(ExtraAllocsConfig)}
_TIMING_KEYS = {f.name for f in dataclasses.fields(TimingConfig)}
_TRAIN_KEYS = {"steps", "learning_rate", "batch_size", "seed", "dataset", "device", "checkpoint_every_steps"}


def _default_optimizer_dtype(optimizer_type: str | None, param_dtype: str) -> str:
    """Adam m/v dtype: MindSpore's ``nn.AdamWeightDecay`` clones the parameters (same dtype);
    ``FP32StateAdamWeightDecay``, other Adam variants and no ``optimizer.type`` keep FP32 states."""
    if optimizer_type is None or "FP32" in optimizer_type.upper():
        return "float32"
    return param_dtype if optimizer_type == "AdamWeightDecay" else "float32"


def _read_memopt(r: _Reader, data: dict, model: ModelConfig, parallel: ParallelConfig,
                 train: TrainConfig, zero_stage: int | None = None, notes: list[str] | None = None) -> MemoptConfig:
    notes = [] if notes is None else notes
    m = r.section(data, "memopt", "memopt")
    r.strict(m, "memopt", _MEMOPT_KEYS)
    pos = r.integer(minimum=1)
    size = r.size()

    dev = r.section(m, "device", "memopt.device")
    r.strict(dev, "memopt.device", _DEVICE_KEYS)
    device = DeviceConfig(
        name=r.get(dev, "name", "memopt.device.name", r.string, "Ascend910B"),
        hbm=r.get(dev, "hbm", "memopt.device.hbm", size, None),
        cards=r.get(dev, "cards", "memopt.device.cards", pos, None),
    )

    comm = r.section(m, "communication", "memopt.communication")
    r.strict(comm, "memopt.communication", _COMM_KEYS)
    zero_size = r.size(positive=False)
    communication = CommunicationConfig(**{
        k: r.get(comm, k, f"memopt.communication.{k}", zero_size, None) for k in sorted(_COMM_KEYS)})

    alloc = r.section(m, "allocator", "memopt.allocator")
    r.strict({k: v for k, v in alloc.items() if k not in _RETIRED_ALLOCATOR_KEYS}, "memopt.allocator",
             _ALLOCATOR_KEYS)
    align = r.get(alloc, "align", "memopt.allocator.align", pos, None)
    if align is not None and align != _MODEL_ALIGN:
        raise InputError(f"got {align}, but this key is gone: every allocator model aligns as the real allocators "
                         f"do ({_MODEL_ALIGN} bytes) and takes no alignment, so {align} would never apply; remove "
                         f"the key", source=r.source, key="memopt.allocator.align")
    if align is not None:
        notes.append(f"memopt.allocator.align is not read (every allocator model aligns to {_MODEL_ALIGN} bytes, "
                     f"as the real allocators do); the key can be removed")
    allocator = AllocatorConfig(
        name=r.get(alloc, "name", "memopt.allocator.name", r.choice(*_ALLOCATOR_NAMES), "mindspore"),
        increase_size=r.get(alloc, "increase_size", "memopt.allocator.increase_size", size, 2**30),
        pregrow=r.get(alloc, "pregrow", "memopt.allocator.pregrow", r.boolean, False),
        init_size=r.get(alloc, "init_size", "memopt.allocator.init_size", size, None),
    )

    watch_raw = m.get("watch") or {}
    if not isinstance(watch_raw, dict):
        raise r.fail("memopt.watch", watch_raw, "a mapping of name -> size, e.g. {allreduce: 4.2GB}")
    watch = {str(name): size(value, f"memopt.watch.{name}") for name, value in watch_raw.items()}

    workload = _read_workload(r, r.section(m, "workload", "memopt.workload"), train, model)
    tr = r.section(m, "train", "memopt.train")
    r.strict(tr, "memopt.train", _TRAIN_KEYS)
    standalone = StandaloneTrainConfig(
        steps=r.get(tr, "steps", "memopt.train.steps", pos, 20),
        learning_rate=r.get(tr, "learning_rate", "memopt.train.learning_rate",
                            r.number(minimum=0, exclusive_min=True), 1e-3),
        batch_size=r.get(tr, "batch_size", "memopt.train.batch_size", pos, 2),
        seed=r.get(tr, "seed", "memopt.train.seed", r.integer(minimum=0), train.seed),
        dataset=r.get(tr, "dataset", "memopt.train.dataset", r.string, "synthetic"),
        device=_DEVICE_NAMES[r.get(tr, "device", "memopt.train.device", r.choice(*_DEVICE_NAMES), "cpu")],
        checkpoint_every_steps=r.get(tr, "checkpoint_every_steps", "memopt.train.checkpoint_every_steps", pos, None),
    )

    zero_default = zero_stage if zero_stage is not None else (1 if parallel.enable_parallel_optimizer else 0)
    # Gradients take the compute dtype, except that FP32 parameters get FP32 gradients
    # (the cast's backward casts them back to the parameter's dtype).
    grad_default = "float32" if model.param_init_type == "float32" else model.compute_dtype
    return MemoptConfig(
        device=device,
        params=r.get(m, "params", "memopt.params", r.count, None),
        zero_stage=r.get(m, "zero_stage", "memopt.zero_stage", r.integer(minimum=0, maximum=3), zero_default),
        grad_dtype=r.get(m, "grad_dtype", "memopt.grad_dtype", r.dtype, grad_default),
        master_weights=r.get(m, "master_weights", "memopt.master_weights", r.boolean, True),
        optimizer_dtype=r.get(m, "optimizer_dtype", "memopt.optimizer_dtype", r.dtype,
                              _default_optimizer_dtype(train.optimizer_type, model.param_init_type)),
        checkpoint_every=r.get(m, "checkpoint_every", "memopt.checkpoint_every", pos, None),
        pool_checkpoint_every=r.get(m, "pool_checkpoint_every", "memopt.pool_checkpoint_every", pos, None),
        activation_factor=r.get(m, "activation_factor", "memopt.activation_factor",
                                r.number(minimum=0, maximum=_MAX_FACTOR, exclusive_min=True), 1.0),
        pool_mode=r.get(m, "pool_mode", "memopt.pool_mode", r.boolean, False),
        scan_every=r.get(m, "scan_every", "memopt.scan_every", pos, 100),
        compact_every=r.get(m, "compact_every", "memopt.compact_every", pos, None),
        compact_when_frag_above=r.get(m, "compact_when_frag_above", "memopt.compact_when_frag_above",
                                      r.number(minimum=0, exclusive_min=True), None),
        compact_trigger=r.get(m, "compact_trigger", "memopt.compact_trigger", r.choice(*_COMPACT_TRIGGERS), None),
        watch=watch,
        communication=communication,
        workspace=r.get(m, "workspace", "memopt.workspace", r.size(positive=False), 2**30),
        allocator=allocator,
        workload=workload,
        train=standalone,
        timing=_read_timing(r, r.section(m, "timing", "memopt.timing")),
    )


#: ``memopt.timing`` keys that are shares of something (0, 1]; the rest are positive rates or
#: non-negative durations
_TIMING_SHARES = {"base_efficiency"}
_TIMING_RATES = {"peak_flops", "hbm_bandwidth", "collective_bandwidth"}


def _read_timing(r: _Reader, t: dict) -> TimingConfig:
    """``memopt.timing``; every default is :class:`TimingConfig`'s (none is written here)."""
    p = "memopt.timing"
    r.strict(t, p, _TIMING_KEYS)
    d = TimingConfig()
    values = {}
    for f in dataclasses.fields(TimingConfig):
        if f.name in _TIMING_SHARES:
            conv = r.number(minimum=0, maximum=1, exclusive_min=True)
        elif f.name in _TIMING_RATES:
            conv = r.number(minimum=0, exclusive_min=True)
        else:
            conv = r.number(minimum=0)
        values[f.name] = r.get(t, f.name, f"{p}.{f.name}", conv, getattr(d, f.name))
    return TimingConfig(**values)


def _read_workload(r: _Reader, w: dict, train: TrainConfig, model: ModelConfig) -> WorkloadConfig:
    """``memopt.workload``; every default is :class:`WorkloadConfig`'s (none is written here)."""
    p = "memopt.workload"
    r.strict(w, p, _WORKLOAD_KEYS)
    d = WorkloadConfig()
    pos = r.integer(minimum=1)
    sc = r.section(w, "shape_cache", f"{p}.shape_cache")
    r.strict(sc, f"{p}.shape_cache", _SHAPE_CACHE_KEYS)
    ea = r.section(w, "extra_allocs", f"{p}.extra_allocs")
    r.strict(ea, f"{p}.extra_allocs", _EXTRA_KEYS)
    buckets_raw = w.get("seq_buckets")
    if buckets_raw is not None and not isinstance(buckets_raw, (list, tuple)):
        raise r.fail(f"{p}.seq_buckets", buckets_raw, "a list of sequence lengths")
    buckets = d.seq_buckets if buckets_raw is None else tuple(
        sorted(pos(v, f"{p}.seq_buckets[{i}]") for i, v in enumerate(buckets_raw)))
    fraction = r.number(minimum=0, maximum=1)
    seq_min, seq_max = seq_range(model.seq_length, r.get(w, "seq_min", f"{p}.seq_min", pos, d.seq_min),
                                 r.get(w, "seq_max", f"{p}.seq_max", pos, d.seq_max))
    workload = WorkloadConfig(
        enabled=r.get(w, "enabled", f"{p}.enabled", r.boolean, d.enabled),
        seed=r.get(w, "seed", f"{p}.seed", r.integer(minimum=0), train.seed),
        steps=r.get(w, "steps", f"{p}.steps", pos, d.steps),
        dynamic_seq=r.get(w, "dynamic_seq", f"{p}.dynamic_seq", r.boolean, d.dynamic_seq),
        seq_distribution=r.get(w, "seq_distribution", f"{p}.seq_distribution",
                               r.choice(*SEQ_DISTRIBUTIONS), d.seq_distribution),
        seq_min=seq_min,
        seq_max=seq_max,
        seq_buckets=buckets,
        seq_align=r.get(w, "seq_align", f"{p}.seq_align", pos, d.seq_align),
        long_tail=r.get(w, "long_tail", f"{p}.long_tail", fraction, d.long_tail),
        shape_cache=ShapeCacheConfig(
            bytes_per_shape=r.get(sc, "bytes_per_shape", f"{p}.shape_cache.bytes_per_shape",
                                  r.size(positive=False), d.shape_cache.bytes_per_shape),
            max_shapes=r.get(sc, "max_shapes", f"{p}.shape_cache.max_shapes", pos, d.shape_cache.max_shapes)),
        extra_allocs=ExtraAllocsConfig(
            probability=r.get(ea, "probability", f"{p}.extra_allocs.probability", fraction,
                              d.extra_allocs.probability),
            size=r.get(ea, "size", f"{p}.extra_allocs.size", r.size(), d.extra_allocs.size),
            lifetime_steps=r.get(ea, "lifetime_steps", f"{p}.extra_allocs.lifetime_steps", pos,
                                 d.extra_allocs.lifetime_steps)),
        comm_jitter=r.get(w, "comm_jitter", f"{p}.comm_jitter", fraction, d.comm_jitter),
        moe_load_cv=r.get(w, "moe_load_cv", f"{p}.moe_load_cv", r.number(minimum=0, maximum=10), d.moe_load_cv),
        template=r.get(w, "template", f"{p}.template", r.template_path, d.template),
        schedule=r.get(w, "schedule", f"{p}.schedule", r.schedule_path, d.schedule),
    )
    if workload.schedule and not workload.template:
        raise r.fail(f"{p}.schedule", w.get("schedule"), f"a schedule only with {p}.template (a step template's dims)")
    if workload.seq_max > model.seq_length:
        raise r.fail(f"{p}.seq_max", workload.seq_max,
                     f"at most model.model_config.seq_length ({model.seq_length})")
    if workload.seq_min > workload.seq_max:
        raise r.fail(f"{p}.seq_min", workload.seq_min, f"at most memopt.workload.seq_max ({workload.seq_max})")
    if buckets and buckets[-1] > model.seq_length:
        raise r.fail(f"{p}.seq_buckets", list(buckets),
                     f"lengths of at most model.model_config.seq_length ({model.seq_length})")
    return workload


def _check_consistency(r: _Reader, recipe: Recipe) -> Recipe:
    """Cross-key checks; returns the recipe with its offsets broadcast to every chunk."""
    model, par, mem = recipe.model, recipe.parallel, recipe.memopt
    t, pp = par.model_parallel, par.pipeline_stage
    if model.num_heads % t:
        raise r.fail("model.model_config.num_heads", model.num_heads,
                     f"a multiple of parallel_config.model_parallel ({t})")
    if model.n_kv_heads % t and t % model.n_kv_heads:
        raise r.fail("model.model_config.n_kv_heads", model.n_kv_heads,
                     f"a multiple or a divisor of parallel_config.model_parallel ({t})")
    if model.intermediate_size % t:
        raise r.fail("model.model_config.intermediate_size", model.intermediate_size,
                     f"a multiple of parallel_config.model_parallel ({t})")
    if model.num_layers < pp:
        raise r.fail("parallel_config.pipeline_stage", pp,
                     f"at most model.model_config.num_layers ({model.num_layers})")
    if model.offset:
        v = model.pp_interleave_num
        rows = model.offset
        if len(rows) == 1 and v > 1:        # one per-stage row applies to every chunk (MindFormers broadcasts)
            rows = rows * v
        if len(rows) != v or any(len(row) != pp for row in rows):
            raise r.fail("model.model_config.offset", [list(row) for row in model.offset],
                         f"a list of {pp} per-stage offsets" + (f" (or {v} such lists, one per "
                                                                 f"pp_interleave_num chunk)" if v > 1 else ""))
        model = dataclasses.replace(model, offset=tuple(rows))
        recipe = dataclasses.replace(recipe, model=model)
        remainder = model.num_layers % (pp * v)
        total = sum(sum(row) for row in rows)
        shown = model.offset if len(model.offset) > 1 else model.offset[0]
        shown = [list(row) for row in shown] if len(model.offset) > 1 else list(shown)
        if total != remainder:
            raise r.fail("model.model_config.offset", shown,
                         f"offsets that sum to num_layers % (pipeline_stage x pp_interleave_num) = "
                         f"{model.num_layers} % {pp * v} = {remainder} (MindFormers' rule)")
        if min(min(row) for row in recipe.chunk_layers()) < 0 or min(recipe.stage_layers()) < 1:
            raise r.fail("model.model_config.offset", shown,
                         "offsets that leave no chunk negative and at least one layer on every stage")
    elif model.num_layers % (pp * model.pp_interleave_num) and pp * model.pp_interleave_num > 1:
        remainder = model.num_layers % (pp * model.pp_interleave_num)
        recipe = dataclasses.replace(recipe, notes=recipe.notes + (
            f"offset 0 (or none) with num_layers % (stages x chunks) = {remainder}: MindFormers 2.0.0 refuses "
            f"this (its LayerSetting asks for offsets summing to {remainder}); planned with one more layer on "
            f"each of the last {remainder} (virtual) stages",))
    moe = model.moe
    if moe is not None:
        ep = par.expert_parallel
        if moe.num_experts % ep:
            raise r.fail("parallel_config.expert_parallel", ep,
                         f"a divisor of the routed experts ({moe.num_experts})")
    if mem.device.cards is not None and mem.device.cards != par.cards:
        raise r.fail("memopt.device.cards", mem.device.cards,
                     f"data_parallel x model_parallel x pipeline_stage = {par.data_parallel} x {t} x {pp}"
                     f" = {par.cards}")
    for key in ("checkpoint_every", "pool_checkpoint_every"):
        k = getattr(mem, key)
        if k is not None and k > max(recipe.stage_layers()):
            raise r.fail(f"memopt.{key}", k, f"at most the layers on a pipeline stage ({max(recipe.stage_layers())})")
    if par.micro_batch_num < pp and pp > 1:
        raise r.fail("parallel_config.micro_batch_num", par.micro_batch_num,
                     f"at least parallel_config.pipeline_stage ({pp}) for 1F1B")
    if (mem.allocator.init_size is not None and recipe.capacity is not None
            and mem.allocator.init_size > recipe.capacity):
        raise r.fail("memopt.allocator.init_size", mem.allocator.init_size,
                     f"at most the card's capacity ({recipe.capacity} bytes)")
    return recipe
