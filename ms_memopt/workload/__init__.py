"""The hand-made training step: one step's allocation and free events from a workload spec.

:mod:`~ms_memopt.workload.step` holds :class:`~ms_memopt.workload.step.WorkloadSpec` (the simulator's
form of a recipe's model, parallelism and sequence rules) and
:class:`~ms_memopt.workload.step.StepWorkload` (its events, step by step). A recipe becomes a spec in
:mod:`ms_memopt.simulation.spec`, the one place the recipe is read for a simulation.

May import: ``core``, ``io``, ``config``, ``allocators``, ``native``, ``analysis``, ``replay``.
"""
