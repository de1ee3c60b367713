"""The demo GPT: determinism, shapes, dtypes, the synthetic dataset."""
from __future__ import annotations

import math

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402

from ms_memopt.mindspore.model import (GPT, GPTConfig, GPTWithLoss, activation_bytes_per_block,  # noqa: E402
                                       synthetic_batches, synthetic_dataset)

pytestmark = pytest.mark.mindspore

TINY = GPTConfig(num_layers=2, hidden_size=16, num_heads=2, seq_length=8, vocab_size=32)


def _values(net):
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def test_same_seed_same_model_other_seed_differs():
    a, b = _values(GPT(TINY)), _values(GPT(TINY))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = _values(GPT(GPTConfig(**{**TINY.to_dict(), "seed": 1})))
    assert not np.array_equal(a["blocks.0.qkv.weight"], c["blocks.0.qkv.weight"])


def test_parameter_names_are_unique_and_blocks_are_a_celllist():
    net = GPT(TINY)
    names = [p.name for p in net.trainable_params()]
    assert len(names) == len(set(names)) == 3 + 2 + 12 * TINY.num_layers
    assert isinstance(net.blocks, nn.CellList) and len(net.blocks) == TINY.num_layers


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_forward_shapes_dtypes_and_initial_loss(dtype):
    cfg = GPTConfig(**{**TINY.to_dict(), "dtype": dtype})
    net = GPT(cfg)
    assert all(p.dtype == (ms.float32 if dtype == "float32" else ms.float16) for p in net.trainable_params())
    x, y = next(synthetic_batches(cfg, 3, 1))
    logits = net(Tensor(x))
    assert logits.shape == (3, cfg.seq_length, cfg.vocab_size) and logits.dtype == ms.float32
    loss = float(GPTWithLoss(net)(Tensor(x), Tensor(y)).asnumpy())
    # Small initial weights: close to the uniform-prediction loss.
    assert abs(loss - math.log(cfg.vocab_size)) < 0.1


def test_causal_mask_future_tokens_do_not_change_the_past():
    net = GPT(TINY)
    x, _ = next(synthetic_batches(TINY, 1, 1))
    y = x.copy()
    y[0, -1] = (y[0, -1] + 1) % TINY.vocab_size
    a, b = net(Tensor(x)).asnumpy(), net(Tensor(y)).asnumpy()
    np.testing.assert_allclose(a[0, :-1], b[0, :-1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[0, -1], b[0, -1])


def test_synthetic_batches_are_seeded_and_shifted():
    a = list(synthetic_batches(TINY, 4, 3, seed=2))
    b = list(synthetic_batches(TINY, 4, 3, seed=2))
    c = list(synthetic_batches(TINY, 4, 3, seed=3))
    assert all(np.array_equal(p[0], q[0]) for p, q in zip(a, b))
    assert not np.array_equal(a[0][0], c[0][0])
    x, y = a[0]
    assert x.shape == y.shape == (4, TINY.seq_length) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert x.min() >= 0 and x.max() < TINY.vocab_size


def test_synthetic_dataset_yields_the_same_batches():
    ds = synthetic_dataset(TINY, 4, 3, seed=2)
    assert ds.get_col_names() == ["input_ids", "labels"]
    rows = list(ds.create_tuple_iterator(output_numpy=True))
    expected = list(synthetic_batches(TINY, 4, 3, seed=2))
    assert len(rows) == 3
    for (x, y), (ex, ey) in zip(rows, expected):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_config_validation():
    with pytest.raises(ValueError):
        GPTConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError):
        GPTConfig(dtype="int8")
    with pytest.raises(ValueError):
        GPTConfig(num_layers=0)
    assert GPTConfig(hidden_size=32).ffn_size == 128
    assert GPTConfig(dtype="float16").storage_dtype == "float16"


def test_activation_accounting_scales_with_batch_and_dtype():
    one = activation_bytes_per_block(TINY, 1)
    assert activation_bytes_per_block(TINY, 4) == 4 * one
    half = activation_bytes_per_block(GPTConfig(**{**TINY.to_dict(), "dtype": "float16"}), 1)
    assert half < one
