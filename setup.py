"""Build of the compiled fast path (everything else is in pyproject.toml).

``ms_memopt.allocators._fastpool`` is plain C against the CPython API: a fresh machine needs
only gcc and the Python headers, no extra package. See ms_memopt/allocators/fast.py.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ms_memopt.allocators._fastpool", ["ms_memopt/allocators/_fastpool.c"],
                             extra_compile_args=["-O2"])])
