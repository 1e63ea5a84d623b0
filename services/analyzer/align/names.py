"""Alignment of device tensor names to reference tensors.

Names are compared after normalization (``/``, ``.``, ``\\`` and space become
``_``), as vendor dump files name nodes. A device name matches a reference
tensor name, or the name of the node that produces it (first output), or
``node:k`` for its k-th output. ``map_node_dict`` ({reference name: device
name}) overrides the match for the nodes it names, the device name being a
device tensor name or the name of the device node that wrote it; ``pairs``
({device tensor name: Pairing}, from the two graphs) comes next;
``skip_keys`` drops nodes whose name contains a key (any case);
``exclude_node_list`` drops the nodes named. What the options named and never
met is kept, to be reported with the job's coverage.

When the exact name matches nothing, the match is relaxed step by step for
what converters do to names, and a relaxed candidate is taken only when it
is unambiguous (it stands for exactly one reference tensor):

1. case and surrounding whitespace, a ``:k`` output suffix (``name:0``:
   output 0 of node ``name`` or the tensor ``name``), ``op@k`` (an operator
   dumped again, read as ``op`` so that it counts as a duplicate);
2. converter affixes: leading path components (``npu_model/``, ``graph_0/``,
   dropped one at a time) and trailing tokens (``_npu``, ``-npu``, ``.om``,
   ``_int8``, ... or any token foreign to the reference's names); an affix
   that several records matched by is learned and tried first afterwards;
3. Keras / TF scope instances (``functional_1_1`` vs ``functional_1``,
   ``sequential_3`` vs ``sequential``, ``conv_in_1`` vs ``conv_in``): numeric
   ``_k`` tokens appended to a component.

Every decision carries its method, a confidence and a note saying why;
``rows()`` lists them for ``alignment.csv``. Reference tensors claimed by
``map_node_dict`` or ``pairs`` are never taken by a relaxed name.
"""
from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from layerdiff.analyzer.compare.compiled import kernels
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import TensorSite

_SEP = re.compile(r"[/.\\ ]")
_TOKEN_SEP = re.compile(r"[_-]+")
_AT = re.compile(r"^(.*)@\d+((?::\d+)?)$")
_COLON0 = re.compile(r"^(.*):0+$")
_COLON = re.compile(r"^(.+):(\d+)$")
# an ONNX exporter's output tensor of a node (``/Clip_output_0``, ``X.output.1``, sanitized alike)
_OUTPUT = re.compile(r"^(.+?)_output_(\d+)$")
_TAIL = re.compile(r"^(.*?)((?::\d+)?)$")
_LETTER = re.compile(r"[^\W\d_]")
_SIGN = re.compile(r"[^\w]")

METHODS = ("map", "graph", "fused", "original_op", "name", "value")

# trailing tokens converters and runtimes add to every name; any other token
# is dropped only when no reference name uses it (fused names such as
# ``conv1_relu`` must not lose their ``relu``)
CONVERTER_SUFFIXES = frozenset({
    "npu", "om", "int8", "uint8", "int16", "int4", "fp16", "fp32", "bf16", "f16", "f32", "quant", "quantized",
    "dequant", "qdq", "acl", "ascend", "cann", "atc", "trt", "tensorrt", "rknn", "nnie", "tflite", "mnn", "ncnn",
    "converted", "optimized", "simplified", "sim", "device", "dev", "hw",
})
LEARN_AFTER = 3          # records matched by one affix before it is preferred

# confidence factors of each relaxation (an exact name is 1.0)
_C_CASE = 0.98
_C_COLON = 0.97
_C_REPEAT = 0.95
_C_AFFIX = 0.85
_C_LEARNED = 0.92
_C_SCOPE = 0.75
_C_NODE = 0.9
_C_SIGNS = 0.93


def normalize(name: str) -> str:
    return _SEP.sub("_", name)


def canonical(name: str) -> str:
    """The relaxed spelling: normalized, trimmed, case folded."""
    return normalize(name.strip()).casefold()


def plain(name: str) -> str:
    """A canonical name as scripts sanitize names for file names: every sign
    ('/', ':', '-', ...) written as '_'."""
    return _SIGN.sub("_", name)


@dataclass(frozen=True)
class Pairing:
    """A pairing of a device tensor with a reference tensor decided from the
    two graphs (graphalign), not from the names."""
    ref_tensor: str
    method: str
    confidence: float
    note: str = ""
    # the device holds the reference's axes permuted: dev.transpose(perm) has
    # the reference's shape (a Transpose the converter moved past this node)
    perm: tuple[int, ...] | None = None
    # the device holds it in onnxruntime's blocked NCHWc layout (layout.unblock_nchwc)
    blocked: bool = False


@dataclass(frozen=True)
class Decision:
    site: TensorSite | None
    skip_reason: str = ""      # non-empty: known node, deliberately not compared
    method: str = "name"       # one of METHODS
    confidence: float = 1.0    # 0..1
    note: str = ""             # a few words of evidence
    perm: tuple[int, ...] | None = None   # from the graphs: how the device permuted the axes
    blocked: bool = False      # from the graphs: held in the blocked NCHWc layout


@dataclass
class _Cand:
    site: TensorSite
    confidence: float
    notes: tuple
    affixes: tuple = ()        # (("prefix"|"suffix", canonical text), ...) this match dropped


def _own_names_first(pairs: dict, unpaired: list[str], given_way: dict | None = None) -> dict:
    """Where the graphs pair several device tensors with one reference
    tensor (a device Transpose after the kernel, a device node computing the
    same op on the same inputs before an extra step), the device tensor that
    carries the reference tensor's own name is the one the device means: it
    is compared, the others are not paired. The same holds for a device
    tensor of that name the graphs could not pair (its producer has no
    reference counterpart): its name decides, and a differently named pair
    gives way. A device tensor the graphs know to differ (a fold's
    partial result) is not among ``unpaired``: its name decides nothing."""
    by_ref: dict[str, list[str]] = {}
    for dev, p in pairs.items():
        by_ref.setdefault(normalize(p.ref_tensor), []).append(dev)
    named = {normalize(d) for d in unpaired}
    out = dict(pairs)
    for ref, devs in by_ref.items():
        own = [d for d in devs if normalize(d) == ref]
        if own or ref in named:
            for d in devs:
                if normalize(d) != ref:
                    if given_way is not None:
                        given_way[d] = (pairs[d].ref_tensor, "another device copy of this reference tensor; the "
                                                              "one carrying its name is compared")
                    del out[d]
    return out


def _tokens(stem: str) -> list[str]:
    return [t for t in _TOKEN_SEP.split(stem) if t]


def _shape(key: str) -> tuple[tuple, tuple]:
    """(non-numeric tokens with the ``:k`` tail, numeric gaps): the form
    Keras/TF scope instances share."""
    m = _TAIL.match(key)
    assert m is not None     # _TAIL matches any one-line name
    words, gaps = _stem_shape(m.group(1))
    return (words, m.group(2)), gaps


@lru_cache(maxsize=1 << 14)
def _stem_shape(stem: str) -> tuple[tuple, tuple]:
    # (a tensor's key and its ':0' key share their stem: a reference's names split once)
    words: list[str] = []
    gaps: list[list[str]] = [[]]
    for t in _tokens(stem):
        if t.isdigit():
            gaps[-1].append(t)
        else:
            words.append(t)
            gaps.append([])
    return tuple(words), tuple(tuple(g) for g in gaps)


def _instance_of(a: tuple, b: tuple) -> bool:
    """Numeric gaps that differ only by instance suffixes appended (one side's
    numbers a prefix of the other's, in every gap), and not identical."""
    if len(a) != len(b) or a == b:
        return False
    return all(x[:len(y)] == y or y[:len(x)] == x for x, y in zip(a, b))


def _differ(a: tuple, b: tuple) -> set[int]:
    return {i for i, (x, y) in enumerate(zip(a, b)) if x != y}


def _letters(name: str) -> str:
    return "".join(_LETTER.findall(name))


class _Relaxed(NamedTuple):
    """Reference names as relaxed spellings find them."""
    canon: dict[str, list[TensorSite]]              # canonical key -> sites
    plain: dict[str, list[TensorSite]]              # plain(canonical key) -> sites
    shown: dict[str, str]                           # canonical -> the reference's own spelling
    vocab: set[str]                                 # the reference's name tokens and op types
    shapes: dict[tuple, list[tuple[TensorSite, tuple]]]     # _shape words -> (site, numeric gaps)


class Aligner:
    def __init__(self, sites: list[TensorSite], *, map_node_dict: dict[str, str] | None = None,
                 skip_keys: list[str] | None = None, exclude_node_list: list[str] | None = None,
                 pairs: dict | None = None, fused: dict[str, str] | None = None,
                 groups: dict[str, list[str]] | None = None, unpaired: list[str] | None = None,
                 folded: dict[str, str] | None = None,
                 attributed: dict[str, tuple[str, str]] | None = None) -> None:
        """``pairs``, ``fused``, ``groups`` and ``unpaired`` come from the two
        graphs (layerdiff.analyzer.align.graph): device tensor -> Pairing;
        reference tensor computed inside a device fusion -> the device node;
        reference tensor closing a fusion -> the reference nodes it covers;
        device tensors the graph walk lost (GraphAlignment.lost); reference
        tensors the device folded into constants -> why; device tensors that
        are not compared but stand for a reference tensor (an INT8 view, the
        device's copy of a weight, a second copy) -> (reference tensor, why)."""
        self.sites = sites
        self.attributed: dict[str, tuple[str, str]] = dict(attributed or {})
        pairs = _own_names_first(pairs or {}, unpaired or [], self.attributed)
        self.fused = dict(fused or {})
        self.folded = dict(folded or {})
        self.groups = dict(groups or {})
        self.skip_keys = [k for k in (skip_keys or []) if k]
        self._skip_folded = [(k, k.casefold(), canonical(k) or k.casefold()) for k in self.skip_keys]
        self._by_key: dict[str, TensorSite] = {}
        self._tensor: dict[str, TensorSite] = {}
        for s in sites:
            self._tensor.setdefault(s.tensor, s)
            for key in self._keys(s):
                self._by_key.setdefault(key, s)
        self._relaxed_index: _Relaxed | None = None     # made when a name is first looked up relaxed
        self._claimed: set[str] = set()      # reference tensors map_node_dict or pairs decide
        self._mapped: dict[str, TensorSite] = {}
        self._map_canon: dict[str, str] = {}  # canonical device name -> normalized one
        self._map_entries: dict[str, tuple[str, str]] = {}
        for ref_name, dev_name in (map_node_dict or {}).items():
            site = self._lookup_reference(ref_name)
            if site is None:
                raise LayerdiffError("is not a node or tensor of the reference model", node=ref_name,
                                     field="map_node_dict")
            if not dev_name or not dev_name.strip():
                raise LayerdiffError("maps to an empty device name", node=ref_name, field="map_node_dict")
            self._mapped[normalize(dev_name)] = site
            self._map_canon.setdefault(canonical(dev_name), normalize(dev_name))
            self._map_entries[normalize(dev_name)] = (ref_name, dev_name)
            self._claimed.add(site.tensor)
        self._map_claims = set(self._claimed)
        self._map_used: set[str] = set()
        self._pairs: dict[str, Pairing] = {}
        self._pairs_canon: dict[str, str] = {}
        for dev_name, p in (pairs or {}).items():
            site = self._tensor.get(p.ref_tensor)
            if site is None:
                raise LayerdiffError(f"is not a tensor of the reference model (paired with device tensor "
                                     f"{dev_name!r})", node=p.ref_tensor, field="pairs")
            if p.method not in METHODS:
                raise LayerdiffError(f"unknown pairing method {p.method!r} (one of {', '.join(METHODS)})",
                                     node=dev_name, field="pairs")
            if not 0.0 <= p.confidence <= 1.0:
                raise LayerdiffError(f"confidence {p.confidence!r} is not in [0, 1]", node=dev_name, field="pairs")
            self._pairs[normalize(dev_name)] = p
            self._pairs_canon.setdefault(canonical(dev_name), normalize(dev_name))
        self._pair_claims = {p.ref_tensor for p in self._pairs.values()}
        self._claimed |= self._pair_claims
        ex = [n for n in (exclude_node_list or []) if n and n.strip()]
        self.exclude = set()
        for n in ex:
            c = canonical(n)
            self.exclude.add(c)
            m = _COLON0.match(c)
            if m:
                self.exclude.add(m.group(1))
        self.unknown_excludes = sorted(n for n in ex if not self._known_name(canonical(n)))
        self.unused_skip_keys = sorted(
            k for k, kf, kc in self._skip_folded
            if not any(kf in n.casefold() or kc in canonical(n) for s in sites for n in (s.node, s.tensor)))
        self._learned: Counter = Counter()   # (kind, canonical affix) -> records matched by it
        self._pending: Counter = Counter()   # unknown suffix -> names it would have paired
        self._hint: tuple[TensorSite, str] | None = None   # the last _relax's near miss
        self._rows: dict[str, dict] = {}     # device name -> its alignment row, in decision order
        # closest's answers since the last match (the reports ask for each
        # unmatched name two or three times, each a look through every name)
        self._closest: dict[str, tuple[int, list[str]]] = {}

    # ----------------------------------------------------------------- index

    @property
    def _relaxed(self) -> _Relaxed:
        """The index of relaxed spellings, made at the first name that is
        not a reference name as written (two dumps of one runtime may never
        need it: a twentieth of such a job's time)."""
        if self._relaxed_index is None:
            ix = _Relaxed({}, {}, {}, set(), {})
            for s in self.sites:
                # a site's keys once each (a dump's node is its tensor: 'x', 'x:0', 'x')
                for ck in dict.fromkeys(k.casefold() for k in self._keys(s)):
                    bucket = ix.canon.setdefault(ck, [])
                    if all(x.tensor != s.tensor for x in bucket):
                        bucket.append(s)
                        words, gaps = _shape(ck)
                        ix.shapes.setdefault(words, []).append((s, gaps))
                    signless = ix.plain.setdefault(plain(ck), [])
                    if all(x.tensor != s.tensor for x in signless):
                        signless.append(s)
                    ix.vocab.update(_tokens(ck))
                ix.vocab.add(s.op_type.casefold())
                ix.shown.setdefault(canonical(s.tensor), s.tensor)
                if s.node != s.tensor:
                    ix.shown.setdefault(canonical(s.node), s.node)
            ix.vocab.difference_update(CONVERTER_SUFFIXES)
            self._relaxed_index = ix
        return self._relaxed_index

    @cached_property
    def _shown_alike(self) -> Alike:
        """The relaxed index's names, their letters counted (closest)."""
        return Alike(self._relaxed.shown)

    @staticmethod
    def _keys(s: TensorSite) -> list[str]:
        tensor = normalize(s.tensor)
        keys = [tensor, normalize(f"{s.node}:{s.output_index}")]
        if s.output_index == 0:
            keys.append(tensor if s.node == s.tensor else normalize(s.node))
        return keys

    def _known_name(self, c: str) -> bool:
        if c in self._relaxed.canon or c in self._relaxed.shown:
            return True
        m = _COLON0.match(c)
        return m is not None and (m.group(1) in self._relaxed.canon or m.group(1) in self._relaxed.shown)

    def _lookup_reference(self, name: str) -> TensorSite | None:
        """A reference name as a user writes it (map_node_dict): exact, else
        relaxed for case and whitespace when that is unambiguous."""
        site = self._by_key.get(normalize(name))
        if site is not None:
            return site
        found = self._relaxed.canon.get(canonical(name), [])
        return found[0] if len(found) == 1 else None

    def _look(self, key: str) -> dict[str, tuple[TensorSite, str]]:
        """Unclaimed reference sites under a canonical key, with the note a
        ``:0`` read as output 0 needs."""
        out: dict[str, tuple[TensorSite, str]] = {}
        for s in self._relaxed.canon.get(key, []):
            if s.tensor not in self._claimed:
                out.setdefault(s.tensor, (s, ""))
        m = _COLON0.match(key)
        if m:
            for s in self._relaxed.canon.get(m.group(1), []):
                if s.tensor not in self._claimed:
                    out.setdefault(s.tensor, (s, "':0' read as output 0"))
        return out

    # -------------------------------------------------------------- skipping

    def _skipped(self, names: list[str]) -> str:
        if not self._skip_folded and not self.exclude:
            return ""       # nothing to skip: no name need be folded (three a record)
        for n in names:
            nf, nc = n.casefold(), canonical(n)
            for k, kf, kc in self._skip_folded:
                if kf in nf or kc in nc:
                    return f"name contains skip key {k!r}"
            if nc in self.exclude:
                return "listed in exclude_node_list"
        return ""

    def skip_reason_for(self, site: TensorSite) -> str:
        return self._skipped([site.node, site.tensor, f"{site.node}:{site.output_index}"])

    # -------------------------------------------------------------- matching

    def match(self, device_name: str, device_node: str = "", slot: int = 0, *, tensor: bool = True,
              original: tuple[str, int] | None = None) -> Decision:
        """The reference tensor a device tensor stands for: by map_node_dict
        (its name, or the device's name of the node that wrote it), by the
        graph pairing, by the framework op the runtime says it stands for
        (``original``: an Ascend dump's original_op, name and output index),
        or by its name, exact before relaxed.

        ``tensor`` False: ``device_name`` names a node (the one whose input a
        record is, the one a performance record times): a lookup of the
        reference node, not a device tensor of its own"""
        self._closest.clear()
        d = self._decide(device_name, device_node, slot, tensor, original)
        names = [device_name] + ([d.site.node, d.site.tensor] if d.site else [])
        reason = self._skipped(names)
        if reason:
            d = Decision(d.site, reason, d.method, d.confidence, d.note, d.perm, d.blocked)
        if device_name not in self._rows and (d.site is not None or d.note):
            self._rows[device_name] = {"reference_tensor": d.site.tensor if d.site else "",
                                       "device_tensor": device_name, "method": d.method,
                                       "confidence": round(d.confidence, 4), "note": d.note}
        return d

    def _decide(self, device_name: str, device_node: str, slot: int, tensor: bool,
                original: tuple[str, int] | None = None) -> Decision:
        keys = [normalize(device_name)]
        if device_node:
            # only an explicit mapping names device nodes: a tensor whose
            # name matches must not lose its place to a node-name guess
            keys.append(normalize(device_node if slot == 0 else f"{device_node}:{slot}"))
        for key in keys if self._mapped else ():
            key = key if key in self._mapped else self._map_canon.get(canonical(key), key)
            site = self._mapped.get(key)
            if site is not None:
                self._map_used.add(key)
                ref, dev = self._map_entries[key]
                return Decision(site, "", "map", 1.0, f"map_node_dict {ref!r} -> {dev!r}")
        key = keys[0] if keys[0] in self._pairs or not self._pairs else \
            self._pairs_canon.get(canonical(device_name), "")
        p = self._pairs.get(key)
        if p is not None:
            site = self._tensor[p.ref_tensor]
            if site.tensor not in self._map_claims:   # map_node_dict decides it otherwise
                return Decision(site, "", p.method, p.confidence, p.note, p.perm, p.blocked)
        if original is not None and tensor:
            d = self._by_original(*original)
            if d is not None:
                return d
        # the reference tensor of this very name before one its spelling relaxes to
        # ("a_b" is not "a/b", though both normalize to one key)
        site = (self._tensor.get(device_name) if tensor else None) or self._by_key.get(keys[0])
        if site is not None and tensor and site.tensor in self._pair_claims:
            # the graphs pair that reference tensor with another device tensor
            # (a fold's partial result keeps the Conv's name): the name is not it
            return Decision(None, "", "name", 0.0, f"the graphs pair {site.tensor!r} with another device tensor")
        if site is not None:
            return Decision(site, "", "name", 1.0, "same name")
        cands, ambiguous = self._relax(device_name, learn=True)
        if cands is not None:
            return Decision(cands.site, "", "name", round(cands.confidence, 4), "; ".join(cands.notes))
        if tensor and device_node and canonical(device_node) != canonical(device_name):
            # a dump that names tensors (logits) against one that names nodes
            # (fc): the device node that wrote it, once its own name matched nothing
            site = self._by_key.get(normalize(device_node if slot == 0 else f"{device_node}:{slot}"))
            if site is not None and site.tensor not in self._pair_claims and site.tensor not in self._map_claims:
                return Decision(site, "", "name", _C_NODE, f"named after the device node {device_node!r} that "
                                                           "wrote it")
        if ambiguous:
            shown = ", ".join(repr(s.tensor) for s in ambiguous[:4]) + (" ..." if len(ambiguous) > 4 else "")
            return Decision(None, "", "name", 0.0, f"ambiguous: could be {shown}; left unmatched")
        return Decision(None, "", "name", 0.0, self._hint[1] if self._hint else "")

    def _by_original(self, name: str, index: int) -> Decision | None:
        """The reference tensor of the framework op a runtime names as a
        device output's origin (a fused device op's output stands for the
        last op it covers, whatever the device op is called); None where the
        reference has no such op, or another pairing claims it."""
        said = f"the runtime's original_op {name!r} output {index}"
        spelled = name if index == 0 else f"{name}:{index}"
        site = self._by_key.get(normalize(spelled))
        confidence, notes = 1.0, [said]
        if site is None:
            cand, _ = self._relax(spelled)
            if cand is None:
                return None
            site, confidence = cand.site, cand.confidence
            notes += list(cand.notes)
        if site.tensor in self._claimed:
            return None
        return Decision(site, "", "original_op", round(confidence, 4), "; ".join(notes))

    def _relax(self, device_name: str, learn: bool = False) -> tuple[_Cand | None, list[TensorSite]]:
        """(the one candidate, or None with the sites that made it ambiguous);
        a near miss, if any, is left in ``_hint``."""
        self._hint = None
        raw = device_name.strip()
        c = canonical(device_name)
        forms: list[tuple[str, float, tuple]] = [(c, 1.0, ())]
        m = _AT.match(c)
        if m:
            base = m.group(1) + m.group(2)
            shown_base = raw[:len(m.group(1))] + raw[len(raw) - len(m.group(2)):] if len(raw) == len(c) else base
            forms.append((base, _C_REPEAT, (f"repeated dump {raw!r} read as {shown_base!r}",)))
        # a node's name against its output tensor's, either way round (one
        # dump names nodes, the other the tensors they write)
        out = _OUTPUT.match(c)
        colon = _COLON.match(c)
        if out:
            n = int(out.group(2))
            forms.append((out.group(1) if n == 0 else f"{out.group(1)}:{n}", _C_NODE,
                          (f"the output tensor {raw!r} read as output {n} of its node",)))
        elif colon:      # 'X:1' (TensorFlow's spelling) against 'X_output_1' (an ONNX exporter's)
            forms.append((f"{colon.group(1)}_output_{int(colon.group(2))}", _C_NODE,
                          (f"the tensor {raw!r} read as output {int(colon.group(2))} of its node",)))
        else:
            forms.append((f"{c}_output_0", _C_NODE, (f"the node {raw!r} read as its output tensor",)))
        # 1. case, whitespace, ':0', '@k', node against tensor
        found = self._gather((f, conf, notes, ()) for f, conf, notes in forms)
        if found:
            return self._one(found, device_name)
        # 1b. either side's names sanitized for file names ('conv1/Relu:0' as 'conv1_Relu_0')
        for f, conf, notes in forms:
            for s in self._relaxed.plain.get(plain(f), []):
                prev = found.get(s.tensor)
                if s.tensor not in self._claimed and (prev is None or prev.confidence < conf * _C_SIGNS):
                    found[s.tensor] = _Cand(s, conf * _C_SIGNS, notes + (
                        f"spelled as {s.tensor!r} with its signs written as '_'",))
        if found:
            return self._one(found, device_name)
        # 2. converter affixes: learned ones first
        learned_p = [a for (kind, a), n in self._learned.most_common() if kind == "prefix" and n >= LEARN_AFTER]
        learned_s = [a for (kind, a), n in self._learned.most_common() if kind == "suffix" and n >= LEARN_AFTER]
        if learned_p or learned_s:
            found = self._gather(self._learned_variants(forms, learned_p, learned_s, raw, c))
            if len(found) == 1:
                return self._accept(found, device_name, learn)
        found = self._gather(self._affix_variants(forms, raw, c))
        if found:
            if len(found) == 1:
                return self._accept(found, device_name, learn)
            return None, [x.site for x in found.values()]
        # a trailing token that no converter is known for and no reference name
        # uses: a device's own intermediate (conv3_raw) as often as a renaming,
        # so taken only once several names have carried it
        found = self._gather(self._affix_variants(forms, raw, c, generic=True))
        if len(found) == 1:
            cand = next(iter(found.values()))
            suffix = next(a for kind, a in cand.affixes if kind == "suffix")
            if learn:
                self._pending[suffix] += 1
            if self._pending[suffix] >= LEARN_AFTER:
                return self._accept(found, device_name, learn)
            self._hint = (cand.site, f"would be {cand.site.tensor!r} without the suffix {suffix!r}, which no "
                                     f"converter is known to add: taken once {LEARN_AFTER} names carry it")
        # 3. Keras / TF scope instances (None: ambiguous by the reference's own numbering)
        scoped: dict[str, _Cand | None] = {}
        for f, conf, notes in forms:
            words, gaps = _shape(f)
            group = self._relaxed.shapes.get(words, [])
            for s, ref_gaps in group:
                if s.tensor in self._claimed or not _instance_of(gaps, ref_gaps):
                    continue
                relaxed = _differ(gaps, ref_gaps)
                # where the reference itself numbers its names (conv_in, conv_in_1), a number
                # there tells layers apart, not instances: no guess
                if any(o is not s and relaxed & _differ(o_gaps, ref_gaps) for o, o_gaps in group):
                    scoped[s.tensor] = None
                    continue
                scoped.setdefault(s.tensor, _Cand(s, conf * _C_SCOPE, notes + (
                    "scope instance suffixes ignored (numbered '_k' of a Keras/TF scope or layer)",)))
        if any(v is None for v in scoped.values()):
            return None, [self._tensor[t] for t in scoped]
        if scoped:
            return self._one({t: v for t, v in scoped.items() if v is not None}, device_name)
        return None, []

    def _gather(self, variants) -> dict[str, _Cand]:
        """The best candidate per reference tensor over the variants."""
        found: dict[str, _Cand] = {}
        for key, conf, notes, affixes in variants:
            for tensor, (site, extra) in self._look(key).items():
                conf2 = conf * (_C_COLON if extra else 1.0)
                prev = found.get(tensor)
                if prev is None or conf2 > prev.confidence:
                    found[tensor] = _Cand(site, conf2, notes + ((extra,) if extra else ()), affixes)
        return found

    def _one(self, found: dict[str, _Cand], device_name: str) -> tuple[_Cand | None, list[TensorSite]]:
        if len(found) != 1:
            return None, [x.site for x in found.values()]
        cand = next(iter(found.values()))
        raw = device_name.strip()
        notes = list(cand.notes)
        letters = _letters(raw)
        # (either way round: a node's name is part of its output tensor's)
        if not any(_letters(x) in letters or letters in _letters(x) for x in (cand.site.tensor, cand.site.node)):
            notes.insert(0, "case ignored")
            cand.confidence *= _C_CASE
        if raw != device_name:
            notes.insert(0, "surrounding whitespace ignored")
        cand.notes = tuple(notes)
        return cand, []

    def _accept(self, found: dict[str, _Cand], device_name: str, learn: bool):
        cand, _ = self._one(found, device_name)
        assert cand is not None     # called with one candidate found
        if learn:
            for a in cand.affixes:
                self._learned[a] += 1
        return cand, []

    def _shown_affix(self, raw: str, c: str, start: int, end: int) -> str:
        """The device's own spelling of c[start:end]."""
        return raw[start:end] if len(raw) == len(c) else c[start:end]

    def _suffix_ok(self, dropped: str, generic: bool) -> bool:
        toks = _tokens(dropped)
        if not toks or not all(_LETTER.search(t) for t in toks):
            return False
        if (all(t in CONVERTER_SUFFIXES for t in toks) or self._pending[dropped] >= LEARN_AFTER
                or self._learned[("suffix", dropped)] >= LEARN_AFTER):
            return True
        return generic and not any(t in self._relaxed.vocab for t in toks)

    def _affix_variants(self, forms, raw: str, c: str, generic: bool = False):
        for n_form, (f, conf, notes) in enumerate(forms):
            m = _TAIL.match(f)
            assert m is not None     # _TAIL matches any one-line name
            stem, tail = m.group(1), m.group(2)
            seps = list(_TOKEN_SEP.finditer(stem))
            starts = [0] + [s.end() for s in seps]
            ends = [len(stem)] + [s.start() for s in seps[-2:][::-1] if self._suffix_ok(stem[s.start():], generic)]
            for i in starts:
                for j in ends:
                    if (i, j) == (0, len(stem)) or j <= i or not _LETTER.search(stem[i:j]):
                        continue
                    bits, affixes = list(notes), []
                    if i:
                        shown = self._shown_affix(raw, c, 0, i)
                        bits.append(f"name after dropping prefix {shown!r}")
                        affixes.append(("prefix", stem[:i]))
                    if j < len(stem):
                        shown = self._shown_affix(raw, c, j, len(stem)) if n_form == 0 else stem[j:]
                        bits.append(f"suffix {shown!r} dropped")
                        affixes.append(("suffix", stem[j:]))
                    yield stem[i:j] + tail, conf * _C_AFFIX ** len(affixes), tuple(bits), tuple(affixes)

    def _learned_variants(self, forms, prefixes: list[str], suffixes: list[str], raw: str, c: str):
        for n_form, (f, conf, notes) in enumerate(forms):
            m = _TAIL.match(f)
            assert m is not None     # _TAIL matches any one-line name
            stem, tail = m.group(1), m.group(2)
            for p in [""] + prefixes:
                if p and not stem.startswith(p):
                    continue
                for s in [""] + suffixes:
                    if (not p and not s) or (s and not stem.endswith(s)) or len(p) + len(s) >= len(stem):
                        continue
                    bits, affixes = list(notes), []
                    for kind, a in (("prefix", p), ("suffix", s)):
                        if a:
                            n = self._learned[(kind, a)]
                            shown = (self._shown_affix(raw, c, 0, len(a)) if kind == "prefix" else
                                     self._shown_affix(raw, c, len(stem) - len(a), len(stem)) if n_form == 0 else a)
                            bits.append(f"name after dropping {kind} {shown!r} (learned from {n} records)")
                            affixes.append((kind, a))
                    yield stem[len(p):len(stem) - len(s)] + tail, conf * _C_LEARNED ** len(affixes), tuple(bits), \
                        tuple(affixes)

    # -------------------------------------------------------------- reporting

    @property
    def has_graph(self) -> bool:
        """Pairings came from the two graphs (a device model): values are
        then never needed to pair what names leave open."""
        return bool(self._pairs or self.fused or self.groups)

    @property
    def claimed(self) -> frozenset[str]:
        """Reference tensors map_node_dict or the graphs decided."""
        return frozenset(self._claimed)

    def rows(self) -> list[dict]:
        """Every pairing decided so far, in the order decided: reference_tensor,
        device_tensor, method, confidence, note (for alignment.csv); a device
        name left unmatched because several reference tensors fit has an
        empty reference_tensor and says which."""
        return [dict(r) for r in self._rows.values()]

    def unused_map_entries(self) -> list[tuple[str, str]]:
        """map_node_dict entries whose device name no device tensor carried."""
        return [e for k, e in self._map_entries.items() if k not in self._map_used]

    def closest(self, device_name: str, n: int = 3) -> list[str]:
        """Reference names that look most like a device name that matched
        none, for a "did you mean": the candidates a relaxed match found
        ambiguous, reference names inside the device name (a converter's
        affixes around them), then names that look alike."""
        # the first n of a longer answer, whatever n: each step adds its
        # names best first, and the names alike come difflib's best first
        kept = self._closest.get(device_name)
        if kept is None or kept[0] < n:
            many = max(n, CLOSEST_KEPT)
            kept = self._closest[device_name] = (many, self._find_closest(device_name, many))
        return kept[1][:n]

    def _find_closest(self, device_name: str, n: int) -> list[str]:
        out: list[str] = []

        def add(name: str) -> None:
            if name not in out:
                out.append(name)

        cand, ambiguous = self._relax(device_name)
        near = [self._hint[0]] if self._hint else []
        c = canonical(device_name)
        for s in ([cand.site] if cand else []) + ambiguous + near:
            add(max((s.tensor, s.node), key=lambda x: difflib.SequenceMatcher(None, canonical(x), c).ratio()))
        m = _AT.match(c)
        base = m.group(1) + m.group(2) if m else c
        m = _COLON0.match(base)
        base = m.group(1) if m else base
        seps = list(_TOKEN_SEP.finditer(base))
        starts, ends = [0] + [m.end() for m in seps], [m.start() for m in seps] + [len(base)]
        inside = {base[i:j] for i in starts for j in ends if j - i >= 3 and (i, j) != (0, len(base))}
        for k in sorted((k for k in inside if k in self._relaxed.shown and _LETTER.search(k)), key=len, reverse=True):
            add(self._relaxed.shown[k])
        for k in close_matches(base, self._relaxed.shown, n=n, cutoff=0.6, alike=self._shown_alike):
            add(self._relaxed.shown[k])
        return out[:n]


CLOSEST_KEPT = 3


class Alike:
    """difflib's two bounds of the ratio (real_quick_ratio, quick_ratio) of
    one word against every name of a list at once: each name's letters are
    counted once, and a word's shared letters are the element-wise least of
    two counts (quick_ratio a name at a time took 3 us, for each of a
    model's thousand names and each unmatched device name)."""

    def __init__(self, names) -> None:
        self.names = list(names)
        self.lengths = np.array([len(x) for x in self.names], np.int64)
        # every name's code points in one array, counted by (name, letter)
        codes = _codes("".join(self.names))
        letters, col = np.unique(codes, return_inverse=True)
        row = np.repeat(np.arange(len(self.names)), self.lengths)
        self.counts = np.bincount(row * len(letters) + col, minlength=len(self.names) * len(letters)) \
            .reshape(len(self.names), len(letters))
        self.letters = {chr(c): i for i, c in enumerate(letters.tolist())}

    def bounded(self, word: str, cutoff: float) -> list[tuple[float, str]]:
        """(quick_ratio, name) of the names whose two bounds reach ``cutoff``,
        best bound first, in the names' order among equals (as a stable sort
        of difflib's figures leaves them)."""
        mine = np.zeros(len(self.letters), np.int64)
        for ch, k in Counter(word).items():
            col = self.letters.get(ch)
            if col is not None:
                mine[col] = k
        length = self.lengths + len(word)
        with np.errstate(divide="ignore", invalid="ignore"):
            # difflib's _calculate_ratio: 2.0 * matches / length, 1.0 for two empty strings
            real = np.where(length > 0, 2.0 * np.minimum(self.lengths, len(word)) / length, 1.0)
            quick = np.where(length > 0, 2.0 * np.minimum(self.counts, mine).sum(axis=1) / length, 1.0)
        kept = np.flatnonzero((real >= cutoff) & (quick >= cutoff))
        kept = kept[np.argsort(-quick[kept], kind="stable")]
        return list(zip(quick[kept].tolist(), [self.names[i] for i in kept.tolist()]))


def close_matches(word: str, possibilities, n: int = 3, cutoff: float = 0.6, *,
                  alike: Alike | None = None) -> list[str]:
    """difflib.get_close_matches's answer (the same names in the same order),
    the full ratio taken only where quick_ratio, its upper bound, leaves a
    name a place among the best n so far: best bound first, a few hundred
    names of a model's alike, most of them never matched out in full.
    ``alike``: the possibilities' letters counted already (Alike of the
    same names, in the same order)."""
    s = difflib.SequenceMatcher()
    s.set_seq2(word)
    bounded = (alike if alike is not None else Alike(possibilities)).bounded(word, cutoff)
    best: list[tuple[float, str]] = []
    # the full ratio compiled, as difflib takes it where it junks nothing
    # (its autojunk starts at 200 characters of the word): 70 us a name in
    # the interpreter, forty names a word
    compiled = _codes(word) if len(word) < 200 else None
    for q, x in bounded:
        if len(best) >= n and q < best[-1][0]:
            break       # no ratio past its bound: neither this one's nor the rest's
        if compiled is not None:
            length = len(x) + len(word)
            r = 2.0 * kernels()._matched(_codes(x), compiled) / length if length else 1.0
        else:
            s.set_seq1(x)
            r = s.ratio()
        if r >= cutoff:
            best.append((r, x))
            best.sort(reverse=True)
            del best[n:]
    return [x for _, x in best]


def _codes(text: str) -> np.ndarray:
    """A string's code points, as the compiled matcher reads them (an
    array of its own: a writable one is the type it was built for)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.int32).copy()
