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
        from numba.core.compiler import Flags
        from numba.pycc import CC

    class _NoGil(Flags):
        # the exported wrappers release the GIL, as nogil=True does for the JIT
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.release_gil = True  # type: ignore[assignment]  # an Option descriptor: set as a bool

    from layerdiff.analyzer.compare import kernel

    pycc_compiler.Flags = _NoGil      # type: ignore[misc]  # read by the build below only
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
