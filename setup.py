"""Build of the compiled parts (everything else is in pyproject.toml):

* ``ms_memopt.native._lib``: plain C loaded with ctypes (no Python API; any C compiler): the
  compaction copy and the AdamW pass (``ms_memopt/native``) and the planner's exact search
  (``ms_memopt/planner/_search.c``, loaded by ``ms_memopt/planner/_native.py``);
* ``ms_memopt.allocators._fastpool``: the allocator models' fast path, plain C against the
  CPython API (gcc and the Python headers, no extra package; ms_memopt/allocators/fast.py).

Without a compiler the install still succeeds and the package runs its pure-Python references
(a warning says so).
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class _OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as error:  # no compiler: the pure-Python references run instead
            self.warn(f"compiled parts not built ({error}); using the pure-Python paths")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:
            self.warn(f"{ext.name} not built ({error}); using the pure-Python paths")

    def get_export_symbols(self, ext):
        if ext.name == "ms_memopt.native._lib":
            return []  # a ctypes library, not a Python module: no PyInit_ symbol
        return super().get_export_symbols(ext)


setup(
    ext_modules=[
        Extension(
            "ms_memopt.native._lib",
            sources=["ms_memopt/native/move_runs.c", "ms_memopt/native/adamw.c", "ms_memopt/planner/_search.c"],
            # no FMA contraction: the vector and scalar code of adamw.c give the same bits
            extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off"],
            libraries=["m"],
        ),
        Extension("ms_memopt.allocators._fastpool", ["ms_memopt/allocators/_fastpool.c"],
                  extra_compile_args=["-O2"]),
    ],
    cmdclass={"build_ext": _OptionalBuildExt},
)
