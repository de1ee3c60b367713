"""Step templates: a model's training step learned from recordings, and generated at new shapes.

:mod:`~ms_memopt.templates.template` learns and generates a template (``learn``, ``generate``,
the step classes and size polynomials); :mod:`~ms_memopt.templates.layers` the repeated block count
(layers); :mod:`~ms_memopt.templates.draws` the distinct layouts of a template's free orders;
:mod:`~ms_memopt.templates.drawn` a free order no calibration process drew, read from a first step;
:mod:`~ms_memopt.templates.workload` a template as the simulator's workload.

May import: ``core``, ``io``, ``config``, ``allocators``, ``native``, ``analysis``, ``replay``,
``workload``.
"""
