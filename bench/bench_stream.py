"""(a) Collector -> analyzer streaming throughput against raw loopback TCP and
against Arrow Flight DoPut of the same bytes, measured in one run, all three
between two processes on loopback.

The collector runs as its own process (as in production) serving a dump that
sits in the page cache; the receiving side is this process, re-joining every
tensor exactly as the analyzer does (into reused buffers). TCP: a sender
process writes the same bytes with sendall, this process reads them with
recv_into into a reused buffer. Flight: this process DoPuts the same bytes as
record batches of the same chunk size to a Flight sink in another process.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.service import CollectorClient
from layerdiff.common.schema import BufferPool, NodeRecord, TensorAssembler
from layerdiff.common.sizes import DEFAULT_CHUNK_BYTES
from layerdiff.v1 import layerdiff_pb2 as pb


def make_dump(root: Path, total_mib: int, tensor_mib: int) -> tuple[Path, int]:
    rng = np.random.default_rng(0)
    n = max(1, total_mib // tensor_mib)
    recs = [NodeRecord(f"node_{i}", "Conv", i, rng.standard_normal(tensor_mib * 262144).astype(np.float32))
            for i in range(n)]
    write_dump(root, recs)
    return root, n * tensor_mib * 1024 * 1024


def bench_layerdiff(dump: Path, chunk: int, repeats: int) -> float:
    proc = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", "collector", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        address = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)
        client = CollectorClient(address)
        client.wait_ready()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            pool = BufferPool()
            asm, nbytes = TensorAssembler(pool=pool), 0
            for msg in client.capture(pb.CaptureRequest(job_id="bench", dump=pb.DumpSource(path=str(dump)),
                                                        max_chunk_bytes=chunk)):
                for rec in asm.feed(msg.data):
                    nbytes += rec.array.nbytes
                    rec.lease.release()   # as the analyzer does once the node is compared
            best = min(best, time.perf_counter() - t)
        client.close()
        return nbytes / best
    finally:
        proc.terminate()
        proc.wait()


_TCP_SENDER = r"""
import socket, sys, numpy as np
port, total, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = memoryview(np.random.default_rng(0).standard_normal(total // 4).astype(np.float32).view(np.uint8))
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for off in range(0, total, chunk):
    s.sendall(data[off:off + chunk])
s.close()
"""


def bench_tcp(total: int, chunk: int, repeats: int) -> float:
    best = float("inf")
    buf = bytearray(chunk)
    for _ in range(repeats):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", _TCP_SENDER, str(port), str(total), str(chunk)])
        conn, _ = srv.accept()
        t = time.perf_counter()
        got = 0
        view = memoryview(buf)
        while True:
            n = conn.recv_into(view)
            if not n:
                break
            got += n
        dt = time.perf_counter() - t
        proc.wait()
        conn.close()
        srv.close()
        assert got == total
        best = min(best, dt)
    return total / best


_FLIGHT_SINK = r"""
import pyarrow.flight as flight
class Sink(flight.FlightServerBase):
    def do_put(self, context, descriptor, reader, writer):
        for _chunk in reader:
            pass
s = Sink("grpc://127.0.0.1:0")
print(s.port, flush=True)
s.serve()
"""


class _Sink(flight.FlightServerBase):
    def do_put(self, context, descriptor, reader, writer):
        for _chunk in reader:
            pass


def bench_flight(total: int, chunk: int, repeats: int, same_process: bool = False) -> float:
    """DoPut to a sink in another process (the collector's topology), or in
    this process (no process boundary: the most favourable case for Flight)."""
    proc = server = None
    if same_process:
        import threading

        server = _Sink("grpc://127.0.0.1:0")
        threading.Thread(target=server.serve, daemon=True).start()
        port = server.port
    else:
        proc = subprocess.Popen([sys.executable, "-c", _FLIGHT_SINK], stdout=subprocess.PIPE, text=True)
        port = int(proc.stdout.readline())
    client = flight.connect(f"grpc://127.0.0.1:{port}")
    data = np.random.default_rng(0).standard_normal(total // 4).astype(np.float32).view(np.uint8)
    schema = pa.schema([("data", pa.binary())])
    batches = []
    for off in range(0, total, chunk):
        piece = pa.py_buffer(data[off:off + chunk])
        arr = pa.Array.from_buffers(pa.binary(), 1, [None, pa.py_buffer(np.array([0, piece.size], np.int32)), piece])
        batches.append(pa.RecordBatch.from_arrays([arr], schema=schema))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("bench"), schema)
        for b in batches:
            writer.write_batch(b)
        writer.close()
        best = min(best, time.perf_counter() - t)
    client.close()
    if proc is not None:
        proc.terminate()
        proc.wait()
    if server is not None:
        server.shutdown()
    return total / best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_BYTES)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="layerdiff-bench-") as tmp:
        dump, total = make_dump(Path(tmp) / "dump", a.mib, a.tensor_mib)
        ours = bench_layerdiff(dump, a.chunk, a.repeats)
    tcp = bench_tcp(total, a.chunk, a.repeats)
    fl = bench_flight(total, a.chunk, a.repeats)
    fl_same = bench_flight(total, a.chunk, a.repeats, same_process=True)
    res = {"bytes": total, "chunk_bytes": a.chunk, "layerdiff_GBps": ours / 1e9, "tcp_GBps": tcp / 1e9,
           "flight_GBps": fl / 1e9, "flight_same_process_GBps": fl_same / 1e9, "ratio_vs_tcp": ours / tcp,
           "ratio_vs_flight": ours / fl, "ratio_vs_flight_same_process": ours / fl_same,
           "goal": "ratio_vs_tcp >= 0.35, ratio_vs_flight >= 0.9"}
    print(f"(a) streaming {total / 2**20:.0f} MiB in {a.chunk / 2**20:.1f} MiB messages")
    print(f"    layerdiff Capture  {ours / 1e9:6.2f} GB/s")
    print(f"    loopback TCP       {tcp / 1e9:6.2f} GB/s   ratio {ours / tcp:.2f}  (goal >= 0.35)")
    print(f"    Flight DoPut       {fl / 1e9:6.2f} GB/s   ratio {ours / fl:.2f}  "
          "(goal >= 0.9; sink in another process)")
    print(f"    Flight DoPut       {fl_same / 1e9:6.2f} GB/s   ratio {ours / fl_same:.2f}  (sink in this process)")
    print(json.dumps({"stream": res}))
    return res


if __name__ == "__main__":
    main()
