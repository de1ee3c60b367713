"""Train a small decoder step by step (PyNative, launch_blocking) at given sequence lengths,
marking each step with its dims (``mark_step(seq=S, batch=B)``), for ``ms-memopt record``.

    python bench/workloads/template_run.py --model gpt --seqs 16,16,24,24 --batch 4

``--model gpt``: the demo GPT (ms_memopt.mindspore.model). ``--model gqa``: a decoder defined
here, not in the package: RMSNorm, grouped-query attention (4 query heads sharing 2 key/value
heads), SwiGLU MLP, no position embedding. ``--model llama``: MindFormers' ``LlamaForCausalLM``
(tiny: 4 heads, intermediate 2 x hidden, vocab ``--vocab``; mindformers 2.0.0, its missing
``hyper_parallel`` the import-only stand-in of tests/mindformers_support). ``--model gpt-train``:
the demo GPT through ``Model.train`` (a dataset of one batch per ``--seqs`` length,
``StepMarkCallback`` marking the steps). ``--batches 4,2,...`` varies the batch too.
``--dims seq,batch,hidden,layers`` names the dims each step mark carries (default ``seq,batch``):
``hidden`` and ``layers`` are constant within a run (one process per value), so a template
learned over runs at several of them can be asked for another. ``--warmup SEQ`` runs one step
before the setup mark, so the weights and optimizer states fall in the prologue.
"""
import argparse
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_memopt.mindspore import mark_step
from ms_memopt.mindspore.pool_log_source import wait_for_queued_ops


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


def _llama(args):
    """MindFormers' LLaMA, tiny, on CPU (the keys tests/mindformers_support/mf_cpu.py sets)."""
    if importlib.util.find_spec("hyper_parallel") is None:      # mindformers imports it; not on PyPI
        sys.path.append(str(Path(__file__).resolve().parents[2] / "tests" / "mindformers_support"))
    # MindFormers' switch for eager (PyNative) runs: the causal mask is then sliced to each step's length
    import os
    os.environ.setdefault("ENFORCE_EAGER", "true")
    from mindformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(batch_size=args.batch, seq_length=args.max_seq, hidden_size=args.hidden,
                      num_layers=args.layers, num_heads=4, vocab_size=args.vocab, multiple_of=16,
                      intermediate_size=2 * args.hidden, rms_norm_eps=1e-5, compute_dtype="float32",
                      layernorm_compute_type="float32", softmax_compute_type="float32", rotary_dtype="float32",
                      param_init_type="float32", use_past=False, use_flash_attention=False,
                      fused_rms_norm=False, use_rope_slice=True)
    return LlamaForCausalLM(cfg)


class _LlamaLoss(nn.Cell):
    """``LlamaForCausalLM`` computes its own loss from ``input_ids`` (shifted) and ``labels``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, labels):
        return self.model(ids, labels)


def _model_train(args, seqs, batches, train_net_parts) -> None:
    """``Model.train`` over one batch per step, marked by ``StepMarkCallback``."""
    import mindspore.dataset as ds
    from mindspore.train import Model

    from ms_memopt.mindspore import StepMarkCallback
    net, opt = train_net_parts
    rng = np.random.default_rng(args.seed + 1)
    rows = [rng.integers(0, args.vocab, (b, s + 1)).astype(np.int32) for s, b in zip(seqs, batches)]
    data = ds.GeneratorDataset([(r[:, :-1], r[:, 1:]) for r in rows], column_names=["input_ids", "labels"],
                               shuffle=False, num_parallel_workers=1)
    dims = lambda ctx: _marked(args, int(ctx.original_args().train_dataset_element[0].shape[1]),
                               int(ctx.original_args().train_dataset_element[0].shape[0]))
    Model(net, optimizer=opt).train(1, data, callbacks=[StepMarkCallback(dims)], dataset_sink_mode=False)


def _marked(args, seq: int, batch: int) -> dict:
    """The dims of one step mark, those ``--dims`` names (``seq``, ``batch``, ``hidden``, ``layers``)."""
    values = {"seq": seq, "batch": batch, "hidden": args.hidden, "layers": args.layers}
    return {name: values[name] for name in args.dims.split(",")}


def _write_truth(path: str, params, states) -> None:
    """What the model holds for its weights and AdamWeightDecay's two states per weight, in bytes."""
    import json
    nbytes = lambda ts: sum(int(np.prod(t.shape)) * t.itemsize for t in ts)    # noqa: E731
    Path(path).write_text(json.dumps({"parameters": {"count": len(params), "bytes": nbytes(params)},
                                      "optimizer": {"count": len(states), "bytes": nbytes(states)}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("gpt", "gqa", "llama", "gpt-train"), default="gpt")
    ap.add_argument("--seqs", required=True, help="comma-separated sequence length per step")
    ap.add_argument("--batches", default=None, help="comma-separated batch per step (default: --batch)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0, metavar="SEQ",
                    help="one training step at this length before the setup mark (default: none)")
    ap.add_argument("--dims", default="seq,batch", help="the dims each step mark carries (of seq,batch,hidden,layers)")
    ap.add_argument("--max-seq", type=int, default=128, help="the GPT's position table (longer than every --seqs)")
    ap.add_argument("--truth", default=None, metavar="FILE.json",
                    help="write the model's trainable parameters and the optimizer's states (count, bytes) here: "
                         "what the purposes learned from the recording's lifetimes are checked against")
    args = ap.parse_args()
    if not set(args.dims.split(",")) <= {"seq", "batch", "hidden", "layers"}:
        ap.error(f"--dims: expected names of seq,batch,hidden,layers, got {args.dims}")
    seqs = [int(s) for s in args.seqs.split(",")]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch] * len(seqs)
    ms.set_seed(args.seed)
    ms.runtime.launch_blocking()
    if args.model in ("gpt", "gpt-train"):
        from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss
        cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=4,
                        seq_length=args.max_seq, vocab_size=args.vocab)
        net = GPTWithLoss(GPT(cfg))
    elif args.model == "llama":
        net = _LlamaLoss(_llama(args))
    else:
        net = GQADecoder(vocab=args.vocab, hidden=args.hidden, layers=args.layers, seed=args.seed)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    if args.truth:
        _write_truth(args.truth, net.trainable_params(), list(opt.moments1) + list(opt.moments2))
    if args.model == "gpt-train":
        _model_train(args, seqs, batches, (net, opt))
        return
    train = nn.TrainOneStepCell(net, opt)
    train.set_train(True)
    rng = np.random.default_rng(args.seed + 1)
    if args.warmup:
        # a warm-up step before the setup mark: the weights and optimizer states are then made
        # in the prologue (MindSpore creates them at their first use), not in the first step
        tokens = rng.integers(0, args.vocab, (args.batch, args.warmup + 1)).astype(np.int32)
        out = train(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
        wait_for_queued_ops()
        del out
    mark_step()                                   # the setup ends here
    for seq, batch in zip(seqs, batches):
        tokens = rng.integers(0, args.vocab, (batch, seq + 1)).astype(np.int32)
        ids, labels = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
        out = train(ids, labels)
        # drop the step's tensors and the previous loss only once MindSpore's queued work is
        # done: ``loss = train(...)`` frees the previous loss while the pipeline still runs this
        # step's tail, at a point that changes from run to run
        wait_for_queued_ops()
        loss = out
        del out, ids, labels
        mark_step(**_marked(args, seq, batch))
    print("loss", float(loss.asnumpy()))


if __name__ == "__main__":
    main()
