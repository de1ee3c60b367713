"""Simulation: many training steps of a job under the policies, on every rank stream.

:mod:`~ms_memopt.simulation.spec` reads a recipe (or a bare template) once into the job's whole
specification (:class:`~ms_memopt.simulation.spec.JobSpec`: rank streams, workloads, the simulator's
config, timing); nothing below it reads the recipe again. :mod:`~ms_memopt.simulation.simulate` holds
the policies (``POLICIES``: baseline, compact, pool), :mod:`~ms_memopt.simulation.pool_sizing` pool
mode's region sizes, :mod:`~ms_memopt.simulation.timing` the time model,
:mod:`~ms_memopt.simulation.job` the job of many ranks, :mod:`~ms_memopt.simulation.sweep` a grid of
settings, :mod:`~ms_memopt.simulation.executors` where tasks run (local processes, Dask, Ray) and
:mod:`~ms_memopt.simulation.snapshots` which layouts to keep.

May import: ``core``, ``io``, ``config``, ``allocators``, ``native``, ``analysis``, ``replay``,
``workload``, ``templates``.
"""
