"""A jit-compiled train step (ms.jit) with varying batch sizes and a few long-lived tensors."""
import sys

import numpy as np
import mindspore as ms
from mindspore import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
ms.set_seed(0)
rng = np.random.default_rng(1)
net = nn.SequentialCell(nn.Dense(32, 96), nn.GELU(), nn.Dense(96, 96), nn.GELU(), nn.Dense(96, 8))
opt = nn.Adam(net.trainable_params(), 1e-3)
loss_fn = nn.MSELoss()


def forward(x, y):
    return loss_fn(net(x), y)


grad_fn = ms.value_and_grad(forward, None, opt.parameters)


@ms.jit
def train_step(x, y):
    loss, grads = grad_fn(x, y)
    opt(grads)
    return loss


kept = []
for step in range(steps):
    rows = (8, 24, 16)[step % 3]
    x = ms.Tensor(rng.standard_normal((rows, 32)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((rows, 8)).astype(np.float32))
    loss = train_step(x, y)
    if step % 10 == 0:
        kept.append(net(x))              # long-lived outputs
    print(f"ms-memopt step {step + 1}", file=sys.stderr, flush=True)
print("loss", float(loss.asnumpy()))
