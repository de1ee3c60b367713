"""The demo GPT trained step by step (PyNative) with a new sequence length every step."""
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
ms.set_seed(0)
rng = np.random.default_rng(2)
cfg = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
net = GPTWithLoss(GPT(cfg))
train = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3))
train.set_train(True)
for step in range(steps):
    seq = int(rng.integers(2, 9)) * 4                  # 8..32 tokens, a multiple of 4
    tokens = rng.integers(0, cfg.vocab_size, (4, seq + 1)).astype(np.int32)
    loss = train(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
    print(f"ms-memopt step {step + 1}", file=sys.stderr, flush=True)
print("loss", float(loss.asnumpy()))
