"""layerdiff: find the first node where an accelerator build departs from its FP32 reference.

The import path mirrors the data flow: ``layerdiff.collector`` (device side),
``layerdiff.analyzer`` (reference, alignment, metrics, reports),
``layerdiff.client`` (CLI and Python API), ``layerdiff.v1`` (generated gRPC
stubs) and the shared modules here (wire schema, errors, artifacts, network).
"""

__version__ = "0.1.0"

from layerdiff.errors import LayerdiffError

__all__ = ["LayerdiffError", "__version__", "run"]


def run(*args, **kwargs):  # pragma: no cover - thin re-export, see layerdiff.client.api.run
    """Run a comparison job; see :func:`layerdiff.client.api.run`."""
    from layerdiff.client.api import run as _run

    return _run(*args, **kwargs)
