"""Step marks with the step's dimensions, for step templates learned from recordings.

Call :func:`mark_step` once before the training loop (no dims: the setup ends here) and at
the end of every training step with the integer dims that shape it::

    from ms_memopt.mindspore import mark_step
    mark_step()                          # setup (weights, optimizer states) done
    for tokens in batches:
        loss = train(tokens[:, :-1], tokens[:, 1:])
        mark_step(seq=tokens.shape[1] - 1, batch=tokens.shape[0])

Each call first waits for MindSpore's queued work
(:func:`~ms_memopt.mindspore.pool_log_source.wait_for_queued_ops`), so every allocation of the
step has reached the pool (and its log) before the mark. Under ``ms-memopt record``
(``MS_MEMOPT_RECORD=1``) it then writes one stderr line, ``ms-memopt step N seq=32 batch=4``,
which the pool-log reader turns into a ``step`` event with ``tag="dims:seq=32,batch=4"``
(docs/events.md); ``N`` counts the calls with dims from 1 (the setup mark is ``step 0``).
In a process that follows its own pool log (:mod:`ms_memopt.mindspore.poolcapture`, what
``ms-memopt run`` does) the line goes to that log instead. Elsewhere nothing is written. ``ms-memopt learn`` builds a step template from such
recordings (docs/simulation.md, "Templates learned from recordings").

With ``Model.train`` use :class:`StepMarkCallback`.
"""
from __future__ import annotations

import os
import re

from ms_memopt.analysis.scan import RECORD_STEP, write_record_line

__all__ = ["mark_step", "StepMarkCallback", "format_step_line", "reset_step_count"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}$")
_count = 0


def format_step_line(step: int, dims: dict[str, int]) -> str:
    """The recorded line: ``ms-memopt step 3 seq=32 batch=4`` (dims in the order given).

    Example:
        >>> format_step_line(3, {"seq": 32, "batch": 4})
        'ms-memopt step 3 seq=32 batch=4'
    """
    for name, value in dims.items():
        if not _NAME.match(name):
            raise ValueError(f"dim names are identifiers of up to 64 characters, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            try:                          # numpy integers, 0-d integer arrays
                import operator
                value = operator.index(value)
            except TypeError:
                raise TypeError(f"dim {name} must be an integer, got {value!r}") from None
            dims[name] = value
    return " ".join([f"{RECORD_STEP} {step}"] + [f"{k}={v}" for k, v in dims.items()])


def reset_step_count() -> None:
    """Start counting steps from 1 again (tests)."""
    global _count
    _count = 0


def mark_step(**dims: int) -> int:
    """Mark the end of a training step shaped by ``dims`` (``mark_step(seq=32, batch=4)``), or
    with no dims the end of the setup; returns the step number written (0 for the setup mark).

    Raises:
        TypeError: a dim that is not an integer; ValueError: a name that is not an identifier.
    """
    global _count
    dims = dict(dims)
    if dims:
        step = _count + 1
        line = format_step_line(step, dims)     # validate before counting
        _count = step
    else:
        step, line = 0, f"{RECORD_STEP} 0"
    from ms_memopt.mindspore.pool_log_source import wait_for_queued_ops

    wait_for_queued_ops()
    if os.environ.get("MS_MEMOPT_RECORD"):
        write_record_line(line)
    elif _capturing():      # this process's own pool log (ms-memopt run): file descriptor 2 is its file
        os.write(2, (line + "\n").encode())
    return step


def _capturing() -> bool:
    from ms_memopt.mindspore import poolcapture

    return poolcapture.active() is not None


def _callback_base():
    from mindspore.train.callback import Callback

    return Callback


class StepMarkCallback(_callback_base()):
    """``Model.train`` callback: :func:`mark_step` at train begin (setup mark) and at every
    step end with ``dims_fn(run_context)``'s dims (a dict of integers). It holds each step's
    outputs until the next step's end (after MindSpore's queued work), so they are freed at
    the same place in every run (docs/simulation.md, "Fidelity, measured").

    Example:
        >>> cb = StepMarkCallback(lambda ctx: {"seq": 32, "batch": 4})       # doctest: +SKIP
        >>> model.train(1, dataset, callbacks=[cb], dataset_sink_mode=False)  # doctest: +SKIP
    """

    def __init__(self, dims_fn) -> None:
        super().__init__()
        if not callable(dims_fn):
            raise TypeError("dims_fn must be callable: run_context -> {name: int}")
        self.dims_fn = dims_fn
        self._held = None

    def on_train_begin(self, run_context) -> None:
        mark_step()

    def on_train_step_end(self, run_context) -> None:
        dims = dict(self.dims_fn(run_context))
        # Model.train replaces a step's outputs as soon as the next step's network call returns,
        # while MindSpore's pipeline still runs that step's tail: they would be freed at a point
        # that changes from run to run. Held here, they are freed at the next step's end, once
        # its queued work is done, before its mark: the same place in every run.
        from ms_memopt.mindspore.pool_log_source import wait_for_queued_ops

        wait_for_queued_ops()
        args = getattr(run_context, "original_args", None)
        self._held = getattr(args(), "net_outputs", None) if callable(args) else None
        mark_step(**dims)

    def on_train_end(self, run_context) -> None:
        self._held = None
