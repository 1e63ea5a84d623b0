"""The metric kernels built ahead of time (make setup) against numba's own:
the same answers from every exported signature, no numba in a process that
compares, and no build used where it was not made from these sources on
this CPU."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from layerdiff.analyzer.compare import compiled
from layerdiff.analyzer.compare.contract import _fast_tolerances, _new_state

ATOL, RTOL = 0.005, 0.2
# sums the compiler may take in any order (vectorized for the CPU it targets):
# equal to rounding; every other entry is exact, so equal bit for bit
_ANY_ORDER = ("_square_sums", "_pair_sums", "_abs_profiles")


def _values(rng, n: int, kind: str) -> np.ndarray:
    """Values of every sort the kernels meet: ordinary, tiny, beyond FP16,
    NaN and Inf (float kinds), and int64 extremes (i64)."""
    if kind == "i64":
        v = rng.integers(-1000, 1000, n, dtype=np.int64)
        v[::97] = np.iinfo(np.int64).max
        v[1::89] = np.iinfo(np.int64).min
        return v
    x = rng.standard_normal(n) * 3
    x[::53] *= 1e5                  # past FP16's range
    x[::71] = 1e-30                 # below the float32 sweep's floor
    x[::101] = np.nan
    x[::113] = np.inf
    x[::127] = -np.inf
    if kind == "f16":
        with np.errstate(over="ignore"):        # past FP16's range: Inf, as a device gives it
            return x.astype(np.float16).view(np.uint16)
    return x.astype(np.float32 if kind == "f32" else np.float64)


def _pair(rng, n: int, kinds: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    r = _values(rng, n, kinds[0])
    # the device: near the reference mostly (so the mismatch tests are close calls), its own values elsewhere
    d = _values(rng, n, kinds[1])
    near = rng.random(n) < 0.7
    if kinds[0] == kinds[1]:
        d[near] = r[near]
        if kinds[0] in ("f32", "f64"):
            d[near] *= np.asarray(1 + rng.standard_normal(int(near.sum())) * 0.01, r.dtype)
    return r, d


def _calls(name: str, kinds: tuple[str, ...], rng) -> list[tuple]:
    """Argument lists for one exported signature (fresh output arrays each)."""
    n = 5000
    out = []
    if name == "_merge_state":
        for _ in range(3):
            a, b = compiled._run(*_pair(rng, n, ("f32", "f32")), ATOL, RTOL, 0), \
                compiled._run(*_pair(rng, n, ("f32", "f32")), ATOL, RTOL, n)
            out.append((a[0].copy(), a[1].copy(), b[0], b[1]))
        return out
    if name in ("_square_sums",):
        for p, k, q in ((1, 5000, 1), (10, 50, 10), (2, 1, 2500)):
            out.append((_values(rng, n, kinds[0]), p, k, q, np.zeros(k), np.zeros(q)))
        return out
    if name == "_matched":
        codes = np.frombuffer("conv2d_4.tmp_0/Conv_output_0:ébè".encode("utf-32-le"), np.int32)
        for la, lb in ((0, 0), (5, 0), (14, 30), (30, 14), (30, 30)):
            out.append((rng.choice(codes[:8], la).astype(np.int32), rng.choice(codes, lb).astype(np.int32)))
        return out
    if name == "_best_window":
        for h, w, wh, ww in ((1, 300, 1, 19), (40, 30, 10, 8), (5, 5, 5, 5), (3, 4, 4, 1)):
            se, sr = rng.random((h, w)) * 3, rng.random((h, w))
            sr[0, :2] = 0.0           # windows of a zero reference, taken relative to the floor
            out.append((se, sr, wh, ww, float(wh * ww * 7), 0.01, np.zeros(4)))
        return out
    r, d = _pair(rng, n, kinds)
    if name == "_abs_profiles":
        for outer, inner in ((1, 5000), (50, 100), (5000, 1)):
            out.append((r, d, outer, inner, np.zeros(outer), np.zeros(inner)))
        return out
    if name == "_pair_sums":
        for p, k, q in ((1, 5000, 1), (10, 50, 10), (2, 1, 2500)):
            out.append((r, d, p, k, q, np.zeros(k), np.zeros(k), np.zeros(q), np.zeros(q)))
        return out
    for atol, rtol in ((ATOL, RTOL), (0.0, 1e-3), (1e-40, 0.5)):
        iv, fv = _new_state()
        if name == "_acc_fast":
            lo = _fast_tolerances(atol, rtol)
            out.append((r, d, atol, rtol, *(lo or (0.0, 0.0)), lo is None, 7, iv, fv, np.zeros(-(-n // 2048))))
            iv, fv = _new_state()
            out.append((r, d, atol, rtol, *(lo or (0.0, 0.0)), lo is None, 7, iv, fv, np.empty(0)))
        elif name == "_acc_f64":
            out.append((r, d, atol, rtol, 7, iv, fv, True, False))
        elif name == "_acc_int":
            out.append((r, d, False, rtol > 0.3, 7, iv, fv))
        elif name == "_worst":
            out.append((r, d, atol, rtol, 7, 0, np.zeros(40, np.int64), np.zeros(40), np.zeros(40, np.int64)))
        elif name == "_worst_marked":
            marks = np.zeros(-(-n // 2048))
            compiled._run(r.view(np.float16) if kinds[0] == "f16" else r,
                          d.view(np.float16) if kinds[1] == "f16" else d, atol, rtol, 0, marks)
            out.append((r, d, atol, rtol, marks, 7, 0, np.zeros(40, np.int64), np.zeros(40),
                        np.zeros(40, np.int64)))
        elif name == "_worst_int":
            out.append((r, d, False, rtol > 0.3, 7, 0, np.zeros(40, np.int64), np.zeros(40),
                        np.zeros(40, np.int64)))
    return out


def _outputs(fn, args: tuple):
    args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    ret = fn(*args)
    return ret, [a for a in args if isinstance(a, np.ndarray)]


def test_every_exported_signature_answers_as_numba_does():
    """Both exports of each signature: the one that lets the interpreter
    lock go (large arrays) and the one that keeps it (small ones)."""
    built = compiled._ahead_of_time()
    assert built is not None, "make setup builds the kernels for this CPU"
    jit = compiled._just_in_time()
    rng = np.random.default_rng(11)
    tried = 0
    for name, (_, keys) in compiled.ENTRIES.items():
        for kinds in keys:
            calls = _calls(name, kinds, rng)
            assert calls, f"no call made for {name}{kinds}"
            typed = getattr(built, name)
            for args in calls:
                want_ret, want = _outputs(getattr(jit, name), args)
                for export in (typed.by_key[kinds], typed.held[kinds]):
                    got_ret, got = _outputs(export, args)
                    if name in _ANY_ORDER and got_ret is not None:
                        assert got_ret == pytest.approx(want_ret, rel=1e-12, nan_ok=True), (name, kinds)
                    else:
                        assert got_ret == want_ret, (name, kinds)
                    for g, w in zip(got, want):
                        if name in _ANY_ORDER:
                            np.testing.assert_allclose(g, w, rtol=1e-12, err_msg=f"{name}{kinds}")
                        else:
                            np.testing.assert_array_equal(g, w, err_msg=f"{name}{kinds}")
                    tried += 1
    assert tried >= 80


def test_a_small_array_s_kernel_keeps_the_interpreter_lock_and_a_large_one_s_lets_it_go():
    """A thread comparing small tensors is not made to wait for the lock
    after every kernel (another thread took it meanwhile); a large tensor's
    kernel lets the other threads run. A spinning thread counts only while
    it holds the lock: it counts nothing during a call that keeps it, and
    all along one that lets it go (switches forced only after a second)."""
    import threading
    import time

    built = compiled._ahead_of_time()
    assert built is not None
    x = np.random.default_rng(5).standard_normal(compiled.SMALL * 64).astype(np.float32)
    iv, fv = _new_state()
    lo = _fast_tolerances(ATOL, RTOL)
    args = (x, x, ATOL, RTOL, *lo, False, 0, iv, fv, np.empty(0))
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        spinner.start()
        time.sleep(0.05)        # the spinner runs (and holds the lock) from here on
        during = {}
        for label in ("held", "by_key"):
            before = count[0]
            # a few calls at most: where other processes take both cores, the
            # spinner may get none during one call that lets it run (seen
            # once under the suite's load); one that keeps the lock, never
            for _ in range(20):
                getattr(built._acc_fast, label)[("f32", "f32")](*args)
                if count[0] - before > 1000:
                    break
            during[label] = count[0] - before
            time.sleep(0.01)
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    assert during["held"] == 0 and during["by_key"] > 1000, during
    # and the dispatch: the held export up to SMALL elements, the other past it
    small = (x[:compiled.SMALL], x[:compiled.SMALL], *args[2:])
    large = (x[:compiled.SMALL + 1], x[:compiled.SMALL + 1], *args[2:])
    assert built._acc_fast.export(small) is built._acc_fast.held[("f32", "f32")]
    assert built._acc_fast.export(large) is built._acc_fast.by_key[("f32", "f32")]
    assert built._best_window.export((np.zeros((2, 2)),) * 2) is built._best_window.held[()]


def test_the_build_refuses_arrays_it_was_not_made_for():
    built = compiled._ahead_of_time()
    assert built is not None
    iv, fv = _new_state()
    f32 = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="int32"):
        built._acc_fast(np.zeros(8, np.int32), f32, ATOL, RTOL, 0.0, 0.0, True, 0, iv, fv, np.empty(1))
    with pytest.raises(TypeError, match="C-ordered"):
        built._acc_fast(np.zeros(16, np.float32)[::2], f32, ATOL, RTOL, 0.0, 0.0, True, 0, iv, fv, np.empty(1))
    with pytest.raises(TypeError, match="not built"):
        built._acc_fast(np.zeros(8), f32, ATOL, RTOL, 0.0, 0.0, True, 0, iv, fv, np.empty(1))


def test_a_build_from_other_sources_or_for_another_cpu_is_not_used(monkeypatch, tmp_path):
    assert compiled._ahead_of_time() is not None
    with monkeypatch.context() as m:      # another CPU (a copied image): its instructions may not run here
        m.setattr(compiled, "_cpu_fields", lambda: {"vendor_id": "GenuineIntel", "model name": "another",
                                                    "flags": " ".join(sorted(compiled._PORTABLE_FLAGS))})
        assert compiled._ahead_of_time() is None
    with monkeypatch.context() as m:      # a CPU that cannot be told
        m.setattr(compiled, "_cpu_fields", lambda: {})
        assert compiled._ahead_of_time() is None
    with monkeypatch.context() as m:      # built before the sources changed
        key = tmp_path / "_kernels.sha256"
        key.write_text("0" * 64 + "\n")
        m.setattr(compiled, "KEY_FILE", key)
        assert compiled._ahead_of_time() is None
        m.setattr(compiled, "KEY_FILE", tmp_path / "absent.key")
        assert compiled._ahead_of_time() is None
    with monkeypatch.context() as m:      # numba told to compile for another CPU
        m.setenv("NUMBA_CPU_NAME", "haswell")
        assert compiled._ahead_of_time() is None


def test_a_portable_build_is_used_on_every_cpu_of_its_level_and_no_other(monkeypatch, tmp_path):
    """A container image's build is made for x86-64-v3 (AVX2, FMA, ...): any
    CPU with those features loads it, one without them (an older CPU, where
    it would stop at an illegal instruction) compiles just in time."""
    key = tmp_path / "_kernels.sha256"
    key.write_text(compiled.build_key(compiled.PORTABLE_CPU) + "\n")
    monkeypatch.setattr(compiled, "KEY_FILE", key)
    level = " ".join(sorted(compiled._PORTABLE_FLAGS | {"fpu", "sse2", "avx512f"}))
    monkeypatch.setattr(compiled, "_cpu_fields", lambda: {"model name": "a newer CPU", "flags": level})
    built = compiled._ahead_of_time()
    assert built is not None and built.built_for == compiled.PORTABLE_CPU
    for missing in ("avx2", "fma", "f16c", "movbe"):
        short = " ".join(sorted(compiled._PORTABLE_FLAGS - {missing}))
        monkeypatch.setattr(compiled, "_cpu_fields", lambda short=short: {"model name": "older", "flags": short})
        assert compiled._ahead_of_time() is None, missing
    from layerdiff.client.cli import build_parser
    assert compiled.PORTABLE_CPU in build_parser()._subparsers._group_actions[0].choices["kernels"].format_help()
    key.write_text(compiled.build_key("x86-64-v4") + "\n")      # a level this program does not build for
    monkeypatch.setattr(compiled, "_cpu_fields", lambda: {"model name": "a newer CPU", "flags": level})
    assert compiled._ahead_of_time() is None


_OUTPUTS = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_compiled import _calls, _outputs
    from layerdiff.analyzer.compare import compiled
    k = compiled.kernels()
    rng = np.random.default_rng(11)
    got = {}
    for name, (_, keys) in compiled.ENTRIES.items():
        for kinds in keys:
            for i, args in enumerate(_calls(name, kinds, rng)):
                ret, arrays = _outputs(getattr(k, name), args)
                got[f"{name}|{'-'.join(kinds)}|{i}|ret"] = np.asarray(np.nan if ret is None else ret)
                for j, a in enumerate(arrays):
                    got[f"{name}|{'-'.join(kinds)}|{i}|{j}"] = a
    np.savez(sys.argv[1], how=k.how, built_for=k.built_for, **got)
""")


def test_layerdiff_kernels_builds_for_an_image_and_falls_back_to_numba_s_cache(tmp_path):
    """`layerdiff kernels --portable` as an image build runs it, in an
    installed copy of the package: a build for x86-64-v3 that answers as
    numba's own functions compiled for that level do (bit for bit where
    the order of a sum cannot matter); where no build can be made (no C
    compiler), numba's cache is filled instead and the last build stays in
    use; and a command that has to wait for numba's compiler says so,
    once."""
    site = tmp_path / "site"
    shutil.copytree(Path(compiled.__file__).parents[2], site / "layerdiff",
                    ignore=shutil.ignore_patterns("__pycache__", "_kernels*"))
    env = dict(os.environ, PYTHONPATH=str(site), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    at_level = dict(env, NUMBA_CPU_NAME=compiled.PORTABLE_CPU, NUMBA_CPU_FEATURES=compiled.PORTABLE_FEATURES)

    def layerdiff(*args, env=env):
        return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    def outputs(path, env):
        done = subprocess.run([sys.executable, "-c", _OUTPUTS, str(path), str(Path(__file__).parent)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return np.load(path)

    built = layerdiff("kernels", "--portable")
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.startswith(f"layerdiff: metric kernels built for any {compiled.PORTABLE_CPU} CPU in ")
    assert str(site) in built.stdout and not built.stderr
    aot = outputs(tmp_path / "aot.npz", env)
    assert (str(aot["how"]), str(aot["built_for"])) == (compiled.AHEAD_OF_TIME, compiled.PORTABLE_CPU)

    rng = np.random.default_rng(3)
    for side in ("golden", "device"):
        (tmp_path / side).mkdir()
    for i in range(4):
        t = rng.standard_normal((32, 128)).astype(np.float32)
        np.save(tmp_path / "golden" / f"{i:04d}_n{i}.npy", t)
        np.save(tmp_path / "device" / f"{i:04d}_n{i}.npy", t.astype(np.float16))
    notice = "layerdiff: the first comparisons wait for numba to compile the metric kernels for this CPU"
    first = layerdiff("compare", "golden", "device", "--no-progress", env=at_level)
    assert first.returncode == 0, first.stderr[-2000:]
    assert notice in first.stderr and "layerdiff kernels" in first.stderr

    no_compiler = layerdiff("kernels", env=dict(at_level, CC="/bin/false"))
    assert no_compiler.returncode == 0, no_compiler.stderr[-2000:]
    assert no_compiler.stderr.startswith("layerdiff: the metric kernels were not built ahead of time (")
    assert "numba compiled them for this CPU into its cache" in no_compiler.stderr
    assert len(no_compiler.stderr.splitlines()) == 1
    still = subprocess.run([sys.executable, "-c", "from layerdiff.analyzer.compare import compiled; "
                            "k = compiled.kernels(); print(k.how, '|', k.built_for)"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert still.stdout.strip() == f"{compiled.AHEAD_OF_TIME} | {compiled.PORTABLE_CPU}", \
        "a build that failed left the last one in use"
    again = layerdiff("compare", "golden", "device", "--no-progress", env=at_level)
    assert again.returncode == 0 and notice not in again.stderr, again.stderr[-2000:]

    jit = outputs(tmp_path / "jit.npz", at_level)
    assert str(jit["how"]) == compiled.JUST_IN_TIME
    names = [n for n in aot.files if "|" in n]
    assert sorted(names) == sorted(n for n in jit.files if "|" in n) and len(names) > 100
    for n in names:
        if n.split("|")[0] in _ANY_ORDER:
            np.testing.assert_allclose(aot[n], jit[n], rtol=1e-12, err_msg=n)
        else:
            np.testing.assert_array_equal(aot[n], jit[n], err_msg=n)


def test_a_comparison_runs_without_numba():
    """What a job runs (the metric pass, the worst elements, the error
    model's sums) loads no numba and no LLVM: 120 MB and a third of a second
    a small model's whole job would notice."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from layerdiff.analyzer.compare import compiled, metrics, worst, squares
        r = np.linspace(-3, 3, 3000, dtype=np.float32)
        d = r.astype(np.float16)
        d[5] = np.float16(7)
        m = metrics.compare(r, d)
        rows = worst.worst_elements(r, d)
        sums = squares.pair_square_sums(r.reshape(30, 100), d.reshape(30, 100), 0, 0)
        assert m.errors == 1 and rows[0][0] == 5 and sums is not None
        print(compiled.kernels().how, sorted(k for k in ("numba", "llvmlite") if k in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"{compiled.AHEAD_OF_TIME} []"
