"""Builds the kernels ahead of time: ``python -m layerdiff.analyzer.compare.build``
(``make setup`` runs it; ``compiled.py`` says when a build is used).

Every function in ``compiled.ENTRIES`` is exported for each of its
signatures into one extension module beside ``kernel.py``, compiled for
this CPU, releasing the GIL while it runs as the just-in-time functions do
(``nogil=True``), so that a comparison and its error figures still run side
by side on two cores. The key of what it was built from is written last:
a build interrupted half way is never used.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from layerdiff.analyzer.compare import compiled


def build() -> Path:
    key = compiled.build_key()
    if not key:
        raise RuntimeError("this CPU's model and features cannot be read (/proc/cpuinfo): "
                           "the kernels will be compiled just in time")
    compiled.KEY_FILE.unlink(missing_ok=True)
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
    declared = {getattr(kernel, name).py_func: getattr(kernel, name) for name in compiled.ENTRIES}
    plain_compile = pycc_compiler.compile_extra

    def compile_as_declared(typingctx, targetctx, func, args, return_type, flags, *rest, **kw):
        jitted = declared.get(func)
        if jitted is not None:
            flags = jitted.targetdescr.options.parse_as_flags(flags.copy(), jitted.targetoptions)
        return plain_compile(typingctx, targetctx, func, args, return_type, flags, *rest, **kw)

    pycc_compiler.compile_extra = compile_as_declared      # read by the build below only
    cc = CC(compiled.MODULE)
    cc.target_cpu = llvm.get_host_cpu_name()
    cc.verbose = False
    for name, (_, keys) in compiled.ENTRIES.items():
        for kinds in keys:
            cc.export(compiled.exported_name(name, kinds), compiled.signature(name, kinds))(
                getattr(kernel, name).py_func)
    with tempfile.TemporaryDirectory(prefix="layerdiff-kernels-") as tmp:
        cc.output_dir = tmp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cc.compile()
        built = next(Path(tmp).glob(f"{compiled.MODULE}.*"))
        target = compiled.HERE / built.name
        shutil.move(built, target)
    compiled.KEY_FILE.write_text(key + "\n")
    return target


def main() -> int:
    t0 = time.perf_counter()
    try:
        target = build()
    except Exception as e:      # no C compiler, an unreadable CPU: the JIT still serves
        print(f"layerdiff: the metric kernels were not built ahead of time ({type(e).__name__}: {e}); "
              "they will be compiled on first use", file=sys.stderr)
        return 0
    print(f"layerdiff: metric kernels built for this CPU in {time.perf_counter() - t0:.0f} s: {target.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
