"""Receive buffers and their holders: a buffer goes back to the pool only
when its last holder lets go, and a job's consumer lets go of every one,
whatever order the tensors come in and whether the job ends or stops."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import small_cnn

from layerdiff.analyzer.align.names import Aligner
from layerdiff.analyzer.compare.tolerances import Tolerances
from layerdiff.analyzer.execute.local import INLINE_ELEMENTS, LocalPool
from layerdiff.analyzer.jobs.consumer import StreamConsumer
from layerdiff.analyzer.jobs.prepare import Prepared
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.analyzer.reference.segments import SegmentedReference
from layerdiff.analyzer.report.files import JobReport
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.schema import BufferLease, BufferPool, TensorAssembler, encode_records


def test_a_buffer_returns_to_the_pool_after_its_last_holder():
    pool = BufferPool()
    buf = pool.take(64)
    lease = BufferLease(buf, pool)          # the record's hold
    comparison = lease.retain()
    kept = lease.retain()
    assert lease.holders == 3
    lease.release()                          # the record is handled
    comparison.release()                     # its comparison is finished
    assert pool.take(64) is not buf, "handed out again while a kept value still reads it"
    kept.release()                           # the kept value is forgotten
    assert lease.holders == 0
    assert pool.take(64) is buf


def test_releasing_more_than_held_is_a_bug_not_a_silent_reuse():
    pool = BufferPool()
    lease = BufferLease(pool.take(16), pool)
    lease.release()
    with pytest.raises(RuntimeError):
        lease.release()
    with pytest.raises(RuntimeError):
        lease.retain()
    assert sum(len(b) for b in pool._free.values()) == 1   # given back once


def test_assembled_records_hold_their_buffers():
    pool = BufferPool()
    a = np.arange(256, dtype=np.float32)
    b = -np.arange(256, dtype=np.float32)
    from layerdiff.common.schema import NodeRecord

    asm = TensorAssembler(pool=pool)
    recs = [r for batch in encode_records([NodeRecord("a", array=a), NodeRecord("b", array=b)])
            for r in asm.feed(batch)]
    assert [r.lease.holders for r in recs] == [1, 1]
    held = recs[0].lease.retain()
    recs[0].lease.release()
    # a third tensor of the same size must not land in a's buffer while it is held
    (c,) = [r for batch in encode_records([NodeRecord("c", array=a * 2)]) for r in asm.feed(batch)]
    np.testing.assert_array_equal(recs[0].array, a)
    held.release()
    c.lease.release()
    recs[1].lease.release()


def _prepared(model_bytes: bytes, feeds: dict) -> Prepared:
    ref = OnnxReference(model_bytes, "model.onnx")
    return Prepared(ref, feeds, Aligner(ref.sites), Tolerances(None, None, ""), diff_cnt=16, max_cores=2,
                    force_compare=False)


@pytest.mark.parametrize("order", ["stream", "reversed"])
@pytest.mark.parametrize("end", ["finish", "abandon", "no-waiting"])
@pytest.mark.parametrize("inline", [0, INLINE_ELEMENTS], ids=["pool", "inline"])
def test_the_consumer_lets_go_of_every_buffer(tmp_path, order, end, inline):
    model = small_cnn().SerializeToString()
    device = small_cnn(bug_in="conv2").SerializeToString()
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    sent = list(LiveRunner(model, feeds, device_model_bytes=device).records())
    if order == "reversed":
        sent.reverse()
    p = _prepared(model, feeds)
    pool = BufferPool()
    asm = TensorAssembler(pool=pool)
    received = [r for batch in encode_records(sent) for r in asm.feed(batch)]
    executor = LocalPool(2, inline_elements=inline)
    rep = JobReport()
    consumer = StreamConsumer(p, executor, lambda: SegmentedReference(p.reference, feeds), rep, tmp_path)
    if end == "no-waiting":
        consumer.examiner.wait_cap = 0    # a failing node is examined with what has arrived
    try:
        for rec in received:
            consumer.take(rec)
        if end == "abandon":
            consumer.abandon()
        else:
            consumer.finish()
    finally:
        executor.close()
    assert [r.name for r in received if r.lease.holders] == []
    if end != "abandon":
        assert len(rep.rows) == len(sent)
        failing = sorted((r.site.order, r.site.node) for r in rep.rows if r.failed)
        assert failing[0][1] == "conv2"
        conv2 = next(r for r in rep.rows if r.site.node == "conv2")
        if end == "finish":
            # examined with its producer's device output, even when that came later
            assert conv2.isolated is not None, conv2.isolation_note
