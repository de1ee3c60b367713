"""Train a small decoder step by step (PyNative, launch_blocking) at given sequence lengths,
marking each step with its dims (``mark_step(seq=S, batch=B)``), for ``ms-memopt record``.

    python bench/workloads/template_run.py --model gpt --seqs 16,16,24,24 --batch 4

``--model gpt``: the demo GPT (ms_memopt.mindspore.model). ``--model gqa``: a decoder defined
here, not in the package: RMSNorm, grouped-query attention (4 query heads sharing 2 key/value
heads), SwiGLU MLP, no position embedding. ``--batches 4,2,...`` varies the batch too.
"""
import argparse
import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_memopt.mindspore import mark_step


class RMSNorm(nn.Cell):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(n, np.float32)), name="weight")
        self.eps = eps

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight


class GQABlock(nn.Cell):
    def __init__(self, rng, hidden, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        w = lambda *shape: Parameter(Tensor(rng.normal(0, 0.02, shape).astype(np.float32)))
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.wq = w(hidden, hidden)
        self.wkv = w(hidden, 2 * kv_heads * self.head_dim)
        self.wo = w(hidden, hidden)
        self.w_gate, self.w_up, self.w_down = w(hidden, ffn), w(hidden, ffn), w(ffn, hidden)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def construct(self, x):
        b, s, h = x.shape
        y = self.norm1(x)
        q = ops.matmul(y, self.wq).reshape(b, s, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        kv = ops.matmul(y, self.wkv).reshape(b, s, 2, self.kv_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        rep = self.heads // self.kv_heads
        k, v = ops.repeat_interleave(kv[0], rep, 1), ops.repeat_interleave(kv[1], rep, 1)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale
        mask = ops.triu(ops.ones((s, s), ms.float32), 1) * -1e9
        probs = ops.softmax(scores + mask, -1)
        out = ops.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, h)
        x = x + ops.matmul(out, self.wo)
        y = self.norm2(x)
        return x + ops.matmul(ops.silu(ops.matmul(y, self.w_gate)) * ops.matmul(y, self.w_up), self.w_down)


class GQADecoder(nn.Cell):
    def __init__(self, vocab=256, hidden=64, heads=4, kv_heads=2, layers=2, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.embed = Parameter(Tensor(rng.normal(0, 0.02, (vocab, hidden)).astype(np.float32)), name="embed")
        self.blocks = nn.CellList([GQABlock(rng, hidden, heads, kv_heads, int(hidden * 8 / 3) // 8 * 8)
                                   for _ in range(layers)])
        self.norm = RMSNorm(hidden)

    def construct(self, ids, labels):
        x = ops.gather(self.embed, ids, 0)
        for block in self.blocks:
            x = block(x)
        logits = ops.matmul(self.norm(x), self.embed.T)
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("gpt", "gqa"), default="gpt")
    ap.add_argument("--seqs", required=True, help="comma-separated sequence length per step")
    ap.add_argument("--batches", default=None, help="comma-separated batch per step (default: --batch)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seq", type=int, default=128, help="the GPT's position table (longer than every --seqs)")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch] * len(seqs)
    ms.set_seed(args.seed)
    ms.runtime.launch_blocking()
    if args.model == "gpt":
        from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss
        cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                        seq_length=args.max_seq, vocab_size=args.vocab)
        net = GPTWithLoss(GPT(cfg))
    else:
        net = GQADecoder(vocab=args.vocab, hidden=args.hidden, layers=args.layers, seed=args.seed)
    train = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3))
    train.set_train(True)
    rng = np.random.default_rng(args.seed + 1)
    mark_step()                                   # the setup ends here
    for seq, batch in zip(seqs, batches):
        tokens = rng.integers(0, args.vocab, (batch, seq + 1)).astype(np.int32)
        loss = train(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
        mark_step(seq=seq, batch=batch)
    print("loss", float(loss.asnumpy()))


if __name__ == "__main__":
    main()
