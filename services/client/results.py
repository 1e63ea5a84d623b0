"""A report's tables read back: ``read_report(directory)`` gives its nodes
(or elements, alignment, weights) as a pyarrow Table, or with
``pandas=True`` a DataFrame whose columns keep their types (pyarrow-backed:
a null stays apart from a NaN). Reports of any schema version read as the
current one: columns an older report lacks come back as nulls."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import REPORT_SCHEMA_VERSION, REPORT_TABLES, TABLE_KEY, VERSION_KEY


def read_report(report: str | Path, table: str = "nodes", *, pandas: bool = False) -> Any:
    """Table ``table`` (nodes, elements, alignment, weights) of the report
    directory ``report`` (or the path of its .parquet file), as a
    pyarrow.Table, or a pandas.DataFrame with ``pandas=True``. A missing or
    unreadable file, or a table of another name, is a LayerdiffError."""
    import pyarrow.parquet as pq

    if table not in REPORT_TABLES:
        raise LayerdiffError(f"no table {table!r} in a report (one of {', '.join(REPORT_TABLES)})", field="table")
    name, schema = REPORT_TABLES[table]
    path = Path(report)
    if not path.exists():
        raise LayerdiffError("no such report directory", file=str(path))
    if path.is_dir():
        path = path / name
        if not path.is_file():
            raise LayerdiffError("missing: a report written before reports held tables, or not a report directory",
                                 file=str(path))
    try:
        got = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise LayerdiffError(f"not a readable Parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                             file=str(path)) from None
    meta = got.schema.metadata or {}
    if meta.get(TABLE_KEY) != table.encode():
        found = meta.get(TABLE_KEY, b"").decode(errors="replace") or "no layerdiff table"
        raise LayerdiffError(f"holds {found!r}, not the report's {table!r} table", file=str(path))
    try:
        version = int(meta.get(VERSION_KEY, b"0"))
    except ValueError:
        version = 0
    if version < 1:
        raise LayerdiffError(f"has no schema version layerdiff reads ({meta.get(VERSION_KEY)!r})", file=str(path))
    out = _as_current(got, schema) if version <= REPORT_SCHEMA_VERSION else got
    if not pandas:
        return out
    try:
        import pandas as pd
    except ImportError:
        raise LayerdiffError("pandas=True needs pandas (pip install 'layerdiff[notebook]')", field="pandas") from None
    return out.to_pandas(types_mapper=pd.ArrowDtype)


def _as_current(got: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table of this or an older schema version laid out as the current
    one: its columns in the current order, those it lacks as nulls (a
    version only adds columns)."""
    cols = []
    for f in schema:
        if f.name in got.column_names:
            cols.append(got.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(got.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)
