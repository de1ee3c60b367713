"""Reading and writing files: our JSON and YAML dialects and every trace format (``traces``).

Readers turn a file into :mod:`ms_memopt.core` records and raise
:class:`~ms_memopt.core.errors.InputError` naming the file and line on bad input; nothing here
drives an allocator model.
"""
