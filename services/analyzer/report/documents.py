"""The summary's documents: summary.json, report.html and the two model
explorer files. Each is made from the summary alone, so the report's
process (report.writer) makes them from a copy of it while the job writes
the rest, the page beside summary.json; a job without that process makes
them itself."""
from __future__ import annotations

from pathlib import Path

from layerdiff.analyzer.report.explorer import COSINE_FILE, REL_ERR_FILE, write_node_data
from layerdiff.analyzer.report.html import write_html
from layerdiff.analyzer.report.jsontext import json_text

# what write_pages makes
PAGES = (REL_ERR_FILE, COSINE_FILE, "report.html")


def write_documents(out: Path, summary: dict) -> None:
    """summary.json (ValueError: a NaN in it), then the pages, into the
    report directory ``out``."""
    write_summary(out, summary)
    write_pages(out, summary)


def write_summary(out: Path, summary: dict) -> None:
    """summary.json (ValueError: a NaN in it; TypeError: a value JSON does not take)."""
    (out / "summary.json").write_text(json_text(summary, allow_nan=False), encoding="utf-8")


def write_pages(out: Path, summary: dict) -> None:
    """The explorer's node data, then the page."""
    write_node_data(out, summary)
    write_html(out, summary)
