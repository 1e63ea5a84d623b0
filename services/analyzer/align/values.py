"""Pairing device tensors with reference tensors by their values: the last
resort for a dump whose names match nothing and that carries no graph.

Every reference tensor and every device tensor left unmatched by name gets a
cheap *fingerprint*: mean, std, min, max, the fraction of exact zeros and of
non-finite values, and a fixed sample of its values (``SAMPLE`` positions
drawn once per element count, read in the reference's layout, so that a
device tensor in another layout is sampled at the same elements). A device
tensor's candidates are the reference tensors with its element count, a
compatible dtype (float with float, integer or bool with integer or bool) and
its shape, or its shape after the layout permutation (``layout.resolve``;
where the shape does not tell the layout, each layout permutation is tried
and the values decide).

The rule (``decide``), against every candidate, paired already or not, so
that the answer does not depend on the order the stream arrives in:

1. *agreement*: the distance is the largest of the sample's relative RMS
   error, the differences of mean and std over the reference's RMS, of min
   and max over its span, and the difference of the zero fractions. A
   candidate within ``EXACT`` (5 %: FP16, BF16 and most INT8 builds) pairs
   when every other candidate is at least ``SEPARATE`` times farther (and
   farther than ``SEPARATE_MIN``); two candidates that close (a Relu after a
   Relu, a Reshape or a Clip that keeps the values) are ambiguous.
2. *pattern*, when no candidate agrees (the node is in error, or what it
   read was): the Pearson correlation of the samples. Only candidates of the
   same kind count: both with exact zeros or neither (a ReLU's output and a
   convolution's differ there, whatever a bug did to the values), both
   non-negative or neither. The best pairs when its correlation is at least
   ``CORR_MIN`` and every other candidate's is lower by ``CORR_MARGIN`` and
   leaves at least ``CORR_FACTOR`` times more unexplained (1 - r). A bug at
   one node scales and shifts its output but keeps its pattern, so it still
   pairs; its neighbours, one op apart, correlate less or differ in kind
   (a ReLU after it). Where the next op is affine by a scalar (a Mul or an
   Add by a constant) the patterns are the same, and it stays ambiguous.

Every device tensor that can pair is held (``cap_bytes`` at most) until
the stream ends, so that names come first: a device-only tensor (a layout
copy, a fused op's intermediate) holding the values of a tensor the device
also sends under its name must not take that tensor's place. ``settle`` then
decides them all, against every candidate first: a clear winner pairs,
agreement outranking a pattern (a tensor in error may follow the pattern of
what it read, which its producer's device tensor matches by agreement); a
winner already paired makes the device tensor a copy, left unmatched. The
rest is decided in rounds against the candidates nobody claimed ("by
elimination"), a candidate two of them win going to neither. Past the cap
the oldest held tensor is decided at once against every candidate (a clear
winner pairs, an ambiguous one stays unmatched, with the reason). Whatever
stays unmatched is reported with its closest candidates.

The reference side is fingerprinted once, segment by segment (one
segment's values in memory at a time), when the first decision is due: at
the end of the stream, when most reference values have been compared and let
go, or earlier at the cap.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.align import layout as L

if TYPE_CHECKING:
    from layerdiff.common.schema import BufferLease

SAMPLE = 512
EXACT = 0.05
SEPARATE = 4.0
SEPARATE_MIN = 0.02
CORR_MIN = 0.8
CORR_MARGIN = 0.03
CORR_FACTOR = 3.0
MIN_CORR_SAMPLES = 16
ZERO_KIND = 0.01          # a tensor "has zeros" above this fraction
CAP_BYTES = 256 << 20     # undecided device tensors held at most
_CHUNK = 1 << 20
_TINY = 1e-30


def _kind(dtype: np.dtype) -> str:
    return "f" if np.dtype(dtype).kind in "fc" or np.dtype(dtype).name == "bfloat16" else "i"


@lru_cache(maxsize=512)
def _positions(size: int) -> np.ndarray:
    """SAMPLE flat positions (C order of the reference's shape), fixed per
    element count: the same elements on both sides."""
    if size <= SAMPLE:
        return np.arange(size, dtype=np.int64)
    # one position in each of SAMPLE equal strata, at an offset a hash of
    # the stratum and the count picks: spread over the whole tensor, in
    # order and distinct by construction, and no period of the values
    # (a row, a channel) lines up with it (numpy's random generators took
    # a fifth of a user's dump's value pairing to import)
    i = np.arange(SAMPLE, dtype=np.uint64)
    start = (np.arange(SAMPLE + 1, dtype=np.int64) * size) // SAMPLE
    h = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(size)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
    width = (start[1:] - start[:-1]).astype(np.uint64)
    pos = start[:-1] + (h % width).astype(np.int64)
    pos.setflags(write=False)
    return pos


def sample(arr: np.ndarray, ref_shape: tuple, perm: tuple | None = None) -> np.ndarray:
    """The fixed sample of ``arr`` read in the reference's layout:
    ``arr.transpose(perm)`` has ``ref_shape``."""
    ref_shape = tuple(ref_shape)
    pos = _positions(int(arr.size))
    if not pos.size:
        return np.zeros(0)
    multi = np.unravel_index(pos, ref_shape) if ref_shape else ()
    if perm is None or perm == L.identity(arr.ndim):
        if tuple(arr.shape) == ref_shape:
            vals = arr[multi] if ref_shape else arr.reshape(1)
        else:
            vals = arr.reshape(-1)[pos]
    else:
        idx = [None] * arr.ndim
        for k, i in enumerate(perm):
            idx[i] = multi[k]
        vals = arr[tuple(idx)]
    return np.asarray(vals, dtype=np.float64).reshape(-1)


@dataclass
class Fingerprint:
    shape: tuple
    size: int
    kind: str
    mean: float = 0.0
    std: float = 0.0
    lo: float = 0.0
    hi: float = 0.0
    zeros: float = 0.0
    nonfinite: float = 0.0
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def rms(self) -> float:
        return math.sqrt(self.mean * self.mean + self.std * self.std)


def stats(arr: np.ndarray) -> Fingerprint:
    """Everything but the sample, in one pass of bounded memory."""
    flat = arr.reshape(-1)
    n = int(flat.size)
    fp = Fingerprint(tuple(arr.shape), n, _kind(arr.dtype))
    if not n:
        return fp
    s = ss = 0.0
    lo, hi = math.inf, -math.inf
    zeros = bad = fin_n = 0
    # float32 and float16 are looked at as they are (widening is exact: the
    # same finite values, zeros and extremes at a half or a quarter of the
    # bytes); only the sums are taken in float64
    narrow = arr.dtype == np.float32 or arr.dtype == np.float16
    for a in range(0, n, _CHUNK):
        x = flat[a:a + _CHUNK]
        if arr.dtype == np.float16:
            # numpy takes float16 a value at a time (min, max, isfinite: 15
            # ns a value); widened to float32 first (exact), 2 ns
            x = x.astype(np.float32)
        elif not narrow:
            x = x.astype(np.float64)
        ok = np.isfinite(x)
        if not ok.all():
            bad += int(x.size - ok.sum())
            x = x[ok]
        zeros += int(np.count_nonzero(x == 0))
        if x.size:
            fin_n += x.size
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
            if narrow:
                x = x.astype(np.float64)
            s += float(x.sum())
            ss += float(np.einsum("i,i->", x, x))     # not BLAS (see diagnose.evidence)
    if fin_n:
        fp.mean = s / fin_n
        fp.std = math.sqrt(max(ss / fin_n - fp.mean * fp.mean, 0.0))
        fp.lo, fp.hi = lo, hi
    fp.zeros = zeros / n
    fp.nonfinite = bad / n
    return fp


def fingerprint(arr: np.ndarray) -> Fingerprint:
    """A reference tensor's fingerprint (sampled in its own shape)."""
    fp = stats(arr)
    fp.sample = sample(arr, tuple(arr.shape))
    return fp


@dataclass
class Score:
    tensor: str
    perm: tuple | None
    dist: float          # agreement distance (rule 1)
    rho: float           # sample correlation (rule 2), nan where undefined
    same_kind: bool      # zeros and sign alike (rule 2)
    err: float           # the sample's relative RMS error alone (for notes)


class _Group:
    """Reference fingerprints of one shape, as arrays: a device tensor is
    scored against all of them at once."""

    # one entry per reference tensor, set from the fingerprints in __init__
    mean: np.ndarray
    std: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    zeros: np.ndarray
    nonfinite: np.ndarray
    rms: np.ndarray

    def __init__(self, shape: tuple, tensors: list[str], fps: list[Fingerprint]) -> None:
        self.shape = shape
        self.tensors = tensors
        self.kind = np.array([f.kind for f in fps])
        self.samples = np.stack([f.sample for f in fps]) if fps else np.zeros((0, 0))
        for name in ("mean", "std", "lo", "hi", "zeros", "nonfinite", "rms"):
            setattr(self, name, np.array([getattr(f, name) for f in fps], dtype=np.float64))

    def score(self, dev: Fingerprint, d: np.ndarray, perm) -> list[Score]:
        rows = np.flatnonzero(self.kind == dev.kind)
        if not rows.size:
            return []
        R = self.samples[rows]
        ok = np.isfinite(R) & np.isfinite(d)[None, :]
        cnt = ok.sum(axis=1)
        scale = np.maximum(self.rms[rows], _TINY)
        span = np.maximum(np.maximum(self.hi[rows] - self.lo[rows], self.rms[rows]), _TINY)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            diff = np.where(ok, d[None, :] - R, 0.0)
            err = np.sqrt((diff * diff).sum(axis=1) / np.maximum(cnt, 1)) / scale
            any_finite = np.isfinite(R).any(axis=1) | bool(np.isfinite(d).any())
            err = np.where(cnt > 0, err, np.where(any_finite, np.inf, 0.0))
            err = np.where((self.rms[rows] == 0) & (dev.rms == 0), 0.0, err)
            dist = np.max(np.stack([
                err, np.abs(dev.mean - self.mean[rows]) / scale, np.abs(dev.std - self.std[rows]) / scale,
                np.abs(dev.lo - self.lo[rows]) / span, np.abs(dev.hi - self.hi[rows]) / span,
                np.abs(dev.zeros - self.zeros[rows]), np.abs(dev.nonfinite - self.nonfinite[rows])]), axis=0)
            n = np.maximum(cnt, 1)
            a = np.where(ok, d[None, :], 0.0)
            a = np.where(ok, a - (a.sum(axis=1) / n)[:, None], 0.0)
            b = np.where(ok, R, 0.0)
            b = np.where(ok, b - (b.sum(axis=1) / n)[:, None], 0.0)
            den = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
            rho = np.where((cnt >= MIN_CORR_SAMPLES) & (den > 0), (a * b).sum(axis=1) / np.where(den > 0, den, 1.0),
                           np.nan)
        same = ((self.zeros[rows] > ZERO_KIND) == (dev.zeros > ZERO_KIND)) & ((self.lo[rows] >= 0) == (dev.lo >= 0))
        return [Score(self.tensors[r], perm, float(dist[j]), float(rho[j]), bool(same[j]), float(err[j]))
                for j, r in enumerate(rows)]


@dataclass
class Verdict:
    kind: str                    # "match", "pending" or "unmatched"
    tensor: str = ""
    perm: tuple | None = None
    confidence: float = 0.0
    note: str = ""               # match: the evidence; unmatched: the reason
    tier: str = ""               # match: "agree" (rule 1) or "pattern" (rule 2)


def _g(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2g}"


def _near(scores: list[Score], most: int = 3) -> str:
    return ", ".join(f"{s.tensor!r} (distance {_g(s.dist)}"
                     + (f", correlation {s.rho:.3f})" if not math.isnan(s.rho) else ")")
                     for s in sorted(scores, key=lambda s: s.dist)[:most])


def decide(scores: list[Score], elimination: bool = False) -> Verdict:
    """The rule of the module docstring over these candidates (one score per
    reference tensor). "pending": no clear winner, but fewer candidates (some
    claimed by other device tensors) may give one; "unmatched": none can."""
    if not scores:
        return Verdict("unmatched", note="no reference tensor has its shape and dtype")
    by_dist = sorted(scores, key=lambda s: (s.dist, s.tensor))
    best = by_dist[0]
    how = "by elimination (the other candidates were paired first): " if elimination else ""
    if best.dist <= EXACT:
        bar = max(SEPARATE * best.dist, SEPARATE_MIN)
        rivals = [s for s in by_dist[1:] if s.dist < bar]
        if rivals:
            return Verdict("pending", note=f"ambiguous by value: {_near([best] + rivals)} are as close")
        nxt = (f"; next candidate {by_dist[1].tensor!r} at distance {_g(by_dist[1].dist)}" if len(by_dist) > 1
               else "; the only reference tensor of its shape")
        conf = (0.95 - 0.5 * best.dist) * (0.9 if elimination else 1.0)
        return Verdict("match", best.tensor, best.perm, round(conf, 4),
                       f"{how}values agree (distance {_g(best.dist)}, sample error {_g(best.err)}){nxt}", "agree")
    kin = sorted((s for s in scores if s.same_kind and not math.isnan(s.rho)), key=lambda s: (-s.rho, s.tensor))
    if kin and kin[0].rho >= CORR_MIN:
        b = kin[0]
        rivals = [s for s in kin[1:] if s.rho > b.rho - CORR_MARGIN or (1 - s.rho) < CORR_FACTOR * (1 - b.rho)]
        if rivals:
            return Verdict("pending", note=f"ambiguous by value: {_near([b] + rivals)} correlate alike")
        nxt = (f"; next candidate of its kind {kin[1].tensor!r} correlates {kin[1].rho:.3f}" if len(kin) > 1
               else "; the only candidate of its kind")
        conf = min(0.8, 0.6 + 0.2 * (b.rho - (kin[1].rho if len(kin) > 1 else 0.0))) * (0.9 if elimination else 1.0)
        return Verdict("match", b.tensor, b.perm, round(conf, 4),
                       f"{how}values differ (sample error {_g(b.err)}) but keep the reference's pattern "
                       f"(correlation {b.rho:.3f}): the node or what it read is in error{nxt}", "pattern")
    return Verdict("unmatched", note=f"no reference tensor of its shape has close values; closest: "
                                     f"{_near(by_dist)}")


@dataclass
class _Held:
    name: str
    keep: object
    lease: BufferLease | None
    arr: np.ndarray


class ValueMatcher:
    """Value pairing of one job's unmatched device tensors (see the module).

    ``sites``: the reference tensors in execution order; ``reference``: a
    callable yielding the reference values segment by segment ({tensor:
    array}; each segment is fingerprinted and let go before the next), run
    once, when the first decision is due; ``layout``: the job's LayoutVote,
    if any; ``exclude``: reference tensors that are no candidates;
    ``catalog``: where each reference value can be read alone (a golden
    dump: ``shape_of(tensor)`` gives (shape, dtype kind) unread,
    ``value(tensor)`` the value), so that at the end of the stream only a
    held tensor's candidates are read, not the whole reference again."""

    def __init__(self, sites: list, reference: Callable[[], Iterable[dict]], *, layout: L.LayoutVote | None = None,
                 cap_bytes: int = CAP_BYTES, exclude: Iterable[str] = (), catalog=None) -> None:
        self.exclude = set(exclude)     # reference tensors an explicit mapping decides
        self.sites = [s for s in sites if s.tensor not in self.exclude]
        self._reference = reference
        self._catalog = catalog
        self.layout = layout
        self.cap = cap_bytes
        self.refs: dict[str, Fingerprint] | None = None
        self._by_size: dict[int, list[_Group]] = {}
        # the device shapes whose candidates are fingerprinted (None: every
        # reference tensor is): a device tensor's candidates are the
        # reference tensors of its element count and a shape it can be seen in
        self._shapes: set[tuple] | None = set()
        self.held: list[_Held] = []
        self.held_bytes = 0
        self._decided: set[str] = set()   # reference tensors paired before settle (the cap)

    # ----------------------------------------------------------- reference

    def _load(self, shapes: set[tuple] | None = None) -> None:
        """Fingerprint the reference tensors a device tensor of one of these
        shapes can pair with (None: every reference tensor) not fingerprinted
        yet. At the end of the stream only the held tensors' candidates are
        wanted (a user's dump with a few device names of its own: a few
        candidates, not every reference tensor read again); decided earlier,
        at the cap, every one is, so that later ones need no second pass
        over the reference."""
        done = self._shapes
        if done is None or (shapes is not None and shapes <= done):
            return
        by_count: dict[int, list[tuple]] = {}     # the shapes not looked for yet, by element count
        for shape in (shapes - done) if shapes is not None else ():
            by_count.setdefault(math.prod(shape), []).append(shape)
        refs: dict[str, Fingerprint] = dict(self.refs or {})

        def candidate(shape: tuple, kind: str) -> bool:
            return kind in "biuf" and (shapes is None or any(
                self._perms(shape, dev) for dev in by_count.get(math.prod(shape), ())))

        if shapes is not None and self._catalog is not None:
            # each candidate read alone, told by its shape as received
            for t in dict.fromkeys(s.tensor for s in self.sites):
                if t in refs:
                    continue
                known = self._catalog.shape_of(t)
                if known is not None and candidate(*known):
                    v = self._catalog.value(t)
                    if v is not None:
                        refs[t] = fingerprint(np.asarray(v))
        else:
            wanted = {s.tensor for s in self.sites}
            for values in self._reference():
                for t, v in values.items():
                    if t in wanted and t not in refs and v is not None:
                        a = np.asarray(v)
                        if candidate(a.shape, a.dtype.kind):
                            refs[t] = fingerprint(a)
                del values
        self.refs = refs
        self._shapes = None if shapes is None else done | shapes
        by_shape: dict[tuple, list[str]] = {}
        for s in self.sites:       # execution order
            fp = refs.get(s.tensor)
            if fp is not None and fp.size and s.tensor not in by_shape.get(fp.shape, []):
                by_shape.setdefault(fp.shape, []).append(s.tensor)
        self._by_size = {}
        for shape, tensors in by_shape.items():
            g = _Group(shape, tensors, [refs[t] for t in tensors])
            self._by_size.setdefault(refs[tensors[0]].size, []).append(g)

    # -------------------------------------------------------------- scoring

    def _perms(self, ref_shape: tuple, dev_shape: tuple) -> list[tuple]:
        if tuple(ref_shape) == tuple(dev_shape) and len(ref_shape) < 3:
            return [L.identity(len(ref_shape))]
        p, _, undecided = L.resolve(ref_shape, dev_shape, self.layout)
        if p is None:
            return []
        if undecided or (self.layout is None and len(ref_shape) >= 3):
            # the shape does not tell the layout: let the values decide
            fitting = [q for q in L.layout_perms(len(ref_shape)) if L.fits(q, tuple(dev_shape), tuple(ref_shape))]
            return fitting or [p]
        return [p]

    def scores(self, arr: np.ndarray) -> list[Score]:
        """One score per candidate reference tensor (the best of its layouts)."""
        self._load({tuple(arr.shape)})
        groups = self._by_size.get(int(arr.size), [])
        if not arr.size or not groups:
            return []       # nothing of its size to pair with: its statistics (a pass of eight) not made
        dev = stats(arr)
        best: dict[str, Score] = {}
        for g in groups:
            for p in self._perms(g.shape, tuple(arr.shape)):
                for s in g.score(dev, sample(arr, g.shape, p), p):
                    b = best.get(s.tensor)
                    if b is None or (s.dist, -_nz(s.rho)) < (b.dist, -_nz(b.rho)):
                        best[s.tensor] = s
        return list(best.values())

    # ------------------------------------------------------------- deciding

    def offer(self, name: str, arr: np.ndarray, claimed: set, keep: object = None,
              lease: BufferLease | None = None) -> list[tuple[object, Verdict, BufferLease | None]]:
        """Take a device tensor no name settled. It is held (``keep``, a
        retained ``lease`` and the array) until ``settle``: the names come
        first, and a device-only tensor with the values of a tensor the
        device also sends under its name must not take its place. Returns
        what is decided now, as (keep, verdict, lease) (the caller releases
        each lease): an empty tensor, and the oldest held ones when holding
        this one would pass ``cap_bytes`` (decided against every candidate,
        ``claimed`` being the reference tensors paired so far)."""
        if arr.size == 0:
            return [(keep, Verdict("unmatched", note="an empty tensor: no values to match by"), None)]
        out = []
        if (self.held and self.held_bytes + arr.nbytes > self.cap) or arr.nbytes > self.cap:
            self._load()    # decided before the stream ends: other shapes may follow
        while self.held and self.held_bytes + arr.nbytes > self.cap:
            h = self.held.pop(0)
            self.held_bytes -= h.arr.nbytes
            out.append((h.keep, self._now(self.scores(h.arr), claimed), h.lease))
        if arr.nbytes > self.cap:
            out.append((keep, self._now(self.scores(arr), claimed), None))
            return out
        self.held.append(_Held(name, keep, lease.retain() if lease is not None else None, arr))
        self.held_bytes += arr.nbytes
        return out

    def _now(self, scores: list[Score], claimed: set) -> Verdict:
        """A held tensor decided before the stream ends (the cap)."""
        v = decide(scores)
        if v.kind == "unmatched":
            return v
        if v.kind == "match":
            if v.tensor in claimed or v.tensor in self._decided:
                return Verdict("unmatched", note=f"its values are those of {v.tensor!r}, already paired with "
                                                 "another device tensor")
            self._decided.add(v.tensor)
            return v
        return Verdict("unmatched", note=f"{v.note}; decided before the stream ended, the undecided device "
                                         f"tensors held having reached {self.cap >> 20} MiB")

    def settle(self, claimed: set) -> list[tuple[object, Verdict, BufferLease | None]]:
        """The stream has ended: decide every held tensor. First against
        every candidate (a clear winner pairs unless a name or another
        device tensor took it: its values are then a copy); then, in rounds,
        the ambiguous ones against the candidates nobody claimed (a
        candidate two of them win goes to neither). Returns (keep, verdict,
        lease) in the order held; the caller releases each lease."""
        claimed = set(claimed) | self._decided
        held = self.held
        self._load({tuple(h.arr.shape) for h in held})     # nothing is offered after this
        scores = [self.scores(h.arr) for h in held]
        verdicts: dict[int, Verdict] = {}
        wins: dict[str, list[tuple[int, Verdict]]] = {}
        for i in range(len(held)):
            v = decide(scores[i])
            if v.kind == "match":
                wins.setdefault(v.tensor, []).append((i, v))
        # Agreeing values outrank a pattern: a tensor in error may follow the
        # pattern of what it read (its input, paired by agreement) more than
        # its own reference; such a one is decided again among what is left.
        for t, won in wins.items():
            agree = [(i, v) for i, v in won if v.tier == "agree"]
            pattern = [(i, v) for i, v in won if v.tier != "agree"]
            if t in claimed:
                for i, _ in agree:
                    verdicts[i] = Verdict("unmatched", note=f"its values are those of {t!r}, already paired with "
                                                            "another device tensor")
            elif len(agree) == 1 or (not agree and len(pattern) == 1):
                i, v = (agree or pattern)[0]
                verdicts[i] = v
                claimed.add(t)
            elif agree:
                names = [held[i].name for i, _ in agree]
                for i, _ in agree:
                    others = [n for n in names if n != held[i].name]
                    verdicts[i] = Verdict("unmatched", note=f"ambiguous by value: device tensor"
                                          f"{'s' if len(others) > 1 else ''} {', '.join(map(repr, others[:3]))} "
                                          f"{'have' if len(others) > 1 else 'has'} the values of {t!r} too")
                claimed.add(t)     # a copy sent twice leaves the tensor to neither, and to nobody else
        open_ = [i for i in range(len(held)) if i not in verdicts]
        while open_:
            round_: dict[int, Verdict] = {}
            won_by: dict[str, list[int]] = {}
            for i in open_:
                left = [s for s in scores[i] if s.tensor not in claimed]
                v = decide(left, elimination=True) if left else Verdict(
                    "unmatched", note="ambiguous by value, and every candidate (" + _near(scores[i])
                    + ") was paired with another device tensor")
                round_[i] = v
                if v.kind == "match":
                    won_by.setdefault(v.tensor, []).append(i)
            taken = [ids[0] for ids in won_by.values() if len(ids) == 1]
            if not taken:
                for i in open_:
                    v = round_[i]
                    if v.kind == "match":
                        others = [held[j].name for j in won_by[v.tensor] if j != i]
                        v = Verdict("unmatched", note=f"ambiguous by value: once the other device tensors were "
                                                      f"paired, {v.tensor!r} fits it and "
                                                      f"{', '.join(map(repr, others[:3]))} alike")
                    elif v.kind == "pending":
                        v = Verdict("unmatched", note=v.note)
                    verdicts[i] = v
                break
            for i in taken:
                verdicts[i] = round_[i]
                claimed.add(round_[i].tensor)
            open_ = [i for i in open_ if i not in verdicts]
        out = [(h.keep, verdicts[i], h.lease) for i, h in enumerate(held)]
        self.held = []
        self.held_bytes = 0
        return out

    def release(self) -> None:
        """The job stops early: let go of every held tensor."""
        for h in self.held:
            if h.lease is not None:
                h.lease.release()
        self.held.clear()
        self.held_bytes = 0


def _nz(x: float) -> float:
    return -2.0 if math.isnan(x) else x
