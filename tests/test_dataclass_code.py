"""The methods dataclasses writes, compiled at set-up (common/dataclass_code):
classes made from the recorded code behave as those dataclasses compiles,
a class changed since the recording is compiled anew, a table that is not
one the recording wrote changes nothing, and the command's start-up finds
every method it makes recorded."""
from __future__ import annotations

import json
import marshal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CLASSES = '''
from __future__ import annotations
import dataclasses
from dataclasses import dataclass, field


@dataclass
class Plain:
    a: int
    b: float = 1.5
    c: list = field(default_factory=list)
    d: str = field(default="x", repr=False)


@dataclass(frozen=True, order=True)
class Frozen:
    x: int
    y: tuple = ()


@dataclass(kw_only=True, slots=True)
class Keywords:
    k: int
    m: int = field(init=False, default=7)

    def __post_init__(self):
        self.m = self.k * 2
'''

# what a program sees of those classes (each line a JSON value)
PROBE = '''
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from layerdiff.common import dataclass_code
used = dataclass_code.use(sys.argv[2]) if sys.argv[2] else 0
found = []
inner = vars(dataclasses).get("exec")
if inner is not None:     # the methods taken from the table, counted
    table = next(c.cell_contents for c in inner.__closure__ if isinstance(c.cell_contents, dict))
    def counting(source, g=None, l=None, /, **kw):
        found.append(source in table)
        return inner(source, g, l, **kw)
    dataclasses.exec = counting
from dcpkg.shapes import Plain, Frozen, Keywords
out = {"used": used, "exec": inner is not None, "found": found}
p = Plain(1)
out["plain"] = [repr(p), p == Plain(1, 1.5, [], "x"), p == Plain(2), dataclasses.astuple(p)]
f = Frozen(3, (1,))
try:
    f.x = 4
    out["frozen"] = "assigned"
except dataclasses.FrozenInstanceError as e:
    out["frozen"] = type(e).__name__
out["order"] = [Frozen(1) < Frozen(2), hash(Frozen(1)) == hash(Frozen(1)), repr(f)]
k = Keywords(k=5)
out["keywords"] = [repr(k), k.m, hasattr(k, "__dict__")]
try:
    Keywords(5)
    out["positional"] = "taken"
except TypeError:
    out["positional"] = "refused"
print(json.dumps(out))
'''


def _package(root: Path, source: str) -> None:
    pkg = root / "dcpkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "shapes.py").write_text(textwrap.dedent(source))


def _record(root: Path, table: Path) -> int:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from layerdiff.common import dataclass_code as d; "
            "print(d.record(sys.argv[2], package='dcpkg'))")
    done = subprocess.run([sys.executable, "-c", code, str(root), str(table)], capture_output=True, text=True,
                          check=True)
    return int(done.stdout.strip())


def _probe(root: Path, table: Path | None) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(root), str(table or "")], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def test_classes_from_the_recorded_code_behave_as_compiled_ones(tmp_path):
    _package(tmp_path, CLASSES)
    table = tmp_path / "methods.marshal"
    recorded = _record(tmp_path, table)
    assert recorded >= 8     # __init__, __repr__, __eq__ of three classes, the frozen one's guards, its order
    with_table, without = _probe(tmp_path, table), _probe(tmp_path, None)
    assert with_table.pop("used") == recorded and with_table.pop("exec") is True
    assert with_table.pop("found") == [True] * recorded      # every method of the three from the table
    assert without.pop("used") == 0 and without.pop("exec") is False and without.pop("found") == []
    assert with_table == without
    assert with_table["frozen"] == "FrozenInstanceError" and with_table["positional"] == "refused"
    assert with_table["keywords"][1] == 10


def test_a_class_changed_since_the_recording_is_compiled_anew(tmp_path):
    _package(tmp_path, CLASSES)
    table = tmp_path / "methods.marshal"
    _record(tmp_path, table)
    # a field added: its __init__'s text is not in the table
    _package(tmp_path, CLASSES.replace("    d: str = field(default=\"x\", repr=False)\n",
                                       "    d: str = field(default=\"x\", repr=False)\n    e: int = 9\n"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from layerdiff.common import dataclass_code as d; "
            "n = d.use(sys.argv[2]); from dcpkg.shapes import Plain; print(n, Plain(1, e=4).e, repr(Plain(1)))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(table)], capture_output=True, text=True,
                         check=True).stdout.split(" ", 2)
    assert int(out[0]) > 0 and out[1] == "4" and "e=9" in out[2]


@pytest.mark.parametrize("content", [b"", b"not marshal at all", marshal.dumps([1, 2]),
                                     marshal.dumps({"def f(): pass": "not code"}),
                                     marshal.dumps({compile("1", "<s>", "eval"): compile("1", "<s>", "eval")})])
def test_a_table_record_did_not_write_changes_nothing(tmp_path, content):
    _package(tmp_path, CLASSES)
    table = tmp_path / "methods.marshal"
    table.write_bytes(content)
    got = _probe(tmp_path, table)
    assert got.pop("used") == 0 and got.pop("exec") is False and got.pop("found") == []
    assert got == {k: v for k, v in _probe(tmp_path, None).items() if k not in ("used", "exec", "found")}


def test_the_commands_start_up_finds_every_method_it_makes_recorded():
    """`make setup` (and `make test`) record layerdiff's classes: the
    two-dump command's imports make none that is not recorded."""
    code = textwrap.dedent('''
        import dataclasses, sys
        import layerdiff.client.cli  # takes the table, as the command does
        inner = vars(dataclasses).get("exec")
        if inner is None:
            sys.exit("no table recorded for this interpreter: run make setup")
        table = next(c.cell_contents for c in inner.__closure__ if isinstance(c.cell_contents, dict))
        missed = []
        def counting(source, g=None, l=None, /, **kw):
            if type(source) is str and source not in table:
                missed.append(source.splitlines()[1].strip())
            return inner(source, g, l, **kw)
        dataclasses.exec = counting
        import layerdiff.client.api, layerdiff.client.local_client, layerdiff.analyzer.local
        import layerdiff.analyzer.jobs.runner, layerdiff.analyzer.report.files, layerdiff.analyzer.diagnose.examiner
        print(len(table), len(missed), missed[:3])
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    recorded, missed, _ = done.stdout.split(" ", 2)
    assert int(recorded) > 100 and missed == "0", done.stdout
