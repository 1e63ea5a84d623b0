"""TensorFlow in this process: imported on first use only (the collector and
the ONNX paths start without it), every call run on the one thread that
owns it, and its errors shortened to one line."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from layerdiff.common.errors import LayerdiffError

# TensorFlow keeps per-thread state, in C++ (thread_local) and in Python
# (threading.local). Arrow Flight runs the collector's handlers on gRPC's own
# threads, whose Python thread state is created and dropped around each call:
# the next call on the same OS thread then finds TensorFlow's C++ state
# pointing at freed Python objects, and the process crashes. So every
# TensorFlow call of this process runs on one long-lived Python thread.
_TF_THREAD_PREFIX = "layerdiff-tensorflow"
_tf_executor: ThreadPoolExecutor | None = None
_tf_executor_lock = threading.Lock()

P = ParamSpec("P")
R = TypeVar("R")


def on_tf_thread(fn: Callable[P, R]) -> Callable[P, R]:
    """Run the decorated function on the thread that owns TensorFlow."""

    @wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        global _tf_executor
        if threading.current_thread().name.startswith(_TF_THREAD_PREFIX):
            return fn(*args, **kwargs)
        with _tf_executor_lock:
            if _tf_executor is None:
                _tf_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_TF_THREAD_PREFIX)
        return _tf_executor.submit(fn, *args, **kwargs).result()

    return call


@on_tf_thread
def import_tf() -> Any:
    """TensorFlow, imported on first use with its start-up chatter kept to
    warnings and errors. oneDNN's custom kernels are off: they announce
    themselves on the terminal before any log level applies, and a
    reference computed in a fixed summation order is the one to compare
    against."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise LayerdiffError("TensorFlow is not installed here; install layerdiff with the [tf] extra",
                             field="model") from e
    return tf


def tf_message(e: BaseException) -> str:
    msg = getattr(e, "message", None) or str(e)
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip() and not ln.startswith("Graph execution")]
    return " ".join(lines)[:600] or type(e).__name__
