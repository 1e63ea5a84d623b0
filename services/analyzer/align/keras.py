"""Pair two Keras models layer by layer: a second instance of one
architecture, or a rebuild, where Keras numbered the auto-named layers apart
(``conv2d_3`` on the device for ``conv2d`` in the reference) so that no name
relaxation can tell which is which.

A Keras model's ops are named ``model/layer_scope/op``. The layer scopes are
taken in execution order on both sides; they pair one to one when the two
lists are as long and each pair is the same kind of layer (the name without
its Keras and TensorFlow counters: ``conv2d_3_1`` and ``conv2d_1`` are both
``conv2d``). A device op then pairs with the reference op at the same place
inside the paired layer (``convolution``, ``BiasAdd``...) and output index.
Ops outside every layer, and places two ops share, are left to the names.
"""
from __future__ import annotations

import re

from layerdiff.analyzer.align.names import Pairing
from layerdiff.common.tf.graph import TFGraph

_COUNTERS = re.compile(r"(_\d+)+$")


def keras_pairs(ref: TFGraph, dev: TFGraph) -> dict[str, Pairing]:
    """{device tensor: Pairing} for every op inside a paired layer."""
    rs, ds = _scopes(ref), _scopes(dev)
    if not rs or len(rs) != len(ds) or any(_COUNTERS.sub("", a) != _COUNTERS.sub("", b) for a, b in zip(rs, ds)):
        return {}
    ref_scope = dict(zip(ds, rs))
    index = {name: k for k, name in enumerate(rs)}
    ref_sites = _by_place(ref)
    out: dict[str, Pairing] = {}
    for (scope, inner, slot), sites in _by_place(dev).items():
        target = ref_sites.get((ref_scope[scope], inner, slot))
        if len(sites) != 1 or not target or len(target) != 1:
            continue
        same = scope == ref_scope[scope]
        note = (f"Keras layer {index[ref_scope[scope]]} ({_COUNTERS.sub('', scope)}): scope {scope!r} here, "
                f"{ref_scope[scope]!r} in the reference")
        out[sites[0].tensor] = Pairing(target[0].tensor, "graph", 1.0 if same else 0.9, note)
    return out


def _scopes(g: TFGraph) -> list[str]:
    """The layer scopes (the component under the model's), in execution order."""
    seen: dict[str, None] = {}
    for s in g.sites:
        parts = s.node.split("/")
        if len(parts) >= 3:
            seen.setdefault(parts[1])
    return list(seen)


def _by_place(g: TFGraph) -> dict[tuple, list]:
    """(layer scope, op path inside it, output index) -> the sites there."""
    places: dict[tuple, list] = {}
    for s in g.sites:
        parts = s.node.split("/")
        if len(parts) >= 3:
            places.setdefault((parts[1], "/".join(parts[2:]), s.output_index), []).append(s)
    return places
