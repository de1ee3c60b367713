"""Trace readers: every format becomes a :class:`~ms_memopt.events.Trace`."""
