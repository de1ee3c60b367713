"""PyNative 2-layer MLP with nn.Adam (the pool log fidelity workload; bench/fidelity.py)."""
import sys

import numpy as np
import mindspore as ms
from mindspore import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
ms.set_seed(0)
rng = np.random.default_rng(0)
net = nn.SequentialCell(nn.Dense(64, 128), nn.ReLU(), nn.Dense(128, 10))
opt = nn.Adam(net.trainable_params(), 1e-3)
loss_fn = nn.CrossEntropyLoss()
grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
for step in range(steps):
    x = ms.Tensor(rng.standard_normal((16, 64)).astype(np.float32))
    y = ms.Tensor(rng.integers(0, 10, 16).astype(np.int32))
    loss, grads = grad_fn(x, y)
    opt(grads)
    print(f"ms-memopt step {step + 1}", file=sys.stderr, flush=True)
print("loss", float(loss.asnumpy()))
