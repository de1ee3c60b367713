"""What a training job is made of, as the callbacks find it: the forward network, the training
cell around it and the optimizer.

``Model.train`` hands callbacks ``cb_params.train_network`` (a train-one-step cell: network with
loss + optimizer) and ``cb_params.optimizer``. Under MindFormers' ``Trainer`` the optimizer is
passed inside the wrapper (``MFTrainOneStepCell``), so ``cb_params.optimizer`` is ``None`` and
the wrapper's ``optimizer`` attribute holds it; the wrapper's parameters then include the
optimizer's states (``adam_m``, ``adam_v``) and its counters (``global_step``, ``scale_sense``),
which are no gradients. :func:`training_parts` tells the pieces apart.

Example:
    >>> parts = training_parts(run_context.original_args())          # doctest: +SKIP
    >>> sum(p.size for p in parts.network.trainable_params())        # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspore import nn

__all__ = ["TrainingParts", "training_parts", "split_training_cell", "is_outside_forward"]


@dataclass
class TrainingParts:
    """The cells of one training job (any may be ``None``).

    Attributes:
        network: the forward network (with its loss), whose trainable parameters get gradients.
        train_network: the cell a step runs (the network itself when there is no wrapper).
        optimizer: the optimizer, wherever it was found.
    """

    network: Any
    train_network: Any
    optimizer: Any


def split_training_cell(cell: Any, optimizer: Any = None) -> TrainingParts:
    """Split a train-one-step cell (``nn.TrainOneStepCell``, MindFormers' ``MFTrainOneStepCell``,
    anything with ``network`` and ``optimizer`` Cell attributes) into its parts; a plain network
    is its own forward network. ``optimizer`` wins over the wrapper's when given."""
    if cell is None:
        return TrainingParts(None, None, optimizer)
    inner = getattr(cell, "network", None)
    wrapped_optimizer = getattr(cell, "optimizer", None)
    if isinstance(inner, nn.Cell) and isinstance(wrapped_optimizer, nn.Optimizer):
        return TrainingParts(inner, cell, optimizer if optimizer is not None else wrapped_optimizer)
    return TrainingParts(cell, cell, optimizer)


def training_parts(cb_params: Any) -> TrainingParts:
    """The parts of the job a ``Model.train`` callback sees (``run_context.original_args()``)."""
    cell = getattr(cb_params, "train_network", None) or getattr(cb_params, "network", None)
    return split_training_cell(cell, getattr(cb_params, "optimizer", None))


def is_outside_forward(cell: Any) -> bool:
    """True for Cells a training cell holds that are no part of the forward pass: optimizers
    and learning-rate schedules (MindFormers' wrapper calls its schedule every step)."""
    return isinstance(cell, (nn.Optimizer, nn.learning_rate_schedule.LearningRateSchedule))
