"""The compiled kernels as Python calls them, and where they come from.

``make setup`` builds ``kernel.py`` ahead of time into an extension module
beside this file (``build.py``): loading it takes a millisecond and no
numba, where numba itself costs 120 MB and a third of a second before its
first kernel runs, which a small model's whole job notices. A build is
used only where it was made from these very sources (``kernel.py``,
``contract.py`` and the signatures below) on a CPU with the same features
(it is compiled for the CPU it was built on); otherwise, or where no C
compiler made one, numba compiles the same functions just in time and
caches them, as a clone without a build did before (so does a process
told which CPU to compile for: NUMBA_CPU_NAME, NUMBA_CPU_FEATURES).

A container image is built on one machine and run on others: its build is
made for a CPU level instead (``PORTABLE_CPU``, ``layerdiff kernels
--portable``) and used on any CPU that has that level's features, where no
build for the CPU itself is there.

Both ways give the same functions under the same names; the exported ones
take exactly the signatures in ``ENTRIES``, so every call here hands them
1-D C-ordered arrays of those types (float16 tensors as their uint16 bits).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from layerdiff.analyzer.compare import contract
from layerdiff.analyzer.compare.contract import ATOL_DEFAULT, RTOL_DEFAULT, _fast_tolerances, _new_state

HERE = Path(__file__).parent
MODULE = "_kernels"
KEY_FILE = HERE / f"{MODULE}.sha256"
AHEAD_OF_TIME, JUST_IN_TIME = "built ahead of time", "compiled just in time"
log = logging.getLogger(__name__)

# The exported functions of kernel.py: a numba signature template and the
# array types it is built for ({r} and {d}: the reference and device arrays).
_ARRAY = {"f32": "float32[::1]", "f16": "uint16[::1]", "f64": "float64[::1]", "i64": "int64[::1]"}
_NARROW: list[tuple[str, ...]] = [("f32", "f32"), ("f32", "f16"), ("f16", "f16"), ("f16", "f32")]
_STATE = "int64[::1], float64[::1]"
_HEAP = "int64, int64, int64[::1], float64[::1], int64[::1]"     # base, k, the heap's three arrays
ENTRIES: dict[str, tuple[str, list[tuple[str, ...]]]] = {
    "_acc_fast": (f"void({{r}}, {{d}}, float64, float64, float64, float64, boolean, int64, {_STATE}, "
                  "float64[::1])", _NARROW),
    "_acc_f64": (f"void({{r}}, {{d}}, float64, float64, int64, {_STATE}, boolean, boolean)", [("f64", "f64")]),
    "_acc_int": (f"void({{r}}, {{d}}, boolean, boolean, int64, {_STATE})", [("i64", "i64")]),
    "_merge_state": (f"void({_STATE}, {_STATE})", [()]),
    "_worst": (f"int64({{r}}, {{d}}, float64, float64, {_HEAP})", [("f64", "f64")]),
    "_worst_marked": (f"int64({{r}}, {{d}}, float64, float64, float64[::1], {_HEAP})", _NARROW),
    "_worst_int": (f"int64({{r}}, {{d}}, boolean, boolean, {_HEAP})", [("i64", "i64")]),
    "_square_sums": ("void({r}, int64, int64, int64, float64[::1], float64[::1])", [("f32",), ("f64",)]),
    "_pair_sums": ("void({r}, {d}, int64, int64, int64, float64[::1], float64[::1], float64[::1], "
                   "float64[::1])", [("f32", "f32"), ("f32", "f16"), ("f64", "f64")]),
    "_abs_profiles": ("float64({r}, {d}, int64, int64, float64[::1], float64[::1])", [("f64", "f64"), *_NARROW]),
    "_best_window": ("int64(float64[:, ::1], float64[:, ::1], int64, int64, float64, float64, float64[::1])", [()]),
    "_matched": ("int64(int32[::1], int32[::1])", [()]),
}


def signature(name: str, kinds: tuple[str, ...]) -> str:
    template, _ = ENTRIES[name]
    return template.format(**dict(zip("rd", (_ARRAY[k] for k in kinds))))


def exported_name(name: str, kinds: tuple[str, ...], held: bool = False) -> str:
    return "__".join((name.lstrip("_"), *kinds)) + ("__held" if held else "")


# Every export is built twice: releasing the interpreter lock while it runs
# (a large tensor's comparison beside another one), and holding it (a small
# one's, ``__held``). A kernel that lets the lock go must take it back when
# it returns, and while a thread comparing a large tensor holds it that is a
# wait: the job's own thread compares the small tensors, a few kernels each,
# and waited four times as long as it computed (30 ms of work, 45 to 180 ms).
# Up to SMALL elements a kernel runs for less than a tenth of a millisecond.
SMALL = 1 << 16


# The level a portable build is compiled for (AVX2, FMA, F16C, BMI1/2,
# LZCNT, MOVBE: Intel since Haswell, AMD since Excavator), and the flags
# /proc/cpuinfo shows for it (LZCNT is "abm"): a CPU without one of them
# would stop at an illegal instruction, so it compiles just in time.
PORTABLE_CPU = "x86-64-v3"
_PORTABLE_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave", "popcnt",
                             "sse4_1", "sse4_2", "ssse3", "cx16"})
# the same level as numba names its features (NUMBA_CPU_FEATURES)
PORTABLE_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
                     "+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")


@functools.cache
def _cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where they cannot
    be read); read once: which build may load asks it three times."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        return {}
    return fields


def _cpu_identity() -> str:
    """The model and feature flags of this CPU, or "" where they cannot be read."""
    fields = _cpu_fields()
    if "flags" not in fields:
        return ""
    return f"{fields.get('vendor_id', '')}|{fields.get('model name', '')}|{fields['flags']}"


def _runs_portable() -> bool:
    """Whether this CPU has every feature of ``PORTABLE_CPU``."""
    return _PORTABLE_FLAGS <= set(_cpu_fields().get("flags", "").split())


def build_key(target: str = "") -> str:
    """What a build must have been made from to be used here: for this CPU,
    or (``target``) for a CPU level ("" where the CPU cannot be told: then
    nothing built ahead of time for it is trusted)."""
    cpu = f"level|{target}" if target else _cpu_identity()
    if not cpu:
        return ""
    h = hashlib.sha256()
    # build.py too: how it compiles (each kernel's own flags) changes the machine code
    for part in ((HERE / "kernel.py").read_bytes(), (HERE / "build.py").read_bytes(),
                 Path(contract.__file__).read_bytes(),
                 repr(sorted(ENTRIES.items())).encode(), cpu.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def _built_for(key: str) -> str | None:
    """What the build of ``key`` was made for, where this process may load
    it: this CPU, or a level this CPU has every feature of (None: neither)."""
    if not _cpu_identity():
        return None
    if key == build_key():
        return "this CPU"
    if _runs_portable() and key == build_key(PORTABLE_CPU):
        return PORTABLE_CPU
    return None


class _Typed:
    """One exported function of the build, chosen by the types of its array
    arguments (the build's own wrapper would take any array as the type it
    was exported for)."""

    def __init__(self, module, name: str, keys: list[tuple[str, ...]]) -> None:
        self.name = name
        self.by_key = {k: getattr(module, exported_name(name, k)) for k in keys}
        self.held = {k: getattr(module, exported_name(name, k, held=True)) for k in keys}
        self.typed = len(keys[0])       # the leading arguments whose types pick the export

    def __call__(self, *args):
        return self.export(args)(*args)

    def export(self, args: tuple):
        """The export a call with ``args`` runs: by the types of its leading
        arrays, and the one that keeps the interpreter lock where its first
        array (a state's, a grid's, a name's where no type picks it) holds
        at most SMALL elements."""
        key = tuple(_array_kind(a, self.name) for a in args[:self.typed])
        first = args[0] if args else None
        small = not isinstance(first, np.ndarray) or first.size <= SMALL
        fn = (self.held if small else self.by_key).get(key)
        if fn is None:
            raise TypeError(f"{self.name} is not built for arrays of {key}")
        return fn


_KINDS = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "f16", np.dtype(np.float64): "f64",
          np.dtype(np.int64): "i64"}


def _array_kind(a, name: str) -> str:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"{name} takes 1-D C-ordered arrays")
    kind = _KINDS.get(a.dtype)
    if kind is None:
        raise TypeError(f"{name} is not built for {a.dtype} arrays")
    return kind


def _ahead_of_time() -> SimpleNamespace | None:
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return None         # numba is told which CPU to compile for: it compiles
    try:
        built_for = _built_for(KEY_FILE.read_text().strip())
        if built_for is None:
            return None
        module = importlib.import_module(f"{__package__}.{MODULE}")
    except (OSError, ImportError):
        return None
    return SimpleNamespace(how=AHEAD_OF_TIME, built_for=built_for,
                           **{name: _Typed(module, name, keys) for name, (_, keys) in ENTRIES.items()})


def _just_in_time() -> SimpleNamespace:
    from layerdiff.analyzer.compare import kernel

    return SimpleNamespace(how=JUST_IN_TIME, built_for="this CPU",
                           **{name: getattr(kernel, name) for name in ENTRIES})


def _cache_is_cold(jit: SimpleNamespace) -> bool:
    """Whether numba's cache lacks the metric pass every comparison starts
    with, so that the first one waits for the compiler (False where that
    cannot be told). The other kernels are compiled as a job first calls
    them, and cached with it."""
    try:
        return not jit._acc_fast._cache._cache_file._load_index()
    except Exception:       # numba's cache laid out otherwise: no claim either way
        return False


_lock = threading.Lock()
_loaded: SimpleNamespace | None = None


def kernels() -> SimpleNamespace:
    """The exported functions by name (``how`` says which way they came)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                loaded = _ahead_of_time() or _just_in_time()
                if loaded.how == JUST_IN_TIME and _cache_is_cold(loaded):
                    # seconds to minutes of silence otherwise: say why, and what prevents it
                    log.warning("the first comparisons wait for numba to compile the metric kernels for this CPU "
                                "(once; `layerdiff kernels` builds them ahead of time)")
                _loaded = loaded
    return _loaded


def warmup(just_in_time: bool = False) -> None:
    """Load the kernels, and where numba compiles them, every exported
    signature (from its cache when it has them; a signature it holds
    already costs nothing). ``just_in_time``: numba's versions even where
    a build is used (``make setup`` does, for the tests and for a later
    fallback)."""
    k = _just_in_time() if just_in_time else kernels()
    if k.how == JUST_IN_TIME:
        for name, (_, keys) in ENTRIES.items():
            for kinds in keys:
                getattr(k, name).compile(signature(name, kinds))


# ---------------------------------------------------------------------------
# The metric pass
# ---------------------------------------------------------------------------


def _flat(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


# Elements widened to float64 at a time on the generic path (bounded scratch,
# one compiled signature for every dtype combination).
_PIECE = 1 << 16


def _kind(a: np.ndarray) -> str:
    dt = a.dtype
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt == np.float64:
        return "f64"
    if dt.kind == "f":
        return "float"
    if dt.kind in "iub":
        return "int"
    raise TypeError(f"unsupported tensor dtype {dt}")


def as_stored(a: np.ndarray) -> np.ndarray:
    """A flat array as the kernels take it: float16 as its bits (``_ARRAY``)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def narrow_pair(ref: np.ndarray, dev: np.ndarray) -> bool:
    """Float32 or float16 on both sides: the kernels' own pair types."""
    return _kind(ref) in ("f32", "f16") and _kind(dev) in ("f32", "f16")


def _as_f64(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float64 else a.astype(np.float64)


def _into_f64(a: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """A piece as float64: itself, or converted into the front of ``scratch``."""
    if a.dtype == np.float64:
        return a
    out = scratch[:a.size]
    np.copyto(out, a, casting="unsafe")
    return out


def _as_i64(a: np.ndarray) -> np.ndarray:
    """An integer/bool piece as int64 (uint64 as its bits: see ``kernel._isplit``)."""
    if a.dtype == np.uint64:
        return a.view(np.int64)
    return a if a.dtype == np.int64 else a.astype(np.int64)


_NO_MARKS = np.empty(0)


def block_marks(ref: np.ndarray, dev: np.ndarray) -> np.ndarray | None:
    """Room for the marks a metric pass over ``ref`` and ``dev`` leaves for
    the worst-elements search (one a block of ``contract._BLOCK``
    elements: see ``kernel._acc_fast``), or None for types it leaves none
    for (only float32 and float16 pairs)."""
    return np.empty(-(-ref.size // contract._BLOCK)) if narrow_pair(ref, dev) else None


def check_marks(marks: np.ndarray, n: int) -> np.ndarray:
    """``marks`` as block_marks makes them for ``n`` elements (the compiled
    code writes them unchecked), else ValueError."""
    if not (isinstance(marks, np.ndarray) and marks.dtype == np.float64 and marks.ndim == 1
            and marks.flags.c_contiguous and marks.flags.writeable and marks.size == -(-n // contract._BLOCK)):
        raise ValueError(f"marks are not block_marks' for {n} elements")
    return marks


def _run(ref, dev, atol, rtol, base, marks: np.ndarray | None = None):
    """The state of one metric pass over ``ref`` and ``dev`` (flat offset
    ``base`` in the whole tensor); ``marks`` (``block_marks``) filled
    where given."""
    r = _flat(ref)
    d = _flat(dev)
    if r.size != d.size:
        raise ValueError(
            f"element count mismatch: reference has {r.size} elements, device has {d.size}")
    atol = float(atol)
    rtol = float(rtol)
    base = int(base)
    kr, kd = _kind(r), _kind(d)
    k = kernels()
    iv, fv = _new_state()
    if kr in ("f32", "f16") and kd in ("f32", "f16"):
        lo = _fast_tolerances(atol, rtol)
        rtol_lo, atol_lo = lo if lo is not None else (0.0, 0.0)
        k._acc_fast(as_stored(r), as_stored(d), atol, rtol, rtol_lo, atol_lo, lo is None, base, iv, fv,
                    _NO_MARKS if marks is None else check_marks(marks, r.size))
    elif kr == "f64" and kd == "f64":
        k._acc_f64(r, d, atol, rtol, base, iv, fv, True, True)
    elif kr == "int" and kd == "int":
        ru, du = bool(r.dtype == np.uint64), bool(d.dtype == np.uint64)
        for s in range(0, r.size, _PIECE):
            k._acc_int(_as_i64(r[s:s + _PIECE]), _as_i64(d[s:s + _PIECE]), ru, du, base + s, iv, fv)
    else:
        for s in range(0, r.size, _PIECE):
            k._acc_f64(_as_f64(r[s:s + _PIECE]), _as_f64(d[s:s + _PIECE]), atol, rtol,
                       base + s, iv, fv, kr != "int", kd != "int")
    return iv, fv


def _merge_state(iv, fv, jv, gv) -> None:
    """(iv, fv) <- (iv, fv) merged with (jv, gv)."""
    kernels()._merge_state(iv, fv, jv, gv)


__all__ = ["ATOL_DEFAULT", "RTOL_DEFAULT", "ENTRIES", "kernels", "warmup", "build_key", "block_marks", "as_stored",
           "narrow_pair"]
