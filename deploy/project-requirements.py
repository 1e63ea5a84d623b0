#!/usr/bin/env python3
"""Prints the project's runtime requirements, one a line: pyproject.toml's
[project] dependencies plus the optional groups named (comma-separated).
The images install these, pinned by deploy/constraints.txt, in a layer of
their own before the project itself, so that a code change does not
reinstall every dependency.

    python deploy/project-requirements.py pyproject.toml tf > requirements.txt
"""
import sys
import tomllib


def requirements(pyproject: str, extras: str = "") -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    groups = project.get("optional-dependencies", {})
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        if extra not in groups:
            sys.exit(f"project-requirements: no optional group {extra!r} in {pyproject} (has: {', '.join(groups)})")
        reqs += groups[extra]
    return reqs


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")))
