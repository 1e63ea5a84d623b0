"""Limits from the environment, read one way everywhere: a positive whole
number, for sizes also with a binary unit (``512M``, ``10G``, ``1.5TiB``).
Unset or empty means the default; anything else that is not such a number
is a LayerdiffError naming the variable (an operator's typo must not turn a
limit off)."""
from __future__ import annotations

import os
import re

from layerdiff.common.errors import LayerdiffError

_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


def parse_bytes(text: str) -> int:
    """``10737418240``, ``10G``, ``10GiB``, ``512M``, ``1.5T`` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def env_limit(name: str, default: int, *, size: bool = False) -> int:
    """The positive limit ``name`` sets (a size in bytes where ``size``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse_bytes(raw) if size else int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        what = "a size in bytes (512M, 10G...)" if size else "a whole number"
        raise LayerdiffError(f"must be {what} above 0, got {raw!r}", field=name)
    return value


# Every environment variable layerdiff reads: (who reads it, what it sets,
# its default). The manual's reference is generated from this table
# (docs/gen_reference.py), and a test holds it to the names the code reads.
SETTINGS: dict[str, tuple[str, str, str]] = {
    # connections
    "LAYERDIFF_KEEPALIVE_S": ("client, services", "a ping on an idle connection this often (s)", "10"),
    "LAYERDIFF_KEEPALIVE_TIMEOUT_S": ("client, services", "a ping unanswered this long drops the connection (s)",
                                      "10"),
    "LAYERDIFF_MIN_PING_INTERVAL_S": ("analyzer", "pings accepted this often at most (s)",
                                      "min(5, LAYERDIFF_KEEPALIVE_S)"),
    "LAYERDIFF_MAX_PING_STRIKES": ("analyzer", "pings faster than that tolerated before closing (0: never closes)",
                                   "0"),
    "LAYERDIFF_CONNECT_TIMEOUT_S": ("client", "how long a client waits for an analyzer it cannot reach (s)", "15"),
    "LAYERDIFF_COLLECTOR_LIVENESS_S": ("analyzer", "a collector silent this long is unreachable (s)", "30"),
    # distributed comparisons
    "LAYERDIFF_BROKER_URL": ("analyzer, worker", "Redis URL: broker, result backend and tensor store",
                             "none: a local pool"),
    "LAYERDIFF_JOB_DEADLINE_S": ("analyzer", "a job's deadline on the workers (s)", "3600"),
    "LAYERDIFF_TASK_TIMEOUT_S": ("analyzer", "silence after which a task is sent again (s)", "30"),
    "LAYERDIFF_STORE_GRACE_S": ("analyzer", "how long Redis may stay unreachable before the job fails (s)", "20"),
    "LAYERDIFF_WORKER_SILENCE_S": ("analyzer", "no result this long: workers are pinged, the job fails if none "
                                   "answers (s)", "60"),
    "LAYERDIFF_VISIBILITY_TIMEOUT_S": ("analyzer, worker", "broker redelivery of unacknowledged tasks (s)", "60"),
    "LAYERDIFF_TENSOR_HOST": ("analyzer", "where the analyzer's tensor endpoint listens", "127.0.0.1"),
    "LAYERDIFF_TENSOR_PORT": ("analyzer", "its port", "any free port"),
    "LAYERDIFF_ADVERTISE_HOST": ("analyzer", "the analyzer's address as workers reach it", "the listening host"),
    "LAYERDIFF_FLIGHT_MIN_BYTES": ("analyzer", "tensors from this size go through the tensor endpoint", "1 MiB"),
    "LAYERDIFF_CHUNK_ELEMENTS": ("analyzer, worker", "node size beyond which comparisons are chunked", "16777216"),
    "LAYERDIFF_INLINE_ELEMENTS": ("analyzer", "node size up to which the local pool compares on the stream's "
                                  "thread, not its own", "65536"),
    "LAYERDIFF_TASK_SECRET": ("analyzer, worker", "the secret tasks are signed with (at least 16 characters)",
                              "none: loopback brokers only"),
    "LAYERDIFF_TASK_SECRET_FILE": ("analyzer, worker", "a file whose first line is that secret (not both)", "none"),
    # operating the analyzer
    "LAYERDIFF_RETAIN_DAYS": ("analyzer", "finished jobs and unused uploads are deleted this many days after "
                              "(0: no age limit)", "7"),
    "LAYERDIFF_RETAIN_BYTES": ("analyzer", "their total size, beyond which the oldest go (0: no size limit)",
                               "10 GiB"),
    "LAYERDIFF_RETAIN_JOBS": ("analyzer", "finished jobs kept at most (0: no cap)", "10000"),
    "LAYERDIFF_RETAIN_GRACE_S": ("analyzer", "a finished job or an upload is never deleted for size this soon (s)",
                                 "300"),
    # deploying on a network
    "LAYERDIFF_TOKEN": ("client, worker; services", "the token sent; a server accepts it too", "none"),
    "LAYERDIFF_TOKEN_FILE": ("services; client", "accepted tokens, one a line (admin:TOKEN reads every job)", "none"),
    "LAYERDIFF_TLS_CERT": ("services; client", "the server's certificate (PEM); a client's own for mutual TLS",
                           "none: plain text"),
    "LAYERDIFF_TLS_KEY": ("services; client", "its key (PEM)", "none"),
    "LAYERDIFF_TLS_CA": ("client, worker; services", "the CA that signed the servers (turns TLS on); on a server, "
                         "the CA client certificates chain to", "none"),
    "LAYERDIFF_INSECURE": ("services", "1: plain text or no tokens on a non-loopback address", "refused"),
    "LAYERDIFF_DUMP_ROOTS": ("collector", ":-separated directories dumps are read from",
                             "loopback: any; network: none"),
    "LAYERDIFF_COLLECTOR_ALLOW": ("analyzer", "comma-separated host or host:port of the collectors it may call",
                                  "loopback only"),
    "LAYERDIFF_HEALTH_PORT": ("collector", "also serve grpc.health.v1 on this port", "none"),
    # limits
    "LAYERDIFF_MAX_INPUTS_BYTES": ("analyzer", "what an inputs .npz may inflate to", "1 GiB"),
    "LAYERDIFF_MEMORY_BUDGET": ("analyzer", "the reference values one job keeps in memory, and as much again for "
                                "diagnosis", "1 GiB"),
    "LAYERDIFF_ARTIFACT_QUOTA_BYTES": ("analyzer, collector", "what all uploads together may hold", "64 GiB"),
    "LAYERDIFF_MAX_JOBS_PER_CLIENT": ("analyzer", "jobs one token may have running at once", "4"),
    "LAYERDIFF_REPORT_QUOTA_BYTES": ("analyzer", "what one job's reports may take (past it the job fails)", "2 GiB"),
    "LAYERDIFF_REFERENCE_DUMP_BYTES": ("analyzer", "what a golden dump streamed in may hold", "64 GiB"),
}
