"""Build of the compiled parts (everything else is in pyproject.toml):

* ``ms_memopt.native._lib``: plain C loaded with ctypes (no Python API; any C compiler): the
  compaction copy and the AdamW pass (``ms_memopt/native``) and the planner's exact search
  (``ms_memopt/analysis/planner/_search.c``, loaded by ``ms_memopt/analysis/planner/_native.py``);
* ``ms_memopt.allocators.fast._fastpool``: the allocator models' fast path, plain C against the
  CPython API (gcc and the Python headers, no extra package; ms_memopt/allocators/fast/__init__.py),
  one module from one C file per model, the shared code and the run loop (fast/fastpool.h);
* ``ms_memopt.io.traces._pickle_scan``: the pickle nesting guard of snapshot reading, plain C against
  the CPython API (``ms_memopt/io/traces/_pickle_scan.c``).

Without a compiler the install still succeeds and the package runs its pure-Python references
(a warning says so).

Each library carries the sha256 of the C sources it was built from (``MS_MEMOPT_SOURCE_HASH``,
computed by ``ms_memopt/core/_build_hash.py``, which also lists the sources); the loaders compare it
with the tree's sources and refuse a stale library, so editing a ``.c`` without rebuilding runs
the pure-Python references with a warning instead of testing the old build. The hash covers
every ``.c`` and ``.h`` listed (headers are ``depends`` here: hashed and watched, not compiled).
"""
import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_ms_memopt_build_hash", _here / "ms_memopt" / "core" / "_build_hash.py")
build_hash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_hash)
build_hash.ROOT = _here


def _hash_macro(name: str) -> list:
    """The source hash of extension ``name`` as a C string macro."""
    return [("MS_MEMOPT_SOURCE_HASH", f'"{build_hash.source_hash(build_hash.EXTENSIONS[name])}"')]


def _compiled(name: str) -> list:
    """The ``.c`` files of extension ``name`` (what the compiler is given)."""
    return [path for path in build_hash.EXTENSIONS[name] if path.endswith(".c")]


def _headers(name: str) -> list:
    """The headers of extension ``name``: hashed, and a rebuild when they change, not compiled."""
    return [path for path in build_hash.EXTENSIONS[name] if not path.endswith(".c")]


def _carries(path: str, digest: str) -> bool:
    """Whether the built library at ``path`` holds ``digest`` (its hash string is in .rodata)."""
    try:
        return digest.encode() in Path(path).read_bytes()
    except OSError:
        return False


class _OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as error:  # no compiler: the pure-Python references run instead
            self.warn(f"compiled parts not built ({error}); using the pure-Python paths")

    def build_extension(self, ext):
        # a library left in the build folder from other sources (mtimes can lie: a checkout, a
        # copy keeping times) is rebuilt, not copied back as it is
        digest = dict(ext.define_macros).get("MS_MEMOPT_SOURCE_HASH", '""').strip('"')
        force = self.force
        if digest and not _carries(self.get_ext_fullpath(ext.name), digest):
            self.force = True
            if self.compiler is not None:
                self.compiler.force = True
        try:
            super().build_extension(ext)
        except Exception as error:
            self.warn(f"{ext.name} not built ({error}); using the pure-Python paths")
        finally:
            self.force = force
            if self.compiler is not None:
                self.compiler.force = force

    def copy_extensions_to_source(self):
        # --inplace / editable: always copy the build over the tree's library, whose mtime says
        # nothing about the sources it was built from (the copy unlinks first: safe for a
        # process that has the old one loaded)
        force = self.force
        self.force = True
        try:
            super().copy_extensions_to_source()
        finally:
            self.force = force

    def get_export_symbols(self, ext):
        if ext.name == "ms_memopt.native._lib":
            return []  # a ctypes library, not a Python module: no PyInit_ symbol
        return super().get_export_symbols(ext)


setup(
    ext_modules=[
        Extension(
            "ms_memopt.native._lib",
            sources=_compiled("ms_memopt.native._lib"),
            define_macros=_hash_macro("ms_memopt.native._lib"),
            # no FMA contraction: the vector and scalar code of adamw.c give the same bits
            extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off"],
            libraries=["m"],
        ),
        # one extension module from one C file per model plus the shared code and run loop
        # (ms_memopt/allocators/fast/fastpool.h); the header is a dependency, not a source
        Extension("ms_memopt.allocators.fast._fastpool", _compiled("ms_memopt.allocators.fast._fastpool"),
                  depends=_headers("ms_memopt.allocators.fast._fastpool"),
                  define_macros=_hash_macro("ms_memopt.allocators.fast._fastpool"),
                  extra_compile_args=["-O2", "-fvisibility=hidden"]),
        # the pickle nesting guard, plain C against the CPython API (ms_memopt/io/traces/torch_snapshot.py)
        Extension("ms_memopt.io.traces._pickle_scan", _compiled("ms_memopt.io.traces._pickle_scan"),
                  define_macros=_hash_macro("ms_memopt.io.traces._pickle_scan"),
                  extra_compile_args=["-O2", "-fvisibility=hidden"]),
    ],
    cmdclass={"build_ext": _OptionalBuildExt},
)
