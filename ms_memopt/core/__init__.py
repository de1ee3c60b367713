"""The data model every layer shares: sizes, errors, layouts, metrics, events, the pool-mode plan.

Nothing here imports MindSpore, a trace format or an allocator. ``units`` parses and prints sizes
(bytes inside, human units at the edges), ``errors`` holds :class:`~ms_memopt.core.errors.InputError`
(what bad input raises: file, line or key, and what was expected), ``layout`` and ``metrics`` are a
moment of device memory and the fragmentation figures of it, ``events`` the allocation stream and
its one row codec (``FIELDS``), ``poolplan`` pool mode's fixed regions.
"""
