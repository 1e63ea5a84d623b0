"""Out-of-band tensor store for distributed comparisons.

Celery messages carry references, never tensor bytes: the analyzer writes
each tensor to Redis under a key of its job, the task names the key with the
dtype and shape it expects, and the worker reads the bytes back and checks
their size before using them. A job's keys live under one prefix and carry a
time-to-live (the job's deadline), so a job that ends or dies leaves nothing
behind for long; ``drop_job`` deletes them at once.
"""
from __future__ import annotations

import numpy as np
import redis

from layerdiff.errors import LayerdiffError, UnavailableError
from layerdiff.schema import ALLOWED_DTYPES

PREFIX = "layerdiff:job:"
# Redis values are limited to 512 MiB; large tensors are cut into parts.
PART_BYTES = 64 * 1024 * 1024


def _job_key(job_id: str) -> str:
    return f"{PREFIX}{job_id}"


class TensorStore:
    def __init__(self, url: str, ttl_s: int = 3600) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.r = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=10)

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise UnavailableError(f"broker {self.url} refuses connections: {e}", field="broker") from e

    # ------------------------------------------------------------ job marker
    def open_job(self, job_id: str) -> None:
        self.r.set(_job_key(job_id), b"1", ex=self.ttl_s)

    def job_alive(self, job_id: str) -> bool:
        return bool(self.r.exists(_job_key(job_id)))

    def drop_job(self, job_id: str) -> None:
        keys = list(self.r.scan_iter(match=f"{_job_key(job_id)}*", count=1000))
        for i in range(0, len(keys), 500):
            self.r.delete(*keys[i:i + 500])

    # --------------------------------------------------------------- tensors
    def put(self, job_id: str, name: str, arr: np.ndarray) -> dict:
        """Store an array; returns the reference a task carries."""
        if not arr.flags.c_contiguous:   # (ascontiguousarray would also turn a scalar into shape (1,))
            arr = np.ascontiguousarray(arr)
        key = f"{_job_key(job_id)}:{name}"
        raw = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
        parts = max(1, -(-arr.nbytes // PART_BYTES))
        pipe = self.r.pipeline(transaction=False)
        for i in range(parts):
            pipe.set(f"{key}:{i}", raw[i * PART_BYTES:(i + 1) * PART_BYTES], ex=self.ttl_s)
        pipe.execute()
        return {"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape), "nbytes": arr.nbytes, "parts": parts}

    def get(self, ref: dict) -> np.ndarray:
        """Read a referenced array back, refusing anything whose size or type
        does not match the reference."""
        key = ref.get("key", "?")
        dtype = ref.get("dtype")
        if dtype not in ALLOWED_DTYPES:
            raise LayerdiffError(f"dtype {dtype!r} is not allowed", field=key)
        shape = tuple(int(s) for s in ref.get("shape", ()))
        nbytes = int(ref.get("nbytes", -1))
        if nbytes != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise LayerdiffError(f"shape {shape} of {dtype} does not make {nbytes} bytes", field=key)
        parts = int(ref.get("parts", 1))
        values = self.r.mget([f"{key}:{i}" for i in range(parts)])
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise LayerdiffError(f"payload missing from the store (part {missing[0]} of {parts}; expired, deleted "
                                 "or the store restarted)", field=key)
        got = sum(len(v) for v in values)
        if got != nbytes:
            raise LayerdiffError(f"payload truncated: {got} of {nbytes} bytes", field=key)
        buf = values[0] if parts == 1 else b"".join(values)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
