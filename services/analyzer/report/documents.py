"""The summary's documents: summary.json, report.html and the two model
explorer files. Each is made from the summary alone, so the report's
process (report.writer) makes them from a copy of it while the job writes
the rest; a job without that process makes them itself."""
from __future__ import annotations

from pathlib import Path

from layerdiff.analyzer.report.explorer import write_node_data
from layerdiff.analyzer.report.html import write_html
from layerdiff.analyzer.report.jsontext import json_text


def write_documents(out: Path, summary: dict) -> None:
    """summary.json (ValueError: a NaN in it), the explorer's node data,
    then the page, into the report directory ``out``."""
    (out / "summary.json").write_text(json_text(summary, allow_nan=False), encoding="utf-8")
    write_node_data(out, summary)
    write_html(out, summary)
