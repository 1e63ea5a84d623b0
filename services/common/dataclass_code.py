"""The code of the methods ``dataclasses`` writes for a class (``__init__``,
``__repr__``, ``__eq__``, a frozen class's ``__setattr__``...), compiled
ahead of time.

dataclasses writes each of those methods as text and compiles it when the
class is made. A command comparing two dumps makes some forty classes as
it starts, 178 methods: compiling them is 18 ms of its start-up's one core
(two thirds of making the classes). ``make setup`` records the code of the
methods layerdiff's modules make (``python -m layerdiff.common.dataclass_code``)
into the bytecode cache beside this module, for this interpreter; ``use``
has dataclasses take the recorded code of a text it holds and compile any
other as before. A method's text is its own key: a class changed since the
recording is compiled anew, never given another's code.

The command line uses it (its process is layerdiff's own); a program that
imports layerdiff keeps dataclasses as it is.
"""
from __future__ import annotations

import dataclasses
import importlib
import marshal
import os
import pkgutil
import sys
import types
from collections.abc import Callable

TABLE = os.path.join(os.path.dirname(__file__), "__pycache__",
                     f"dataclass_methods.{sys.implementation.cache_tag}.marshal")


def _compiled(text: str) -> types.CodeType:
    # what exec makes of the text dataclasses hands it: no __future__ flag of the caller's
    return compile(text, "<string>", "exec", dont_inherit=True)


def _install(run: Callable) -> None:
    # dataclasses calls exec by its name: its module's own is found before the builtin
    vars(dataclasses)["exec"] = run


_used: dict[str, int] = {}


def use(path: str = TABLE) -> int:
    """Have dataclasses take the recorded code of the methods it writes
    (once a process); the number recorded, 0 where nothing is recorded for
    this interpreter (a file missing, or not one ``record`` wrote:
    dataclasses unchanged)."""
    if path in _used:
        return _used[path]
    _used[path] = 0
    try:
        with open(path, "rb") as f:
            table = marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        return 0
    if not isinstance(table, dict) or not all(type(k) is str and type(v) is types.CodeType
                                              for k, v in table.items()):
        return 0

    def exec_recorded(source, globals=None, locals=None, /, **kw):
        code = table.get(source) if type(source) is str else None
        return exec(source if code is None else code, globals, locals, **kw)

    _install(exec_recorded)
    _used[path] = len(table)
    return len(table)


def record(path: str = TABLE, package: str = "layerdiff") -> int:
    """Import every module of ``package``, recording the code of each
    method dataclasses writes on the way, into ``path`` (written whole, then
    renamed: never half a table); returns how many were recorded."""
    table: dict[str, types.CodeType] = {}

    def exec_recording(source, globals=None, locals=None, /, **kw):
        if type(source) is str:
            code = table[source] = _compiled(source)
            source = code
        return exec(source, globals, locals, **kw)

    before = vars(dataclasses).get("exec")
    _install(exec_recording)
    try:
        root = importlib.import_module(package)
        for found in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda name: None):
            try:
                importlib.import_module(found.name)
            except Exception:   # noqa: BLE001 - an optional dependency missing here: its classes compile when made
                continue
    finally:
        if before is None:
            del vars(dataclasses)["exec"]
        else:
            _install(before)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "wb") as f:
        marshal.dump(table, f)
    os.replace(part, path)
    return len(table)


if __name__ == "__main__":
    print(f"{record()} dataclass methods compiled into {TABLE}")
