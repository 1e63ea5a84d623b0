"""``.npz`` files written from a mapping of names to arrays.

``np.savez(f, **arrays)`` takes the names as its own keyword arguments: a
tensor named ``file`` fails the call, and one named ``allow_pickle`` is
taken for that flag and silently left out. Graph inputs and node names are
the user's, so the archive is written here member by member, as numpy
writes it (uncompressed ``NAME.npy`` entries that ``np.load`` reads back).
"""
from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import IO

import numpy as np


def write_npz(file: str | os.PathLike | IO[bytes], arrays: Mapping[str, np.ndarray]) -> None:
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)
