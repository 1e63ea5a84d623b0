"""Which axis permutation brings a device tensor to the reference's layout.

A device that computes in another layout (NHWC where the reference is NCHW,
or NCHW against a TensorFlow NHWC reference) dumps every activation with its
axes permuted. The shape alone usually says how: the *layout permutations*
(the reference's own axis order, channels moved last, channels moved first)
are tried before any other, so that a permutation that would swap H and W is
never taken where a layout change explains the shape. Only where several
layout permutations fit the same shape (C == H == W, for a 4-D tensor) does
the shape not tell, and there the dump's *dominant layout* decides: the
permutation that most of the job's tensors of the same rank with a telling
shape needed (``LayoutVote``, fed by the job's stream consumer). A swap of H
and W is never chosen from shapes; the diagnosis names it when the data
prove it (``diagnose.evidence.layout_match``).

Permutations are given the numpy way: ``dev.transpose(p)`` has the
reference's shape, ``dev.shape[p[k]] == ref.shape[k]``.
"""
from __future__ import annotations

import itertools
from collections import Counter
from functools import lru_cache

Perm = tuple[int, ...]


def identity(ndim: int) -> Perm:
    return tuple(range(ndim))


def layout_perms(ndim: int) -> list[Perm]:
    """The permutations a layout change makes, the reference's own first:
    as is; a channels-last device against a channels-first reference
    (NHWC -> NCHW: (0, 3, 1, 2)); a channels-first device against a
    channels-last reference (NCHW -> NHWC: (0, 2, 3, 1)). Ranks 3 to 5
    (NCW, NCHW, NCDHW and their channels-last forms)."""
    ident = identity(ndim)
    if not 3 <= ndim <= 5:
        return [ident]
    out = [ident]
    for p in ((0, ndim - 1, *range(1, ndim - 1)), (0, *range(2, ndim), 1)):
        if p not in out:
            out.append(p)
    return out


def fits(p: Perm, dev_shape: tuple, ref_shape: tuple) -> bool:
    return len(p) == len(dev_shape) == len(ref_shape) and all(dev_shape[i] == ref_shape[k] for k, i in enumerate(p))


def effect(p: Perm, ref_shape: tuple) -> Perm:
    """What a permutation does to the data: the device axis each reference
    axis of size > 1 comes from (axes of size 1 move without moving data)."""
    return tuple(i for k, i in enumerate(p) if ref_shape[k] != 1)


def keeps_order(p: Perm, ref_shape: tuple) -> bool:
    """True when the permutation leaves the data in place (it only moves
    axes of size 1): a reshape, not a transpose."""
    e = effect(p, ref_shape)
    return all(a < b for a, b in zip(e, e[1:]))


def _distinct_effects(perms, ref_shape: tuple) -> list[Perm]:
    seen: dict[Perm, Perm] = {}
    for p in perms:
        seen.setdefault(effect(p, ref_shape), p)
    return list(seen.values())


@lru_cache(maxsize=4096)
def _layouts_fitting(ref_shape: tuple, dev_shape: tuple) -> tuple[Perm, ...] | None:
    """The layout permutations that fit, one for each distinct effect;
    None where the shapes are no permutation of each other. Kept for each
    pair of shapes: a model's tensors share a few dozen, and this was asked
    for every tensor of a dump."""
    if len(ref_shape) != len(dev_shape) or sorted(ref_shape) != sorted(dev_shape):
        return None
    return tuple(_distinct_effects([p for p in layout_perms(len(ref_shape)) if fits(p, dev_shape, ref_shape)],
                                   ref_shape))


def _all_fitting(dev_shape: tuple, ref_shape: tuple) -> list[Perm]:
    if len(dev_shape) != len(ref_shape) or sorted(dev_shape) != sorted(ref_shape) or len(dev_shape) > 6:
        return []
    return [p for p in itertools.permutations(range(len(dev_shape))) if fits(p, dev_shape, ref_shape)]


def evidence(ref_shape: tuple, dev_shape: tuple) -> Perm | None:
    """The layout this tensor's shapes prove, for the vote: the one layout
    permutation that fits, else None. Other permutations (a shape only an
    H/W swap explains) are undone for their own tensor but never vote: the
    vote must not turn an H/W swap into the dump's layout. Tensors of rank
    < 3 and tensors with fewer than two axes of size > 1 (their bytes read
    the same in any layout) prove nothing."""
    ref_shape, dev_shape = tuple(ref_shape), tuple(dev_shape)
    if len(ref_shape) != len(dev_shape) or len(ref_shape) < 3 or sum(s != 1 for s in ref_shape) < 2:
        return None
    std = _layouts_fitting(ref_shape, dev_shape)
    return std[0] if std is not None and len(std) == 1 else None


class LayoutVote:
    """The dump's dominant layout, per tensor rank, from the tensors whose
    shapes tell it (``note``); consulted for the shapes that do not
    (``decided``). One per job, owned by its stream consumer.

    While the stream runs a permutation decides once it has ``settle``
    votes and at least two thirds of them (the consumer holds the ambiguous
    tensors until then); once the stream has ended (``close``) a strict
    majority decides, however few the votes."""

    def __init__(self, settle: int = 2) -> None:
        self.settle = max(1, settle)
        self.counts: dict[int, Counter] = {}
        self.closed = False

    def note(self, ref_shape: tuple, dev_shape: tuple) -> Perm | None:
        """Count one tensor's evidence; returns what it proved (None: nothing)."""
        p = evidence(ref_shape, dev_shape)
        if p is not None:
            self.counts.setdefault(len(p), Counter())[p] += 1
        return p

    def close(self) -> None:
        self.closed = True

    def dominant(self, ndim: int) -> Perm | None:
        """The permutation most tensors of this rank needed, if a strict majority did."""
        c = self.counts.get(ndim)
        if not c:
            return None
        (p, n), total = c.most_common(1)[0], sum(c.values())
        return p if 2 * n > total else None

    def decided(self, ndim: int) -> Perm | None:
        """The dominant permutation, once it may decide (see the class)."""
        p = self.dominant(ndim)
        if p is None or self.closed:
            return p
        n, total = self.counts[ndim][p], sum(self.counts[ndim].values())
        return p if n >= self.settle and 3 * n >= 2 * total else None

    def describe(self, ndim: int) -> str:
        c = self.counts.get(ndim)
        p = self.dominant(ndim)
        if not c or p is None:
            return "no dominant layout"
        return f"{c[p]} of {sum(c.values())} rank-{ndim} tensors with a telling shape"

    def as_dict(self) -> dict:
        """{rank: {permutation: votes}} (for a report or a log)."""
        return {nd: {str(p): n for p, n in c.most_common()} for nd, c in sorted(self.counts.items())}


def resolve(ref_shape: tuple, dev_shape: tuple, vote: LayoutVote | None = None) -> tuple[Perm | None, str, bool]:
    """(permutation, note, undecided) for a device tensor whose shape is a
    permutation of the reference's (equal shapes included); (None, '', False)
    when it is not one.

    ``undecided`` is True when the shape does not tell (several layout
    permutations fit) and the vote has not decided yet: the caller may hold
    the tensor until it has; the permutation returned then is the reference's
    own order where it fits (the tensor compared as sent)."""
    ref_shape, dev_shape = tuple(ref_shape), tuple(dev_shape)
    n = len(ref_shape)
    std = _layouts_fitting(ref_shape, dev_shape)
    if std is None:
        return None, "", False
    dom = vote.decided(n) if vote is not None else None
    if dom is not None and fits(dom, dev_shape, ref_shape):
        others = [p for p in std if effect(p, ref_shape) != effect(dom, ref_shape)]
        if others and dom != identity(n):
            assert vote is not None     # dom came from it
            return dom, (f"layout: device axes {dom} transposed to the reference: the shape fits several layouts, "
                         f"the dump's dominant layout decided ({vote.describe(n)})"), False
        return dom, note_for(dom, ref_shape), False
    if len(std) == 1:
        return std[0], note_for(std[0], ref_shape), False
    if std:
        ident = identity(n)
        undecided = vote is not None and not vote.closed
        p = ident if fits(ident, dev_shape, ref_shape) else std[0]
        if vote is None:
            return p, note_for(p, ref_shape), False
        why = f"layout: the shape fits several layouts and the dump shows no dominant one for rank {n}; "
        return p, why + (f"device axes {p} taken" if p != ident else "compared as sent"), undecided
    other = _distinct_effects(_all_fitting(dev_shape, ref_shape), ref_shape)
    if len(other) == 1:
        return other[0], note_for(other[0], ref_shape), False
    return None, "", False


def note_for(p: Perm, ref_shape: tuple) -> str:
    if p == identity(len(p)):
        return ""
    if keeps_order(p, ref_shape):
        return "shape differs only by axes of size 1"
    return f"layout: device axes {p} transposed to the reference"


# Channel blocks of onnxruntime's x86 NCHWc kernels: 8 (AVX2), 16 (AVX-512),
# 4 (SSE / NEON builds); a device tensor says its block only through its values.
NCHWC_BLOCKS = (8, 16, 4)


def unblock_nchwc(dev, ref):
    """A device tensor in the blocked NCHWc layout ([N, Cpad, H, W] whose
    memory is [N, Cpad/B, H, W, B]) in the reference's NCHW layout, with the
    padding channels dropped, and a note; the block B is the one under which
    the values agree best with the reference. (None, why) when no block fits."""
    import numpy as np

    if dev.ndim != 4 or len(ref.shape) != 4 or dev.shape[0] != ref.shape[0] or dev.shape[2:] != ref.shape[2:]:
        return None, f"device shape {list(dev.shape)} is no blocked NCHWc view of {list(ref.shape)}"
    n, cpad, h, w = dev.shape
    c = ref.shape[1]
    best = None
    for b in NCHWC_BLOCKS:
        if cpad % b or cpad < c or cpad - c >= b:
            continue
        x = np.ascontiguousarray(dev).reshape(n, cpad // b, h, w, b).transpose(0, 1, 4, 2, 3).reshape(n, cpad, h, w)
        x = x[:, :c]
        with np.errstate(all="ignore"):
            err = float(np.nanmean(np.abs(x.astype(np.float64) - np.asarray(ref, dtype=np.float64))))
        if best is None or err < best[0]:
            best = (err, b, x)
    if best is None:
        return None, f"{cpad} channels fit no NCHWc block ({', '.join(map(str, NCHWC_BLOCKS))}) for {c}"
    return np.ascontiguousarray(best[2]), f"blocked NCHWc layout (block {best[1]}) undone"
