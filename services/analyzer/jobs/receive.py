"""The receiving side of a capture: one stream from a collector, watched for
liveness instead of bounded by one deadline.

A healthy stream may last hours (a large model, a runtime watched while it
writes its dump), so no deadline is put on the whole call. Instead the
collector sends a heartbeat (an empty batch) whenever its source is quiet,
at a quarter of the liveness interval this side asks for, and a watchdog
cancels the stream once the analyzer has waited ``liveness_s`` for a
message and none came: the collector crashed, or the link to it is cut. The
time the analyzer itself is busy between two reads does not count.

The failure names the collector's address, for how long it was silent and
what to check; a collector's own refusal (bad input) keeps its message.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from layerdiff.common.errors import LayerdiffError, PermissionDenied, Unauthenticated, UnavailableError
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.flight as flight

    from layerdiff.collector.core import Collector
    from layerdiff.collector.service import CollectorClient
else:
    from layerdiff.common.lazy import pa

# Silence after which a collector is declared unreachable; the collector is
# asked for a heartbeat four times as often.
DEFAULT_LIVENESS_S = 30.0
LIVENESS_ENV = "LAYERDIFF_COLLECTOR_LIVENESS_S"


def liveness_s() -> float:
    """The configured liveness interval (LAYERDIFF_COLLECTOR_LIVENESS_S)."""
    text = os.environ.get(LIVENESS_ENV, "")
    try:
        value = float(text) if text else DEFAULT_LIVENESS_S
    except ValueError:
        raise LayerdiffError(f"is not a number of seconds: {text!r}", field=LIVENESS_ENV) from None
    if not value > 0:
        raise LayerdiffError(f"must be > 0, got {text!r}", field=LIVENESS_ENV)
    return value


def upload_timeout(nbytes: int) -> float:
    """A bound on sending a file to the collector: the liveness interval
    plus one second per MiB (a link slower than 1 MiB/s fails the upload)."""
    return liveness_s() + nbytes / 2**20


class CollectorStream:
    """One DoGet stream from a collector and the watchdog that ends it when
    the collector falls silent. ``open()``, iterate the record batches,
    ``close()`` (always: it stops the watchdog). ``cancel()`` may be called
    from any thread."""

    def __init__(self, client: CollectorClient, request: pb.CaptureRequest, liveness: float | None = None) -> None:
        self.client = client
        self.address = client.address
        self.liveness_s = liveness or liveness_s()
        self.request = pb.CaptureRequest()
        self.request.CopyFrom(request)
        self.request.heartbeat_ms = max(50, int(self.liveness_s * 1000 / 4))
        self._reader: flight.FlightStreamReader | None = None
        self._lock = threading.Lock()
        self._waiting_since: float | None = None
        self._closed = threading.Event()
        self._cancelled = False
        self.expired = False
        self._watchdog = threading.Thread(target=self._watch, name=f"liveness-{client.address}", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ open
    def open(self) -> CollectorStream:
        """Start the capture. The collector answers once its source has
        started (a few seconds at most); a call left unanswered for the
        liveness interval is a collector that cannot be reached."""
        box: dict = {}
        done = threading.Event()

        def call() -> None:
            try:
                reader = self.client.capture(self.request)
                with self._lock:
                    box["reader"] = reader
                    if box.get("abandoned"):   # answered after the wait gave up: end the call here
                        reader.cancel()
            except BaseException as e:   # handed to the waiting thread below
                box["error"] = e
            finally:
                done.set()

        opener = threading.Thread(target=call, name=f"capture-{self.address}", daemon=True)
        opener.start()
        end = time.monotonic() + self.liveness_s
        while not done.wait(0.1):
            if self._cancelled or time.monotonic() > end:
                with self._lock:
                    box["abandoned"] = True
                    if "reader" in box:
                        box["reader"].cancel()
                if self._cancelled:
                    import pyarrow.flight as flight  # loaded by the client that opened it

                    raise flight.FlightCancelledError("cancelled before the stream started")
                self.expired = True
                raise self.unreachable("no answer to the capture call") from None
        if "error" in box:
            raise collector_error(self.address, box["error"]) from None
        with self._lock:
            self._reader = box["reader"]
            if self._cancelled:
                self._reader.cancel()
        return self

    # ------------------------------------------------------------------ read
    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """The stream's record batches; a heartbeat is an empty one (the
        collector is alive, its source quiet)."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("CollectorStream.open() first")
        while True:
            self._waiting_since = time.monotonic()
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return
            except (pa.ArrowException, KeyError) as e:
                if self.expired:
                    raise self.unreachable("nothing arrived, not even a heartbeat") from None
                raise collector_error(self.address, e) from None
            finally:
                self._waiting_since = None
            if chunk.data is not None:
                yield chunk.data

    def unreachable(self, what: str) -> UnavailableError:
        return UnavailableError(
            f"collector {self.address} unreachable for {self.liveness_s:.0f} s ({what}): check that the collector "
            f"runs and that this host reaches it (the interval is {LIVENESS_ENV})", field="collector")

    # -------------------------------------------------------------- liveness
    def _watch(self) -> None:
        step = min(1.0, self.liveness_s / 10)
        while not self._closed.wait(step):
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.liveness_s:
                self.expired = True
                self.cancel()
                return

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            reader = self._reader
        if reader is not None:
            reader.cancel()

    def close(self) -> None:
        self._closed.set()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        with self._lock:
            self._reader = None   # the reader holds the gRPC call, and the call the connection


def collector_error(address: str, e: BaseException) -> LayerdiffError:
    """A collector call that failed: the collector's own refusal (bad
    input), or the collector unreachable, gone or silent (a component)."""
    if isinstance(e, LayerdiffError):
        return e
    import pyarrow.flight as flight  # a call over the network: the client made it

    from layerdiff.collector.service import flight_message

    text = f"collector {address}: {flight_message(e)}"
    if isinstance(e, (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightCancelledError)):
        return UnavailableError(text, field="collector")
    if isinstance(e, flight.FlightUnauthenticatedError):
        return Unauthenticated(text, field="collector")
    if isinstance(e, flight.FlightUnauthorizedError):
        return PermissionDenied(text, field="dump_path")
    return LayerdiffError(text)


class InProcessStream:
    """A dump read by a collector serving in this process: its records as
    its reader makes them, not encoded, sent over a socket and assembled
    again (a two-dump job's tensors copied four times over, and a golden
    dump then copied into the spill; its ``.npy`` files are handed over
    mapped where they lie). Iterate ``records()``; ``cancel()`` may be
    called from any thread and ends the iteration at the next record."""

    def __init__(self, source: Collector, request: pb.CaptureRequest) -> None:
        self.source = source
        self.request = request
        self._cancelled = threading.Event()

    @staticmethod
    def serves(source: Collector | None, request: pb.CaptureRequest) -> bool:
        """Does the in-process collector ``source`` serve this request so (a
        dump's tensors, not its performance records, nor a dump watched as
        it is written: that stream's close ends its wait on a cancel)?"""
        return source is not None and request.WhichOneof("source") == "dump" and not request.dump.watch \
            and request.stream != pb.CAPTURE_STREAM_PERF

    def open(self) -> InProcessStream:
        return self

    def records(self) -> Iterator:
        try:
            for rec in self.source.source(self.request):
                if self._cancelled.is_set():
                    return
                yield rec
        except LayerdiffError:
            raise
        except Exception as e:      # what the collector's stream would have reported of it
            raise LayerdiffError(f"internal error: {type(e).__name__}: {e}", field="collector") from None

    def cancel(self) -> None:
        self._cancelled.set()

    def close(self) -> None:
        self._cancelled.set()
