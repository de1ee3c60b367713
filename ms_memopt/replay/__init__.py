"""Replay: recorded or generated events driven through one allocator model.

Holds the one event loop (:mod:`~ms_memopt.replay.loop`, ``drive``: every driver feeds its events
through it), :mod:`~ms_memopt.replay.replay` (a trace through a model, with address fidelity and the
default model of each recording), :mod:`~ms_memopt.replay.whatif` (a recording under the simulator's
policies) and :mod:`~ms_memopt.replay.pool_log_check` (a run's own pool log, replayed once when it ends).

May import: ``core``, ``io``, ``config``, ``allocators``, ``native``, ``analysis``.
"""
