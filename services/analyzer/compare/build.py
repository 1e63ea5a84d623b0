"""Builds the kernels ahead of time: ``layerdiff kernels`` (``make setup``
runs it; ``compiled.py`` says when a build is used).

Every function in ``compiled.ENTRIES`` is exported for each of its
signatures into one extension module beside ``kernel.py``, compiled for
this CPU (``--portable``: for any CPU of ``compiled.PORTABLE_CPU``'s level,
as an image built on one machine and run on others needs), releasing the
GIL while it runs as the just-in-time functions do (``nogil=True``), so
that a comparison and its error figures still run side by side on two
cores; and once more holding it, for small arrays (``compiled.SMALL``).
The key of what it was built from is written last: a build interrupted
half way is never used. Where no build can be made (no C
compiler, no Python headers), numba compiles the kernels into its cache
instead, so that the next command loads them from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

from layerdiff.analyzer.compare import compiled


class BuildFailed(RuntimeError):
    """No build was made; the message says why, in one line."""


def build(target: str = "") -> Path:
    """Build the kernels beside ``kernel.py`` for this CPU, or for the CPU
    level ``target``; returns the extension module's path.

    The build runs in a process of its own: the C compiler's and numba's
    output stays there (the first compiler error is kept for the reason),
    and kernel.py, which shapes its code by the features numba targets (16
    lanes where AVX-512 is there, 8 elsewhere) when it is imported, is
    imported there told the level it is built for."""
    # a build for this CPU is shaped by its own features, whatever numba was told here
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    if target:
        env.update(NUMBA_CPU_NAME=target, NUMBA_CPU_FEATURES=compiled.PORTABLE_FEATURES)
    done = subprocess.run([sys.executable, "-m", __spec__.name, target], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"the build exited with status {done.returncode}"]
        first_error = next((ln.strip() for ln in lines[:-1] if "error" in ln.lower()), "")
        raise BuildFailed(lines[-1] + (f" ({first_error})" if first_error else ""))
    return Path(done.stdout.strip().splitlines()[-1])


def _build_here(target: str) -> Path:
    key = compiled.build_key(target)
    if not key:
        raise RuntimeError("this CPU's model and features cannot be read (/proc/cpuinfo): "
                           "the kernels will be compiled just in time")
    if not os.access(compiled.HERE, os.W_OK):
        raise PermissionError(f"{compiled.HERE} cannot be written here (run it as the user that installed "
                              "layerdiff, where its files are writable)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # numba.pycc's pending deprecation
        import numba.pycc.compiler as pycc_compiler
        from llvmlite import binding as llvm
        from numba.pycc import CC

    from layerdiff.analyzer.compare import kernel

    # numba.pycc compiles every export with one set of default flags: the
    # options each kernel was declared with (nogil, fastmath's reassociation
    # that lets a sum be vectorized, numpy's error model) would be lost, and
    # the build would run slower than the just-in-time functions (the sums of
    # squares took 1.7x as long). Each export is compiled with its own.
    declared: dict = {getattr(kernel, name).py_func: (getattr(kernel, name), {}) for name in compiled.ENTRIES}
    # each kernel's copy for the exports that keep the interpreter lock (compiled.SMALL)
    holding = {name: _copy(getattr(kernel, name).py_func) for name in compiled.ENTRIES}
    declared.update({holding[name]: (getattr(kernel, name), {"nogil": False}) for name in compiled.ENTRIES})
    plain_compile = pycc_compiler.compile_extra

    def compile_as_declared(typingctx, targetctx, func, args, return_type, flags, *rest, **kw):
        jitted, changed = declared.get(func, (None, {}))
        if jitted is not None:
            flags = jitted.targetdescr.options.parse_as_flags(flags.copy(), {**jitted.targetoptions, **changed})
        return plain_compile(typingctx, targetctx, func, args, return_type, flags, *rest, **kw)

    pycc_compiler.compile_extra = compile_as_declared      # read by the build below only
    cc = CC(compiled.MODULE)
    cc.target_cpu = target or llvm.get_host_cpu_name()
    cc.verbose = False
    for name, (_, keys) in compiled.ENTRIES.items():
        for kinds in keys:
            cc.export(compiled.exported_name(name, kinds), compiled.signature(name, kinds))(
                getattr(kernel, name).py_func)
            cc.export(compiled.exported_name(name, kinds, held=True), compiled.signature(name, kinds))(
                holding[name])
    with tempfile.TemporaryDirectory(prefix="layerdiff-kernels-") as tmp:
        cc.output_dir = tmp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cc.compile()
        built = next(Path(tmp).glob(f"{compiled.MODULE}.*"))
        placed = compiled.HERE / built.name
        # a failed build leaves the last one in use; this one replaces it keyless until it is all there
        compiled.KEY_FILE.unlink(missing_ok=True)
        shutil.move(built, placed)
    compiled.KEY_FILE.write_text(key + "\n")
    return placed


def _copy(func):
    """Another function of the same code (numba compiles a function once,
    with one set of flags)."""
    return types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)


def run(portable: bool = False, fallback: bool = True) -> int:
    """``layerdiff kernels``: build the kernels; where that fails, fill
    numba's cache instead (``fallback``). 0 when the next command finds its
    kernels ready, 1 when neither worked."""
    target = compiled.PORTABLE_CPU if portable else ""
    what = f"any {target} CPU" if target else "this CPU"
    t0 = time.perf_counter()
    try:
        path = build(target)
    except Exception as e:      # no C compiler or headers, a read-only install, an unreadable CPU
        why = str(e) if isinstance(e, BuildFailed) else _one_line(e)
        if not fallback:
            print(f"layerdiff: the metric kernels were not built for {what}: {why}", file=sys.stderr)
            return 1
    else:
        print(f"layerdiff: metric kernels built for {what} in {time.perf_counter() - t0:.0f} s: {path}")
        return 0
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled.warmup(just_in_time=True)
    except Exception as e:
        print(f"layerdiff: the metric kernels were not built ahead of time ({why}), nor compiled into numba's "
              f"cache ({_one_line(e)}); each command compiles them on first use", file=sys.stderr)
        return 1
    print(f"layerdiff: the metric kernels were not built ahead of time ({why}); numba compiled them for this CPU "
          f"into its cache in {time.perf_counter() - t0:.0f} s, where the next commands load them", file=sys.stderr)
    return 0


def _one_line(e: Exception) -> str:
    line = f"{type(e).__name__}: {e}".splitlines()[0]
    if line.endswith(":") and ". " in line:      # a message that goes on to advice on the next lines
        line = line[:line.rindex(". ") + 1]
    return line


if __name__ == "__main__":      # build()'s own process: the module's path, or one line saying why not
    try:
        print(_build_here(sys.argv[1] if len(sys.argv) > 1 else ""))
    except Exception as e:
        print(_one_line(e), file=sys.stderr)
        sys.exit(1)
