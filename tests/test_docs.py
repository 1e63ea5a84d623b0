"""The manual (README.md, docs/): its reference page is the program's own
(commands, options, environment variables, table columns), and every
example marked runnable runs as written, on the bundled model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# an example the tests run: <!-- runnable --> (or <!-- runnable exit=N -->) on the line before its fence
RUNNABLE = re.compile(r"<!-- runnable(?: exit=(\d+))? -->\n```(sh|python)\n(.*?)\n```", re.S)


def test_the_reference_page_is_generated_from_the_program():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(DOCS))
    assert (DOCS / "reference.md").read_text(encoding="utf-8") == gen_reference.render(), \
        "docs/reference.md is out of date: run python docs/gen_reference.py"


def test_every_variable_the_code_reads_is_described_and_none_other():
    from layerdiff.common.settings import SETTINGS

    read = set()
    for path in (ROOT / "services").rglob("*.py"):
        read |= set(re.findall(r"\"(LAYERDIFF_[A-Z0-9_]+)\"", path.read_text(encoding="utf-8")))
    read.discard("LAYERDIFF_")
    assert read - set(SETTINGS) == set(), "read but not in common.settings.SETTINGS"
    assert set(SETTINGS) - read == set(), "described but read nowhere"


def test_every_command_and_option_is_in_the_reference():
    import argparse

    from layerdiff.client.cli import build_parser

    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"### `layerdiff {name}" in page, name
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, (name, option)


def test_the_front_page_is_short_and_links_into_the_manual():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 12 * 1024
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 10 and all((ROOT / link).is_file() for link in links), links


def _examples(page: Path) -> list[tuple[str, str, set[int]]]:
    out = []
    for m in RUNNABLE.finditer(page.read_text(encoding="utf-8")):
        out.append((m.group(2), m.group(3), {int(m.group(1))} if m.group(1) else {0, 1}))
    return out


def test_the_getting_started_page_has_its_examples_marked_runnable():
    # the test below is made per page holding examples: none found would run nothing
    assert len(_examples(DOCS / "getting-started.md")) >= 5


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if _examples(p)))
def test_the_runnable_examples_run_as_written(page, tmp_path):
    """Each page's examples in turn, in one directory, as a user types them:
    each ends with an answer (0 or 1, or the status it names) and no
    traceback or warning reaches the user."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for kind, code, allowed in _examples(DOCS / page):
        cmd = ["bash", "-c", code] if kind == "sh" else [sys.executable, "-c", code]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode in allowed, f"{page}: {code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]
