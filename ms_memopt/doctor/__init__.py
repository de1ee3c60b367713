"""Doctor: is it fragmentation, what pins the hole, and which setting saves the run.

:mod:`~ms_memopt.doctor.diagnose` gives the verdict on a recording, its blockers and the remedies
replayed and ranked.

May import every layer before it: ``core`` to ``simulation``.
"""
