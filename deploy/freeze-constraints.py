#!/usr/bin/env python3
"""Writes deploy/constraints.txt: every package the images install, pinned
to the version installed in this environment (the one the tests ran with).

What is pinned is the dependency closure of the project's runtime
requirements (pyproject.toml, with the extras the images offer) and of the
tools the image build uses (stub generation, wheel build); test, benchmark
and editor tools are left out because no image installs them.

    .venv/bin/python deploy/freeze-constraints.py > deploy/constraints.txt
    .venv/bin/python deploy/freeze-constraints.py --check   # exit 1 if out of date
"""
from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGE_EXTRAS = ("tf",)                     # deploy/Dockerfile's EXTRAS
BUILD_TOOLS = ("grpcio-tools", "mypy-protobuf", "setuptools", "wheel")   # the images' build stage
HEADER = """\
# Pinned versions of everything the images install (pip install -c).
# Generated from the tested environment by deploy/freeze-constraints.py;
# regenerate it there after changing a dependency.
"""


def closure(roots: list[str]) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` and everything they
    require here (markers evaluated for this interpreter, extras followed)."""
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    todo = [(Requirement(r), frozenset()) for r in roots]
    while todo:
        req, parent_extras = todo.pop()
        if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in (sorted(parent_extras) or [""])):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(f"freeze-constraints: {req.name} is required but not installed here") from None
        found[name] = dist.version
        for sub in dist.requires or []:
            todo.append((Requirement(sub), frozenset(req.extras)))
    return found


def project_roots(pyproject: Path = ROOT / "pyproject.toml", extras=IMAGE_EXTRAS) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    roots = list(project.get("dependencies", []))
    for extra in extras:
        roots += project.get("optional-dependencies", {}).get(extra, [])
    return roots + list(BUILD_TOOLS)


def render() -> str:
    pins = closure(project_roots())
    lines = [f"{md.distribution(n).metadata['Name']}=={v}" for n, v in sorted(pins.items())]
    return HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        current = (ROOT / "deploy" / "constraints.txt").read_text()
        if current != text:
            sys.exit("deploy/constraints.txt is out of date: run deploy/freeze-constraints.py > deploy/constraints.txt")
    else:
        sys.stdout.write(text)
