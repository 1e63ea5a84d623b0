"""Alignment of device tensor names to reference tensors.

Names are compared after normalization (``/``, ``.``, ``\\`` and space become
``_``), as vendor dump files name nodes. A device name matches a reference
tensor name, or the name of the node that produces it (first output), or
``node:k`` for its k-th output. ``map_node_dict`` ({reference name: device
name}) overrides the match for the nodes it names, the device name being a
device tensor name or the name of the device node that wrote it;
``skip_keys`` drops nodes whose name contains a key; ``exclude_node_list``
drops the nodes named. What the options named and never met is kept, to be
reported with the job's coverage.
"""
from __future__ import annotations

import difflib
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
        self._shown: dict[str, str] = {}     # normalized -> the reference's own spelling
        for s in sites:
            for key in self._keys(s):
                self._by_key.setdefault(key, s)
            self._shown.setdefault(normalize(s.tensor), s.tensor)
            self._shown.setdefault(normalize(s.node), s.node)
        self._mapped: dict[str, TensorSite] = {}
        self._map_entries: dict[str, tuple[str, str]] = {}
        for ref_name, dev_name in (map_node_dict or {}).items():
            site = self._by_key.get(normalize(ref_name))
            if site is None:
                raise LayerdiffError("is not a node or tensor of the reference model", node=ref_name,
                                     field="map_node_dict")
            if not dev_name:
                raise LayerdiffError("maps to an empty device name", node=ref_name, field="map_node_dict")
            self._mapped[normalize(dev_name)] = site
            self._map_entries[normalize(dev_name)] = (ref_name, dev_name)
        self._map_used: set[str] = set()
        self.unknown_excludes = sorted(n for n in (exclude_node_list or []) if n and normalize(n) not in self._shown)
        self.unused_skip_keys = sorted(k for k in self.skip_keys
                                       if not any(k in n for s in sites for n in (s.node, s.tensor)))

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

    def match(self, device_name: str, device_node: str = "", slot: int = 0) -> Decision:
        """The reference tensor a device tensor stands for: by its name, or
        by the device's name of the node that wrote it."""
        keys = [normalize(device_name)]
        if device_node:
            # only an explicit mapping names device nodes: a tensor whose
            # name matches must not lose its place to a node-name guess
            keys.append(normalize(device_node if slot == 0 else f"{device_node}:{slot}"))
        site = None
        for key in keys:
            site = self._mapped.get(key)
            if site is not None:
                self._map_used.add(key)
                break
        if site is None:
            site = self._by_key.get(keys[0])
        names = [device_name] + ([site.node, site.tensor] if site else [])
        reason = self._skipped(names)
        return Decision(site, reason)

    def unused_map_entries(self) -> list[tuple[str, str]]:
        """map_node_dict entries whose device name no device tensor carried."""
        return [e for k, e in self._map_entries.items() if k not in self._map_used]

    def closest(self, device_name: str, n: int = 3) -> list[str]:
        """Reference names that look most like a device name that matched
        none, for a "did you mean"."""
        found = difflib.get_close_matches(normalize(device_name), list(self._shown), n=n, cutoff=0.6)
        return [self._shown[k] for k in found]

    def skip_reason_for(self, site: TensorSite) -> str:
        return self._skipped([site.node, site.tensor])
