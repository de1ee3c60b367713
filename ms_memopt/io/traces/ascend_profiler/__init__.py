"""The Ascend profiler's memory output (torch_npu's and MindSpore's ``profile_memory=True``), one module a concern.

* :mod:`~ms_memopt.io.traces.ascend_profiler.reader`: a rank's folder, ``ASCEND_PROFILER_OUTPUT/``,
  one of its CSV files or its ``.db`` -> :class:`~ms_memopt.core.events.Trace` (detection helpers too);
* :mod:`~ms_memopt.io.traces.ascend_profiler.db`: the SQLite export's memory tables;
* :mod:`~ms_memopt.io.traces.ascend_profiler.timeline`: rows -> one event stream per component;
* :mod:`~ms_memopt.io.traces.ascend_profiler.steps`: the ``ProfilerStep#N`` markers;
* :mod:`~ms_memopt.io.traces.ascend_profiler.writer`: events -> a rank's folder as the profilers write it.

The reader's public names are importable from here, as they were from the flat module.

Example:
    >>> from ms_memopt.io.traces.ascend_profiler import OUTPUT_DIR, profiler_file_kind
    >>> OUTPUT_DIR, profiler_file_kind("Component,Timestamp(us),Total Allocated(MB),Total Reserved(MB)")
    ('ASCEND_PROFILER_OUTPUT', 'memory_record')
"""
from __future__ import annotations

from ms_memopt.io.traces.ascend_profiler import reader
from ms_memopt.io.traces.ascend_profiler.reader import (
    FORMAT,
    MEMORY_RECORD,
    NPU_MODULE_MEM,
    OPERATOR_MEMORY,
    OUTPUT_DIR,
    is_profiler_dir,
    is_sqlite,
    profiler_file_kind,
    profiler_size,
    read_ascend_profiler,
    read_step_marks,
    stream_ascend_profiler,
)

__all__ = list(reader.__all__)
