"""The dump configuration, the same file the Ascend runtime reads (``acl.json``)::

    {"dump": {"dump_path": "output",
              "dump_list": [{"model_name": "resnet50", "layer": ["conv1", "fc"]}],
              "dump_mode": "all",
              "dump_op_switch": "off",
              "dump_debug": "on"}}

- ``dump_path``: where the dump goes (relative paths from the current
  directory); files land in ``{dump_path}/{time}/{device_id}/{model_id}/{data_index}``
  in the Ascend format, or directly in ``dump_path`` for the other formats.
- ``dump_list``: which models and layers to dump. An entry whose
  ``model_name`` is not this model's (its file stem or graph name) is ignored;
  a ``layer`` list names nodes (or tensors); no ``layer`` means every node.
  An empty list dumps every node.
- ``dump_mode``: ``output`` (default), ``input`` or ``all``.
- ``dump_op_switch``: ``on`` dumps every operator whatever ``dump_list`` says
  (the runtime's single-operator switch); ``off`` (default) lets the list decide.
- ``dump_debug``: ``on`` writes an overflow record beside every node the run
  flags as overflowing; a file holding only ``dump_debug`` (the runtime's
  overflow-only configuration) dumps only the overflowing nodes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import check_dump_mode

_KNOWN = {"dump_path", "dump_list", "dump_mode", "dump_op_switch", "dump_debug"}


def _switch(value: object, key: str, shown: str) -> bool:
    if value in (None, "", "off"):
        return False
    if value == "on":
        return True
    raise LayerdiffError(f"{key} must be \"on\" or \"off\", not {value!r}", file=shown, field=key)


@dataclass
class DumpConfig:
    dump_path: str
    dump_mode: str = "output"
    layers: set[str] | None = None     # None: every node
    op_switch: bool = False
    debug: bool = False
    overflow_only: bool = False

    @classmethod
    def parse(cls, text: str, model_names: set[str], shown: str = "acl.json") -> DumpConfig:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise LayerdiffError(f"is not valid JSON: {e}", file=shown) from e
        d = doc.get("dump") if isinstance(doc, dict) else None
        if not isinstance(d, dict):
            raise LayerdiffError('must hold {"dump": {...}}', file=shown, field="dump")
        unknown = sorted(set(d) - _KNOWN)
        if unknown:
            raise LayerdiffError(f"unknown keys {unknown} (known: {sorted(_KNOWN)})", file=shown, field=unknown[0])
        path = d.get("dump_path")
        if not isinstance(path, str) or not path:
            raise LayerdiffError("dump_path must be a non-empty path", file=shown, field="dump_path")
        try:
            mode = check_dump_mode(d.get("dump_mode") or "output")
        except LayerdiffError as e:
            raise LayerdiffError(str(e), file=shown, field="dump_mode") from None
        op_switch = _switch(d.get("dump_op_switch"), "dump_op_switch", shown)
        debug = _switch(d.get("dump_debug"), "dump_debug", shown)
        listed = d.get("dump_list", [])
        if not isinstance(listed, list):
            raise LayerdiffError("dump_list must be a list of {model_name, layer}", file=shown, field="dump_list")
        layers: set[str] | None = None
        for i, entry in enumerate(listed):
            if not isinstance(entry, dict):
                raise LayerdiffError(f"dump_list[{i}] is not an object", file=shown, field="dump_list")
            name = entry.get("model_name")
            if name is not None and name not in model_names:
                continue
            layer = entry.get("layer")
            if layer is None or layer == []:
                layers = None
                break
            if not isinstance(layer, list) or not all(isinstance(x, str) and x for x in layer):
                raise LayerdiffError(f"dump_list[{i}].layer must be a list of node names", file=shown,
                                     field="layer")
            layers = (layers or set()) | set(layer)
        else:
            if listed and layers is None:
                # every entry named another model: nothing of this one is dumped
                layers = set()
        if op_switch:
            layers = None
        overflow_only = debug and "dump_mode" not in d and "dump_list" not in d
        return cls(str(Path(path)), "all" if overflow_only else mode, layers, op_switch, debug, overflow_only)

    @classmethod
    def load(cls, path: str | Path, model_names: set[str]) -> DumpConfig:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LayerdiffError(f"cannot be read: {e}", file=str(p)) from e
        return cls.parse(text, model_names, str(p))

    def check_layers(self, known: set[str], shown: str = "acl.json") -> None:
        """A layer that is neither a node nor a tensor of the model is a typo
        the user wants to hear about."""
        if self.layers:
            missing = sorted(self.layers - known)
            if missing:
                raise LayerdiffError(f"dump_list names layers the model does not have: {missing[:5]}", file=shown,
                                     field="layer")


def dump_live_run(model: str | Path, inputs: str | Path, config: str | Path, *, precision: str = "fp32",
                  device: str = "cpu", device_model: str | Path | None = None, fmt: str = "ascend") -> dict:
    """Run the model on the device as the collector does and write what the
    configuration asks for; returns where it went and what was written."""
    from layerdiff.collector.dumps.directory import write_dump
    from layerdiff.collector.live.onnxrt import LiveRunner
    from layerdiff.common.onnxgraph import load_inputs, load_model, tensor_sites

    def read(p, field):
        try:
            return Path(p).read_bytes()
        except OSError as e:
            raise LayerdiffError(f"cannot be read: {e.strerror}", file=str(p), field=field) from e

    model_bytes = read(model, "model")
    graph = load_model(model_bytes, Path(model).name)
    cfg = DumpConfig.load(config, {Path(model).stem, graph.graph.name})
    cfg.check_layers({s.node for s in tensor_sites(graph)} | {s.tensor for s in tensor_sites(graph)}, str(config))
    runner = LiveRunner(model_bytes, load_inputs(read(inputs, "inputs"), Path(inputs).name), precision=precision,
                        device=device, device_model_bytes=read(device_model, "device_model") if device_model else None,
                        model_name=Path(model).name,
                        device_model_name=Path(device_model).name if device_model else "device.onnx")
    records = list(runner.records(cfg.dump_mode, cfg.layers))
    if not cfg.debug:
        for r in records:
            r.overflow = ""
    if cfg.overflow_only:
        flagged = {r.node for r in records if r.overflow}
        records = [r for r in records if r.node in flagged]
    # what the run could not give is said, not dropped: dump_skip.log beside the tensors
    skips = [f"{r.name}: {r.message or 'no value'}".replace("\r", "\\r") for r in records if r.array is None]
    written = [r for r in records if r.array is not None]
    out = write_dump(cfg.dump_path, written, fmt)
    log = Path(cfg.dump_path) / "dump_skip.log"
    if skips:
        log.write_text("".join(f"{line}\n" for line in skips), encoding="utf-8")
    return {"dump_path": str(out), "records": len(written), "mode": cfg.dump_mode, "format": fmt,
            "skipped": len(skips), "skip_log": str(log) if skips else "", "skips": skips[:3],
            "overflowing_nodes": sorted({r.node for r in written if r.overflow})}
