"""What MindFormers 2.0.0's classic Trainer needs to train on CPU, for ms-memopt's tests.

Not ms-memopt's concern and not part of the package: MindFormers targets Ascend.

* ``CPUTrainOneStepCell``: ``MFTrainOneStepCell`` whose overflow check does not use the NPU
  float-status registers (MindSpore's ``NPUGetFloatStatusV2`` has no CPU kernel): a step
  overflows when a gradient holds a non-finite value. Registered with MindFormers'
  registry as a wrapper, so a YAML names it as ``runner_wrapper: {type: CPUTrainOneStepCell}``.
* :func:`cpu_overrides`: the model keys a LLaMA needs on CPU (``fused_rms_norm=False``,
  ``use_rope_slice=True``) and the device target.
"""
from __future__ import annotations

from mindspore import Tensor, ops
from mindspore.common import dtype as mstype
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.wrapper import MFTrainOneStepCell

__all__ = ["CPUTrainOneStepCell", "cpu_overrides"]


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class CPUTrainOneStepCell(MFTrainOneStepCell):
    """``MFTrainOneStepCell`` with an ``isfinite`` overflow check (CPU has no NPU status registers)."""

    def start_overflow_check(self, pre_cond, compute_input):
        return Tensor([0] * 8, mstype.int32), compute_input

    def get_overflow_status(self, status, compute_output):
        finite = [ops.isfinite(grad).all() for grad in compute_output]
        return ops.logical_not(ops.stack(finite).all())   # mint.stack has no CPU kernel


def cpu_overrides(config) -> None:
    """Set, in a ``MindFormerConfig``, what MindFormers' LLaMA needs to train on CPU."""
    config.context.device_target = "CPU"
    config.runner_wrapper.type = "CPUTrainOneStepCell"
    config.model.model_config.fused_rms_norm = False
    config.model.model_config.use_rope_slice = True
