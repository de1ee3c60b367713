"""Model.train of the demo GPT (2 layers, hidden 64) on synthetic tokens, AdamWeightDecay."""
import sys

import mindspore as ms
from mindspore import nn
from mindspore.train import Callback, Model

from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_dataset

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
ms.set_seed(0)
cfg = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
net = GPTWithLoss(GPT(cfg))
opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)


class StepMark(Callback):
    def on_train_step_end(self, run_context):
        print(f"ms-memopt step {run_context.original_args().cur_step_num}", file=sys.stderr, flush=True)


Model(net, optimizer=opt).train(1, synthetic_dataset(cfg, 4, steps), callbacks=[StepMark()],
                                dataset_sink_mode=False)
