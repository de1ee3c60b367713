"""Pool mode for MindSpore Cells: recompute every k blocks, contiguous regions, one plan.

``enable_pool_mode(network, optimizer=None, checkpoint_every=6)`` does three things and returns
the :class:`~ms_memopt.core.poolplan.PoolPlan` it followed:

1. **Recompute groups.** It finds the Transformer blocks (the longest run of consecutive
   cells of one class inside a ``CellList``/``SequentialCell``, or the ``blocks`` given), puts
   each run of ``k`` consecutive blocks into one :class:`RecomputeGroup` and calls
   ``.recompute()`` on it: backward keeps only each group's input and recomputes the inside.
   The group takes the place of its first block in the container and the other places get
   a :class:`Passthrough`, so a parent that loops over the container or indexes it by layer
   number still runs every block once, in order. Parameter names do not change.
2. **Contiguous regions.** Parameters are moved, by dtype, into contiguous buffers
   (``combine_tensor_list_contiguous``) that live for the whole job. With a
   :class:`~ms_memopt.mindspore.fused_adamw.FusedAdamW` optimizer its regions are used
   (parameters by dtype, a flat gradient buffer, flat fp32 m/v/master in parameter order).
3. **The activation region** is sized for the largest recompute group (see
   :func:`activation_bytes`). On Ascend's best-fit pool the plan is reserved up front with
   ``ms.runtime.set_memory(init_size=...)`` when that can still work (before the pool's first
   allocation, and only if nothing called ``set_memory`` yet); otherwise the plan's notes say
   why not and what to do instead (:func:`reserve_pool`). Under VMM nothing is reserved.

Blocks must take the hidden state as first input and return one tensor of the same shape;
extra inputs, positional or keyword (masks, position ids, MindFormers LLaMA's
``batch_valid_length=``), are passed to every block of a group unchanged.

Example:
    >>> net = GPT(GPTConfig(num_layers=12))                                   # doctest: +SKIP
    >>> plan = enable_pool_mode(net, checkpoint_every=6, batch_size=8)       # doctest: +SKIP
    >>> plan.region("activations").size                                     # doctest: +SKIP
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import mindspore as ms
from mindspore import nn
from mindspore.hal.contiguous_tensors_handle import combine_tensor_list_contiguous

from ms_memopt.analysis.estimate import layer_activation_bytes, layer_input_bytes, recompute_group_bytes
from ms_memopt.config.recipe import ModelConfig, recipe_from_dict
from ms_memopt.core.errors import InputError
from ms_memopt.core.poolplan import PoolPlan
from ms_memopt.mindspore.pool_info import detect_pool
from ms_memopt.mindspore.regions import pin

__all__ = ["enable_pool_mode", "RecomputeGroup", "Passthrough", "find_blocks", "activation_bytes",
           "ActivationEstimate", "reserve_pool", "memory_settings", "gpt_activation_estimator", "layer_model_config",
           "config_activation_estimator"]

_GB = 1024 ** 3


class RecomputeGroup(nn.Cell):
    """Runs consecutive blocks in order; recomputed as one unit in backward.

    ``first_index`` is the container slot of the first block. Parameter names are restored by
    :func:`enable_pool_mode` after the blocks are re-registered here.
    """

    def __init__(self, blocks: Sequence[nn.Cell], first_index: int) -> None:
        super().__init__(auto_prefix=False)
        self.first_index = first_index
        self.layers = nn.CellList(list(blocks), auto_prefix=False)

    def construct(self, x, *args, **kwargs):
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x


class Passthrough(nn.Cell):
    """Holds a place in the block container; returns its first input (the block moved into a group)."""

    def __init__(self, index: int) -> None:
        super().__init__(auto_prefix=False)
        self.index = index

    def construct(self, x, *args, **kwargs):
        return x


@dataclass
class ActivationEstimate:
    """Bytes of activations kept for backward with recompute groups of ``group_size`` blocks.

    The per-block numbers come from the caller (for the demo GPT: the per-layer formulas of
    :mod:`ms_memopt.analysis.estimate`, see :func:`gpt_activation_estimator`); they are composed by
    :func:`ms_memopt.analysis.estimate.recompute_group_bytes`, the formula ``ms-memopt plan`` uses for
    ``memopt.checkpoint_every``.

    Attributes:
        per_block: bytes one block keeps for backward without recompute.
        boundary: bytes of one block input (what a recompute group keeps).
        num_blocks: blocks in the network.
        group_size: blocks per recompute group (0 = no recompute).
        without_recompute: ``num_blocks * per_block``.
        with_recompute: ``num_groups * boundary + group_size * per_block`` (the kept group
            inputs plus the one group being recomputed at a time).
    """

    per_block: int
    boundary: int
    num_blocks: int
    group_size: int
    without_recompute: int = 0
    with_recompute: int = 0

    def __post_init__(self) -> None:
        self.without_recompute = self.num_blocks * self.per_block
        if self.group_size <= 0:
            self.with_recompute = self.without_recompute
        else:
            self.with_recompute = recompute_group_bytes(self.num_blocks, self.group_size, self.per_block,
                                                        self.boundary)

    @property
    def ratio(self) -> float:
        """``with_recompute / without_recompute`` (about 1/k for many blocks)."""
        return self.with_recompute / self.without_recompute if self.without_recompute else 1.0


def activation_bytes(per_block: int, boundary: int, num_blocks: int, group_size: int) -> ActivationEstimate:
    """Activation bytes with and without recompute groups of ``group_size`` blocks.

    Example:
        >>> e = activation_bytes(per_block=1000, boundary=50, num_blocks=12, group_size=6)
        >>> e.without_recompute, e.with_recompute
        (12000, 6100)
    """
    return ActivationEstimate(int(per_block), int(boundary), int(num_blocks), int(group_size))


def find_blocks(network: nn.Cell, blocks: Sequence[nn.Cell] | None = None):
    """Locate the Transformer blocks: returns ``(container, [indices])``.

    Without ``blocks``: the longest run (>= 2) of consecutive cells of one class inside any
    ``CellList``/``SequentialCell`` of ``network``. With ``blocks``: the container that
    holds them, consecutively and in order.

    Raises:
        ValueError: no such run, or ``blocks`` are not consecutive members of one container.
    """
    best = None
    for _, cell in network.cells_and_names():
        if not isinstance(cell, (nn.CellList, nn.SequentialCell)):
            continue
        children = list(cell)
        if blocks is not None:
            ids = [id(c) for c in children]
            try:
                first = ids.index(id(blocks[0]))
            except ValueError:
                continue
            indices = list(range(first, first + len(blocks)))
            if indices[-1] < len(children) and all(children[i] is b for i, b in zip(indices, blocks)):
                return cell, indices
            raise ValueError("the given blocks are not consecutive, in order, in one CellList/SequentialCell")
        start = 0
        for i in range(1, len(children) + 1):
            if i == len(children) or type(children[i]) is not type(children[start]):
                if i - start >= 2 and (best is None or i - start > len(best[1])):
                    best = (cell, list(range(start, i)))
                start = i
    if blocks is not None:
        raise ValueError("the given blocks are not in any CellList/SequentialCell of the network")
    if best is None:
        raise ValueError("no run of >= 2 consecutive cells of one class in a CellList/SequentialCell; "
                         "pass blocks= explicitly")
    return best


def _apply_recompute(container, indices: list[int], k: int) -> list[list[int]]:
    """Replace runs of k blocks by recomputed groups (in place); returns the groups' indices."""
    names = {id(p): p.name for p in container.get_parameters()}
    groups = [indices[i:i + k] for i in range(0, len(indices), k)]
    children = list(container)
    for group in groups:
        cell = RecomputeGroup([children[i] for i in group], group[0])
        cell.recompute()
        container[group[0]] = cell
        for i in group[1:]:
            container[i] = Passthrough(i)
    # Re-registering cells may prefix parameter names; checkpoints need the old ones.
    for p in container.get_parameters():
        if id(p) in names:
            p.name = names[id(p)]
    return groups


def _combine_parameters(network: nn.Cell) -> dict[str, int]:
    """Move trainable parameters, grouped by dtype, into contiguous buffers; bytes per dtype."""
    by_dtype: dict[str, list] = {}
    for p in network.trainable_params():
        by_dtype.setdefault(_dtype_name(p.dtype), []).append(p)
    sizes = {}
    handles = []
    for name, params in by_dtype.items():
        handle = combine_tensor_list_contiguous(params, True)
        pin(*params)
        handles.append(handle)
        sizes[f"parameters.{name}"] = int(handle.total_padding_size)
    # The handles only describe the buffers (parameters keep them alive); kept for inspection.
    network._pool_mode_handles = handles
    return sizes


def _align(nbytes: int, alignment: int) -> int:
    return -(-int(nbytes) // alignment) * alignment if alignment > 1 else int(nbytes)


def _itemsize(dtype) -> int:
    return 4 if dtype == ms.float32 else 2


def _dtype_name(dtype) -> str:
    return {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}.get(dtype, str(dtype))


def layer_model_config(config) -> ModelConfig:
    """The estimator's view (:class:`ms_memopt.config.recipe.ModelConfig`) of a demo ``GPTConfig``.

    The demo block is a plain GPT block: multi-head attention (no GQA, no flash attention),
    an un-gated GeLU MLP of ``ffn_size``, no dropout; LayerNorm and softmax run in float32.

    Example:
        >>> layer_model_config(GPTConfig(hidden_size=64)).intermediate_size    # doctest: +SKIP
        256
    """
    return ModelConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                       num_heads=config.num_heads, n_kv_heads=config.num_heads,
                       seq_length=config.seq_length, vocab_size=config.vocab_size,
                       intermediate_size=config.ffn_size, ffn_gated=False, compute_dtype=config.dtype,
                       param_init_type=config.param_dtype or config.dtype,
                       layernorm_compute_type="float32", use_flash_attention=False,
                       hidden_dropout=False, attention_dropout=False)


def gpt_activation_estimator(config) -> Callable[[int], tuple[int, int]]:
    """``f(batch_size) -> (per_block_bytes, boundary_bytes)`` for a demo ``GPTConfig``.

    Both numbers come from the recipe estimator (:mod:`ms_memopt.analysis.estimate`), so pool mode and
    ``ms-memopt plan`` use one per-layer formula: ``layer_activation_bytes`` (what a block
    keeps for backward without recompute) and ``layer_input_bytes`` (the block input a
    recompute group keeps).

    Example:
        >>> per_block, boundary = gpt_activation_estimator(GPTConfig())(8)    # doctest: +SKIP
    """
    return _layer_estimator(layer_model_config(config), config.seq_length)


def _layer_estimator(model: ModelConfig, seq: int) -> Callable[[int], tuple[int, int]]:
    """``f(batch_size) -> (layer_activation_bytes, layer_input_bytes)`` of ``model`` at ``seq`` tokens."""
    def estimator(batch_size: int) -> tuple[int, int]:
        shape = dict(seq=seq, micro_batch=int(batch_size))
        return layer_activation_bytes(model, **shape), layer_input_bytes(model, **shape)

    return estimator


def config_activation_estimator(config) -> Callable[[int], tuple[int, int]]:
    """``f(batch_size) -> (per_block_bytes, boundary_bytes)`` for a model described by a
    MindFormers model config (``LlamaConfig`` and the other ``PretrainedConfig``s: anything
    with ``to_dict()``, or a mapping).

    The config's flat keys are read by the recipe reader (legacy, Hugging Face and Megatron
    spellings, ``model_type`` defaults: :mod:`ms_memopt.config.mfconfig`), then the same per-layer
    formulas as :func:`gpt_activation_estimator` apply, at the config's ``seq_length``.

    Raises:
        InputError: the config lacks a key the estimator needs (the message names it).

    Example:
        >>> estimator = config_activation_estimator(model.config)        # doctest: +SKIP
        >>> per_block, boundary = estimator(2)                             # doctest: +SKIP
    """
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    # nested sections (parallel_config, moe_config, ...) are not the dense layer's shape
    flat = {k: v for k, v in values.items() if v is None or isinstance(v, (int, float, str, bool))}
    model = recipe_from_dict({"model": {"model_config": flat}}, source=type(config).__name__).model
    return _layer_estimator(model, model.seq_length)


def _default_estimator(network: nn.Cell) -> Callable[[int], tuple[int, int]] | None:
    """The demo GPT's estimator, else one from a MindFormers model's ``config``, else None."""
    from ms_memopt.mindspore.model import GPT
    gpt = next((c for _, c in network.cells_and_names() if isinstance(c, GPT)), None)
    if gpt is not None:
        return gpt_activation_estimator(gpt.config)
    config = getattr(network, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):
        try:
            return config_activation_estimator(config)
        except InputError as exc:   # not a shape the estimator knows: the caller warns
            warnings.warn(f"enable_pool_mode: cannot estimate activations from {type(config).__name__}: {exc}",
                          UserWarning, stacklevel=3)
    return None


#: the MindSpore settings ``set_memory`` writes, as ``get_context`` names them and as
#: ``set_memory`` takes them: a call passes every one, read back first, so none is reset
_MEMORY_SETTINGS = (("memory_optimize_level", "optimize_level"), ("max_device_memory", "max_size"),
                    ("mempool_block_size", "increase_size"))


def memory_settings() -> dict[str, object]:
    """The job's memory settings as ``ms.get_context`` reads them (``memory_optimize_level``,
    ``max_device_memory``, ``mempool_block_size``): what no ms-memopt call may change."""
    return {key: ms.get_context(key) for key, _ in _MEMORY_SETTINGS}


def _set_memory_arguments(init_size: str, optimize_level: str | None) -> dict[str, str]:
    """``set_memory``'s arguments: ``init_size`` and every other one as the job has it now
    (``set_memory`` writes its own default for each argument not given: a plain
    ``set_memory(init_size=...)`` after ``set_context(memory_optimize_level="O1")`` read 0 back,
    which turns SOMAS off for every graph compiled afterwards)."""
    current = memory_settings()
    level = current["memory_optimize_level"]
    kwargs = {"init_size": init_size,
              "increase_size": _gb(current["mempool_block_size"]),
              "max_size": _gb(current["max_device_memory"]),
              "optimize_level": optimize_level or ("O1" if str(level) in ("1", "O1") else "O0")}
    return kwargs


def _gb(value: object) -> str:
    """A context memory value (a float in GB, or ``"20GB"``) as ``set_memory`` takes it."""
    text = str(value).strip().upper()
    number = float(text[:-2]) if text.endswith("GB") else float(text)
    return f"{number:g}GB"


def _memory_configured() -> bool:
    """Whether ``set_memory`` was called in this process already (MindSpore allows one call;
    MindFormers' ``build_context`` makes it when the config has ``max_device_memory``)."""
    try:
        from mindspore._c_expression import RuntimeConf
        return bool(RuntimeConf.get_instance().is_memory_configured())
    except (ImportError, AttributeError):      # another release: set_memory itself will say
        return False


def _pool_started() -> bool:
    """Whether the device pool has made its first allocation: it reads ``init_size`` once, then
    (``std::call_once`` in the Ascend pool's ``GetInstance``), so a later ``set_memory`` reserves
    nothing. ``memory_reserved`` is 0 until then (and always on CPU)."""
    try:
        return int(ms.runtime.memory_reserved()) > 0
    except Exception:
        return False


_HOW_TO_RESERVE = ("reserve in the launch script instead, before the first tensor and before MindFormers builds "
                   "its context: ms.runtime.set_memory(init_size={init!r}, increase_size=..., max_size=..., "
                   "optimize_level=...) with every argument your job uses (set_memory can be called once and "
                   "writes its default for any argument left out; MindFormers' context keys max_device_memory, "
                   "mempool_block_size and memory_optimize_level reach set_memory but have no init_size)")


def reserve_pool(plan: PoolPlan, *, headroom: float = 0.0, optimize_level: str | None = None,
                 force: bool = False, pool=None) -> str:
    """Reserve the plan's regions up front through ``ms.runtime.set_memory(init_size=...)``,
    or say why that cannot work in this job. Never changes a setting the job made.

    The reservation is ``2 * plan.total * (1 + headroom)``: the Ascend pool's ``Initialize``
    splits ``init_size`` in half, persistent and common. It is refused (and the returned text
    says what to do instead) when:

    * the device is not Ascend (unless ``force``): CPU's pool ignores ``init_size``;
    * the pool maps memory on demand (VMM): it does not use ``init_size`` at all;
    * ``set_memory`` was already called (by the launch script or MindFormers' context);
    * the pool has already allocated: it reads ``init_size`` once, at its first allocation.

    Otherwise every other ``set_memory`` argument is passed as the job has it now, and the
    settings are read back afterwards.

    Args:
        plan: the plan to reserve for.
        headroom: extra fraction on top of ``plan.total`` (workspace the plan does not know).
        optimize_level: ``"O1"`` asks graph mode for static (SOMAS) reuse; default: unchanged.
        pool: a :class:`~ms_memopt.mindspore.pool_info.PoolInfo` (default: detected).

    Returns:
        What was done, for the plan's notes: starts with ``"reserved"`` or ``"not reserved"``.
    """
    pool = pool or detect_pool()
    gb = max(2.0 * plan.total * (1.0 + headroom) / _GB, 1.0 / 1024)
    init = f"{math.ceil(gb * 1000) / 1000:.3f}GB"
    if pool.device != "Ascend" and not force:
        return f"not reserved: device {pool.device} (set_memory's init_size only shapes the Ascend pool)"
    if pool.vmm and not force:
        return (f"not reserved: the VMM pool maps memory on demand and does not use init_size ({pool.basis}); "
                "nothing to reserve")
    if _memory_configured():
        return "not reserved: set_memory was already called in this process; " + _HOW_TO_RESERVE.format(init=init)
    if _pool_started():
        return ("not reserved: the device pool has already allocated, and it reads init_size only at its first "
                "allocation; " + _HOW_TO_RESERVE.format(init=init))
    before = memory_settings()
    kwargs = _set_memory_arguments(init, optimize_level)
    try:
        ms.runtime.set_memory(**kwargs)
    except (RuntimeError, ValueError) as exc:
        return f"not reserved: set_memory refused ({exc}); " + _HOW_TO_RESERVE.format(init=init)
    after = memory_settings()
    changed = {k: (before[k], after[k]) for k in before if str(before[k]) != str(after[k])
               and not (k == "memory_optimize_level" and optimize_level)}
    if changed:   # a MindSpore release whose set_memory writes more than it takes: say so loudly
        warnings.warn(f"reserve_pool: set_memory changed {changed}", RuntimeWarning, stacklevel=2)
    return f"reserved: set_memory({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def enable_pool_mode(network: nn.Cell, optimizer: nn.Optimizer | None = None, checkpoint_every: int = 6,
                     blocks: Sequence[nn.Cell] | None = None, *, batch_size: int = 1,
                     activation_estimator: Callable[[int], tuple[int, int]] | None = None,
                     communication_bytes: int = 0, workspace_bytes: int = 0, alignment: int = 512,
                     combine_parameters: bool = True, reserve: bool | str = "auto",
                     optimize_level: str | None = None) -> PoolPlan:
    """Switch ``network`` to pool mode and return the plan (see the module docstring).

    Args:
        network: the model (or the model-with-loss) holding the Transformer blocks.
        optimizer: its optimizer; a ``FusedAdamW`` provides the parameter, gradient and
            optimizer regions. Other optimizers: the optimizer region is estimated as AdamW
            (fp32 m and v, plus an fp32 master for low-precision parameters).
        checkpoint_every: blocks per recompute group ``k``; 0 or None disables recompute.
        blocks: the blocks to group, when the automatic search would pick the wrong ones.
        batch_size: samples per step, for the activation estimate.
        activation_estimator: ``f(batch_size) -> (per_block_bytes, boundary_bytes)``.
            Default, when ``network`` contains a demo ``GPT``: :func:`gpt_activation_estimator`
            (the per-layer formulas of :mod:`ms_memopt.analysis.estimate`); when ``network.config`` is a
            MindFormers model config (``LlamaForCausalLM``): :func:`config_activation_estimator`.
            Without one, the activation region is 0 bytes and a warning says so.
        communication_bytes, workspace_bytes: sizes of those regions.
        alignment: region alignment in bytes.
        combine_parameters: move parameters into per-dtype contiguous buffers (skipped when a
            ``FusedAdamW`` already did it).
        reserve: ``"auto"`` reserves on Ascend only, ``True`` always tries, ``False`` never.
        optimize_level: passed to ``set_memory`` when reserving (``"O1"``: static reuse in graph mode).

    Returns:
        The :class:`PoolPlan`; ``plan.notes`` has the recompute groups, the activation
        estimate with and without recompute, and what was reserved.
    """
    from ms_memopt.mindspore.fused_adamw import FusedAdamW

    if getattr(network, "_pool_plan", None) is not None:
        raise ValueError("pool mode is already enabled on this network")
    container, indices = find_blocks(network, blocks)
    k = int(checkpoint_every or 0)
    groups = _apply_recompute(container, indices, k) if k > 0 else []

    if activation_estimator is None:
        activation_estimator = _default_estimator(network)
    if activation_estimator is not None:
        per_block, boundary = activation_estimator(batch_size)
    else:
        per_block, boundary = 0, 0
        warnings.warn("enable_pool_mode: no activation_estimator for this network (built in only for the demo "
                      "GPT and models with a MindFormers config), so the activation region is 0 bytes and "
                      "nothing is reserved for "
                      "activations; pass activation_estimator=f(batch_size) -> (per_block_bytes, "
                      "boundary_bytes)", UserWarning, stacklevel=2)
    estimate = activation_bytes(per_block, boundary, len(indices), k)

    pool = detect_pool()
    fused = isinstance(optimizer, FusedAdamW)
    params = list(network.trainable_params())
    if fused:
        sizes = dict(optimizer.region_bytes())
    else:
        # from the shapes, aligned as the device aligns each tensor: the reservation must come
        # before anything is allocated, so before the parameters are combined
        sizes = {}
        for p in params:
            key = f"parameters.{_dtype_name(p.dtype)}"
            sizes[key] = sizes.get(key, 0) + _align(p.size * _itemsize(p.dtype), alignment)
        sizes["gradients"] = sum(p.size * _itemsize(p.dtype) for p in params)
        # AdamW-like state: fp32 m and v, plus an fp32 master for low-precision parameters.
        sizes["optimizer"] = sum(p.size * (8 if p.dtype == ms.float32 else 12) for p in params)
    sizes["activations"] = estimate.with_recompute
    if communication_bytes:
        sizes["communication"] = int(communication_bytes)
    if workspace_bytes:
        sizes["workspace"] = int(workspace_bytes)
    notes = {
        "checkpoint_every": k,
        "num_blocks": len(indices),
        "recompute_groups": groups,
        "activation_per_block": estimate.per_block,
        "activation_boundary": estimate.boundary,
        "activation_without_recompute": estimate.without_recompute,
        "activation_with_recompute": estimate.with_recompute,
        "activation_ratio": estimate.ratio,
        "batch_size": batch_size,
        "device": pool.device,
        "pool": pool.to_dict(),
    }
    if reserve is True or (reserve == "auto" and pool.device == "Ascend"):
        reservation = reserve_pool(PoolPlan.build(sizes, alignment, rings=("activations",)),
                                   optimize_level=optimize_level, force=reserve is True, pool=pool)
    else:
        reservation = f"not reserved (reserve={reserve!r}, device {pool.device})"
    if not fused and combine_parameters:
        sizes.update(_combine_parameters(network))      # the regions as they came out
    notes["reservation"] = reservation
    plan = PoolPlan.build(sizes, alignment, rings=("activations",), notes=notes)
    network._pool_plan = plan
    return plan
