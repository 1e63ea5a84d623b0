"""layerdiff: find the first node where an accelerator build departs from its FP32 reference.

The import path mirrors the data flow: ``layerdiff.collector`` (device side),
``layerdiff.analyzer`` (reference, alignment, metrics, reports),
``layerdiff.client`` (CLI and Python API), ``layerdiff.v1`` (generated gRPC
stubs) and the shared modules here (wire schema, errors, artifacts, network).
"""

__version__ = "0.1.0"

from layerdiff.common.errors import LayerdiffError

__all__ = ["CUR_NPU_NODENAME_FILENAME", "LayerdiffError", "__version__", "compare", "onnx_dump_fmap", "read_report",
           "run", "tf_dump_fmap"]

# The seed tool's name for the device's node list (see layerdiff.client.fmap).
CUR_NPU_NODENAME_FILENAME = "dump_memory_nodename.log"


def run(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.api.run
    """Run a comparison job; see :func:`layerdiff.client.api.run`."""
    from layerdiff.client.api import run as _run

    return _run(*args, **kwargs)


def read_report(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.results.read_report
    """A report's table (nodes by default) as a pyarrow Table or a pandas
    DataFrame; see :func:`layerdiff.client.results.read_report`."""
    from layerdiff.client.results import read_report as _read

    return _read(*args, **kwargs)


def compare(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.api.compare
    """Compare a device dump against a golden dump; see :func:`layerdiff.client.api.compare`."""
    from layerdiff.client.api import compare as _compare

    return _compare(*args, **kwargs)


def tf_dump_fmap(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.fmap.tf_dump_fmap
    """Dump the FP32 reference of every op of a TensorFlow model; see
    :func:`layerdiff.client.fmap.tf_dump_fmap`."""
    from layerdiff.client.fmap import tf_dump_fmap as _f

    return _f(*args, **kwargs)


def onnx_dump_fmap(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.fmap.onnx_dump_fmap
    """Dump the FP32 reference of every node of an ONNX model; see
    :func:`layerdiff.client.fmap.onnx_dump_fmap`."""
    from layerdiff.client.fmap import onnx_dump_fmap as _f

    return _f(*args, **kwargs)
