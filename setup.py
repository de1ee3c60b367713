"""Build of the one compiled part: ``ms_memopt.native._lib``, plain C loaded with ctypes.

Everything else is in pyproject.toml. The C code uses no Python API, so the library builds
with any C compiler (gcc here) and needs no headers beyond libc's. Without a compiler the
install still succeeds and the package runs its pure-Python references (a warning says so).
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class _OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as error:  # no compiler: the pure-Python references run instead
            self.warn(f"ms_memopt.native not built ({error}); using the pure-Python paths")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:
            self.warn(f"ms_memopt.native not built ({error}); using the pure-Python paths")

    def get_export_symbols(self, ext):
        return []  # a ctypes library, not a Python module: no PyInit_ symbol


setup(
    ext_modules=[Extension(
        "ms_memopt.native._lib",
        sources=["ms_memopt/native/move_runs.c", "ms_memopt/native/adamw.c"],
        # no FMA contraction: the vector and scalar code of adamw.c give the same bits
        extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off"],
    )],
    cmdclass={"build_ext": _OptionalBuildExt},
)
