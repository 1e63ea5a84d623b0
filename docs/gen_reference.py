"""Writes the manual's reference page (docs/reference.md) from what the
program itself declares: every command and option from the command line's
parser (layerdiff.client.cli.build_parser), every environment variable from
layerdiff.common.settings.SETTINGS, and the report tables' columns from the
Arrow schema module. Generated, so it cannot drift from the code.

    python docs/gen_reference.py            # write docs/reference.md
    python docs/gen_reference.py --check    # exit 1 if docs/reference.md is out of date
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "reference.md"


def _cell(text: object) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def _option(action: argparse.Action) -> tuple[str, str, str]:
    names = ", ".join(f"`{o}`" for o in action.option_strings) if action.option_strings else f"`{action.dest}`"
    if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
        metavar = action.metavar or action.dest.upper()
        names += f" {metavar if isinstance(metavar, str) else ' '.join(metavar)}"
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, False, "") or isinstance(action, argparse._HelpAction) \
        else f"`{default}`"
    return names, _cell(action.help if action.help != argparse.SUPPRESS else ""), shown


def _commands(parser: argparse.ArgumentParser, prefix: str = "layerdiff") -> list[str]:
    out: list[str] = []
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return out
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, p in sub.choices.items():
        if p.description is None and helps.get(name) is None:
            continue
        title = f"{prefix} {name}"
        nested = any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
        out += [f"### `{title}`", "", _cell(p.description or helps.get(name) or ""), ""]
        rows = [_option(a) for a in p._actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                and a.help != argparse.SUPPRESS]
        if rows:
            out += ["| argument | meaning | default |", "| --- | --- | --- |"]
            out += [f"| {n} | {h} | {d} |" for n, h, d in rows]
            out.append("")
        if nested:
            out += _commands(p, title)
    return out


def render() -> str:
    from layerdiff.client.cli import build_parser
    from layerdiff.common.schema import REPORT_SCHEMA_VERSION, REPORT_TABLES
    from layerdiff.common.settings import SETTINGS

    lines = ["# Reference", "",
             "Generated from the program (`python docs/gen_reference.py`): its command line's parser, the "
             "settings it reads from the environment and the report tables' schema. A test holds this page to "
             "the code.", "",
             "## Commands", ""]
    lines += _commands(build_parser())
    lines += ["## Environment variables", "",
              "Read at start; a malformed limit is an error naming the variable, never a limit turned off.", "",
              "| variable | read by | sets | default |", "| --- | --- | --- | --- |"]
    lines += [f"| `{name}` | {_cell(who)} | {_cell(what)} | {_cell(default)} |"
              for name, (who, what, default) in sorted(SETTINGS.items())]
    lines += ["", "## Report tables", "",
              f"Schema version {REPORT_SCHEMA_VERSION}. Each file's columns, as its schema documents them "
              "(`layerdiff.read_report` reads them; see [Reports](reports.md)).", ""]
    for fname, schema in REPORT_TABLES.values():
        lines += [f"### `{fname}`", "", "| column | type | meaning |", "| --- | --- | --- |"]
        lines += [f"| `{f.name}` | {_cell(f.type)} | {_cell((f.metadata or {}).get(b'doc', b'').decode())} |"
                  for f in schema]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is out of date: run python docs/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
