"""A small GPT-style decoder for the demo, the tests and the standalone ``ms-memopt run``.

Token + position embedding, ``num_layers`` pre-LayerNorm blocks (causal self-attention + MLP)
held in an ``nn.CellList`` called ``blocks`` (the Transformer blocks pool mode groups for
recompute), a final LayerNorm and an LM head. :class:`GPTWithLoss` adds next-token
cross-entropy. Everything is initialised from a numpy generator seeded by ``GPTConfig.seed``,
so two models built from one config are identical.

Dtypes: parameters are stored in ``param_dtype`` (default: ``dtype``) and matmuls run in
``dtype``; LayerNorm, softmax and the loss run in float32 (fp16 LayerNorm/softmax lose too
much on CPU). On CPU use ``float32`` or ``float16``; ``bfloat16`` is kept for Ascend (many CPU
kernels lack bf16).

Example:
    >>> cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64)
    >>> net = GPTWithLoss(GPT(cfg))                                   # doctest: +SKIP
    >>> ds = synthetic_dataset(cfg, batch_size=4, num_batches=10)     # doctest: +SKIP
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

__all__ = ["GPTConfig", "GPT", "GPTBlock", "GPTWithLoss", "synthetic_dataset", "synthetic_batches",
           "activation_bytes_per_block"]

_DTYPES = {"float32": ms.float32, "fp32": ms.float32, "float16": ms.float16, "fp16": ms.float16,
           "bfloat16": ms.bfloat16, "bf16": ms.bfloat16}


def _ms_dtype(name: str):
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _cast(x, dtype, current):
    """``x.astype(dtype)`` unless ``current`` (known when the model is built) is already it.

    Every cast is a kernel launch in PyNative, so the ones known to be no-ops are skipped.
    """
    return x if current == dtype else x.astype(dtype)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``"float16"`` -> 2)."""
    return 4 if _ms_dtype(name) == ms.float32 else 2


@dataclass
class GPTConfig:
    """Size and precision of :class:`GPT`.

    Args:
        num_layers: Transformer blocks.
        hidden_size: model width; a multiple of ``num_heads``.
        num_heads: attention heads.
        seq_length: tokens per sample.
        vocab_size: token ids are in ``[0, vocab_size)``.
        intermediate_size: MLP width (default ``4 * hidden_size``).
        dtype: compute dtype: ``float32``/``float16`` on CPU, ``bfloat16`` on Ascend.
        param_dtype: parameter storage dtype (default: ``dtype``).
        seed: seed of the parameter initialisation.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    intermediate_size: int | None = None
    dtype: str = "float32"
    param_dtype: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        # None stays None (not filled in) so that replacing hidden_size or dtype in
        # ``GPTConfig(**{**cfg.to_dict(), ...})`` moves the derived values with it.
        _ms_dtype(self.dtype), _ms_dtype(self.storage_dtype)
        for name in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")

    @property
    def ffn_size(self) -> int:
        """MLP width: ``intermediate_size`` or ``4 * hidden_size``."""
        return 4 * self.hidden_size if self.intermediate_size is None else self.intermediate_size

    @property
    def storage_dtype(self) -> str:
        """Parameter dtype: ``param_dtype`` or ``dtype``."""
        return self.dtype if self.param_dtype is None else self.param_dtype

    def to_dict(self) -> dict:
        return asdict(self)


class _Init:
    """Deterministic initialiser: one numpy generator walked in construction order."""

    def __init__(self, seed: int, dtype) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype

    def normal(self, shape, std: float, name: str) -> Parameter:
        data = self.rng.normal(0.0, std, size=shape).astype(np.float32)
        return Parameter(Tensor(data).astype(self.dtype), name=name)

    def const(self, shape, value: float, name: str) -> Parameter:
        return Parameter(Tensor(np.full(shape, value, np.float32)).astype(self.dtype), name=name)


class _Linear(nn.Cell):
    """``y = x @ W.T + b`` with W stored ``(out, in)`` in the parameter dtype, computed in ``dtype``."""

    def __init__(self, init: _Init, n_in: int, n_out: int, compute_dtype, std: float) -> None:
        super().__init__()
        self.weight = init.normal((n_out, n_in), std, "weight")
        self.bias = init.const((n_out,), 0.0, "bias")
        self.compute_dtype = compute_dtype
        self.param_dtype = init.dtype

    def construct(self, x):
        # dense() takes W as (out, in) directly: no transposed view, so the gradient of W
        # comes out contiguous.
        cdt, pdt = self.compute_dtype, self.param_dtype
        return ops.dense(x, _cast(self.weight, cdt, pdt), _cast(self.bias, cdt, pdt))


class _LayerNorm(nn.Cell):
    """LayerNorm over the last axis, computed in float32, returned in ``dtype``."""

    def __init__(self, init: _Init, n: int, compute_dtype, eps: float = 1e-5) -> None:
        super().__init__()
        self.gamma = init.const((n,), 1.0, "gamma")
        self.beta = init.const((n,), 0.0, "beta")
        self.compute_dtype = compute_dtype
        self.param_dtype = init.dtype
        # One fused kernel (CPU has it for float32) instead of ~10 elementwise ops.
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)

    def construct(self, x):
        f32, cdt, pdt = ms.float32, self.compute_dtype, self.param_dtype
        y, _, _ = self.norm(_cast(x, f32, cdt), _cast(self.gamma, f32, pdt), _cast(self.beta, f32, pdt))
        return _cast(y, cdt, f32)


class GPTBlock(nn.Cell):
    """Pre-LN decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; shape-preserving."""

    def __init__(self, config: GPTConfig, init: _Init) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_size
        cdt = _ms_dtype(config.dtype)
        proj_std = 0.02 / math.sqrt(2 * config.num_layers)
        self.num_heads = config.num_heads
        self.head_dim = h // config.num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.compute_dtype = cdt
        self.ln1 = _LayerNorm(init, h, cdt)
        self.qkv = _Linear(init, h, 3 * h, cdt, 0.02)
        self.proj = _Linear(init, h, h, cdt, proj_std)
        self.ln2 = _LayerNorm(init, h, cdt)
        self.fc1 = _Linear(init, h, f, cdt, 0.02)
        self.fc2 = _Linear(init, f, h, cdt, proj_std)
        s = config.seq_length
        # Additive causal mask, float32, broadcast over batch and heads.
        self.causal_mask = Tensor(np.triu(np.full((s, s), -1e9, np.float32), k=1))

    def _attention(self, x):
        b, s, h = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.num_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = _cast(ops.matmul(q, k.swapaxes(-1, -2)), ms.float32, self.compute_dtype) * self.scale
        scores = scores + self.causal_mask[:s, :s]
        probs = _cast(ops.softmax(scores, -1), self.compute_dtype, ms.float32)
        out = ops.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, h)
        return self.proj(out)

    def construct(self, x):
        x = x + self._attention(self.ln1(x))
        x = x + self.fc2(ops.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x


class GPT(nn.Cell):
    """GPT-style decoder: ``input_ids (B, S) int32 -> logits (B, S, vocab) float32``.

    ``self.blocks`` is the ``nn.CellList`` of :class:`GPTBlock` that pool mode groups.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        init = _Init(config.seed, _ms_dtype(config.storage_dtype))
        cdt = _ms_dtype(config.dtype)
        self.compute_dtype = cdt
        self.param_dtype = init.dtype
        self.tok_embedding = init.normal((config.vocab_size, config.hidden_size), 0.02, "tok_embedding")
        self.pos_embedding = init.normal((config.seq_length, config.hidden_size), 0.01, "pos_embedding")
        self.blocks = nn.CellList([GPTBlock(config, init) for _ in range(config.num_layers)])
        self.ln_f = _LayerNorm(init, config.hidden_size, cdt)
        self.head = init.normal((config.vocab_size, config.hidden_size), 0.02, "head")
        self.positions = Tensor(np.arange(config.seq_length, dtype=np.int32))

    def construct(self, input_ids):
        s = input_ids.shape[1]
        x = ops.gather(self.tok_embedding, input_ids, 0) + ops.gather(self.pos_embedding, self.positions[:s], 0)
        x = _cast(x, self.compute_dtype, self.param_dtype)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = ops.dense(x, _cast(self.head, self.compute_dtype, self.param_dtype))
        return _cast(logits, ms.float32, self.compute_dtype)


class GPTWithLoss(nn.Cell):
    """``(input_ids, labels) -> mean next-token cross-entropy`` (float32 scalar)."""

    def __init__(self, network: GPT) -> None:
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, input_ids, labels):
        logits = self.network(input_ids)
        vocab = logits.shape[-1]
        return ops.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))


def synthetic_batches(config: GPTConfig, batch_size: int, num_batches: int, seed: int = 0):
    """Seeded token batches ``(input_ids, labels)`` as int32 numpy arrays of shape (B, S).

    Tokens follow a fixed random permutation (``next = perm[cur]``) with 20% uniform noise,
    so the loss can fall below ``ln(vocab)``; ``labels`` are ``input_ids`` shifted by one.
    """
    rng = np.random.default_rng(seed)
    perm = rng.permutation(config.vocab_size)
    s = config.seq_length
    for _ in range(num_batches):
        tokens = np.empty((batch_size, s + 1), np.int64)
        tokens[:, 0] = rng.integers(0, config.vocab_size, batch_size)
        noise = rng.random((batch_size, s)) < 0.2
        random_next = rng.integers(0, config.vocab_size, (batch_size, s))
        for t in range(s):
            tokens[:, t + 1] = np.where(noise[:, t], random_next[:, t], perm[tokens[:, t]])
        yield tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def synthetic_dataset(config: GPTConfig, batch_size: int, num_batches: int, seed: int = 0):
    """A ``mindspore.dataset.GeneratorDataset`` of :func:`synthetic_batches` (already batched).

    Columns ``input_ids`` and ``labels``; same seed, same batches (single worker, no shuffle).
    """
    import mindspore.dataset as ds

    batches = list(synthetic_batches(config, batch_size, num_batches, seed))
    return ds.GeneratorDataset(batches, column_names=["input_ids", "labels"], shuffle=False,
                               num_parallel_workers=1)


def activation_bytes_per_block(config: GPTConfig, batch_size: int) -> int:
    """Bytes one :class:`GPTBlock` keeps for backward (our own accounting, not measured).

    Counted per token: LN inputs/outputs, qkv, attention output, proj in/out, MLP in/hidden/
    gelu out, in the compute dtype; attention scores and probabilities (float32 scores,
    compute-dtype probabilities) per head per key. LayerNorm statistics are ignored.
    """
    b, s, h, f = batch_size, config.seq_length, config.hidden_size, config.ffn_size
    e = dtype_bytes(config.dtype)
    per_token = (2 * h + 3 * h + h + 2 * h + h + 2 * f + h)  # ln1 in/out, qkv, attn out, ln2 in/out, fc1 in, fc1 out+gelu, fc2 in
    scores = config.num_heads * s * s * (4 + e)
    return b * s * per_token * e + b * scores
