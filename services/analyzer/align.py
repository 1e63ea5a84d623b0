"""Alignment of device tensor names to reference tensors.

Names are compared after normalization (``/``, ``.``, ``\\`` and space become
``_``), as vendor dump files name nodes. A device name matches a reference
tensor name, or the name of the node that produces it (first output), or
``node:k`` for its k-th output. ``map_node_dict`` ({reference name: device
name}) overrides the match for the nodes it names; ``skip_keys`` drops nodes
whose name contains a key; ``exclude_node_list`` drops the nodes named.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import TensorSite

_SEP = re.compile(r"[/.\\ ]")


def normalize(name: str) -> str:
    return _SEP.sub("_", name)


@dataclass(frozen=True)
class Decision:
    site: TensorSite | None
    skip_reason: str = ""      # non-empty: known node, deliberately not compared


class Aligner:
    def __init__(self, sites: list[TensorSite], *, map_node_dict: dict[str, str] | None = None,
                 skip_keys: list[str] | None = None, exclude_node_list: list[str] | None = None) -> None:
        self.sites = sites
        self.skip_keys = [k for k in (skip_keys or []) if k]
        self.exclude = {normalize(n) for n in (exclude_node_list or []) if n}
        self._by_key: dict[str, TensorSite] = {}
        for s in sites:
            for key in self._keys(s):
                self._by_key.setdefault(key, s)
        self._mapped: dict[str, TensorSite] = {}
        for ref_name, dev_name in (map_node_dict or {}).items():
            site = self._by_key.get(normalize(ref_name))
            if site is None:
                raise LayerdiffError("is not a node or tensor of the reference model", node=ref_name,
                                     field="map_node_dict")
            if not dev_name:
                raise LayerdiffError("maps to an empty device name", node=ref_name, field="map_node_dict")
            self._mapped[normalize(dev_name)] = site

    @staticmethod
    def _keys(s: TensorSite) -> list[str]:
        keys = [normalize(s.tensor), normalize(f"{s.node}:{s.output_index}")]
        if s.output_index == 0:
            keys.append(normalize(s.node))
        return keys

    def _skipped(self, names: list[str]) -> str:
        for n in names:
            for k in self.skip_keys:
                if k in n:
                    return f"name contains skip key {k!r}"
            if normalize(n) in self.exclude:
                return "listed in exclude_node_list"
        return ""

    def match(self, device_name: str) -> Decision:
        key = normalize(device_name)
        site = self._mapped.get(key) or self._by_key.get(key)
        names = [device_name] + ([site.node, site.tensor] if site else [])
        reason = self._skipped(names)
        return Decision(site, reason)

    def skip_reason_for(self, site: TensorSite) -> str:
        return self._skipped([site.node, site.tensor])
