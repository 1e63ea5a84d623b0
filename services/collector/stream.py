"""The outgoing side of a capture: one DoGet's records, read on their own
thread and sent as they come, with heartbeats.

The source (a dump being read, a watched directory, a runtime computing)
can stay quiet for minutes while it is perfectly healthy. The analyzer
therefore does not put one deadline on the whole stream: it expects a
message at least every few seconds and calls the collector unreachable when
none arrives. Whenever the source has produced nothing for the heartbeat
interval the stream sends an empty batch, which says "alive, nothing yet".

A reader thread pulls records from the source into a queue bounded in
bytes (QUEUE_BYTES, and always room for one record), so memory stays a few
tensors whatever the source. The gRPC side encodes them into batches; small
records are batched together while they come quickly, and a partial batch
leaves as soon as the source pauses (QUIET_S), so a watched dump's nodes
reach the analyzer while the runtime is still writing. The reader stops,
and the source is closed (the runtime released), as soon as the analyzer
cancels or the stream ends.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.flight as flight

from layerdiff.common.schema import empty_batch

log = logging.getLogger(__name__)

QUEUE_BYTES = 64 * 1024**2
QUIET_S = 0.05
DEFAULT_HEARTBEAT_S = 5.0
MIN_HEARTBEAT_S = 0.05
# The first record is waited for this long (at most a heartbeat interval)
# before the stream starts, so that a source that cannot start (a missing
# dump, a bad model) fails the DoGet call itself; a source slower than that
# reports its errors in the stream.
FIRST_RECORD_WAIT_S = 2.0

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _nbytes(item) -> int:
    arr = getattr(item, "array", None)
    return int(getattr(arr, "nbytes", 0) or 0)


class OutgoingStream:
    """One capture stream; owns its reader thread and the source.

    ``open_records()`` returns the source's records; ``encoder()`` a fresh
    encoder (``add(record) -> batches``, ``flush() -> batch | None``,
    ``pending``) of ``schema``; ``to_flight_error`` maps an exception to
    what the analyzer receives as the stream's status. ``context`` is the
    DoGet's call context (its cancellation stops the reader).
    """

    def __init__(self, label: str, schema: pa.Schema, open_records: Callable[[], Iterable], encoder: Callable,
                 to_flight_error: Callable[[BaseException], Exception], heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 context=None) -> None:
        self.label = label
        self.schema = schema
        self._open_records = open_records
        self._encoder = encoder
        self._to_flight_error = to_flight_error
        self.heartbeat_s = max(MIN_HEARTBEAT_S, heartbeat_s)
        self._context = context
        self._items: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._read, name=f"stream-{label}", daemon=True)

    # ----------------------------------------------------------------- start
    def start(self) -> flight.GeneratorStream:
        """Start reading; raise the source's set-up error if it fails within
        FIRST_RECORD_WAIT_S, else return the stream for DoGet."""
        self._thread.start()
        end = time.monotonic() + min(FIRST_RECORD_WAIT_S, self.heartbeat_s)
        with self._cv:
            while not self._items and time.monotonic() < end:
                self._cv.wait(max(0.0, end - time.monotonic()))
            head = self._items[0][0] if self._items else None
        if isinstance(head, _Failed):
            self.stop()
            log.warning("%s refused: %s", self.label, head.error)
            raise self._to_flight_error(head.error)
        return flight.GeneratorStream(self.schema, self._send())

    # ---------------------------------------------------------------- reader
    def _read(self) -> None:
        records = None
        try:
            records = self._open_records()
            for rec in records:
                if not self._put(rec, _nbytes(rec)):
                    return
            self._put(_END, 0)
        except BaseException as e:   # the analyzer receives it as the stream's status
            self._put(_Failed(e), 0)
        finally:
            close = getattr(records, "close", None)
            if close is not None:   # a generator: its runtime and files are released now, not when collected
                try:
                    close()
                except Exception as e:
                    log.warning("%s: closing the source failed: %s", self.label, e)

    def _put(self, item, nbytes: int) -> bool:
        """Queue an item, waiting while the analyzer reads slowly; False
        once the stream has stopped."""
        with self._cv:
            while not self._stopped and self._items and self._queued_bytes + nbytes > QUEUE_BYTES:
                self._cv.wait(0.2)
                if self._context is not None and self._context.is_cancelled():
                    self._stopped = True
            if self._stopped:
                return False
            self._items.append((item, nbytes))
            self._queued_bytes += nbytes
            self._cv.notify_all()
            return True

    def _take(self, timeout: float):
        """The next item, or None after ``timeout`` without one."""
        end = time.monotonic() + timeout
        with self._cv:
            while not self._items:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            item, nbytes = self._items.popleft()
            self._queued_bytes -= nbytes
            self._cv.notify_all()
            return item

    # ------------------------------------------------------------------ send
    def _send(self):
        heartbeat = empty_batch(self.schema)
        encoder = self._encoder()
        try:
            while True:
                item = self._take(QUIET_S if encoder.pending else self.heartbeat_s)
                if item is None:    # the source pauses: what is batched leaves now, else a heartbeat
                    batch = encoder.flush()
                    yield batch if batch is not None else heartbeat
                    continue
                if item is _END or isinstance(item, _Failed):
                    batch = encoder.flush()
                    if batch is not None:
                        yield batch
                    if item is _END:
                        return
                    if not isinstance(item.error, Exception):
                        raise item.error
                    log.warning("%s failed: %s", self.label, item.error)
                    raise self._to_flight_error(item.error) from None
                yield from encoder.add(item)
        finally:   # the stream ended, or the analyzer went away: stop reading the source
            self.stop()

    def stop(self, wait_s: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            self._items.clear()
            self._queued_bytes = 0
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait_s)
