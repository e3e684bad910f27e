"""The Spark source's network read (``broker/spark/netread.py`` over ``GET .../records``) without
Spark, on a single node, a cluster leader and through a follower.

Differential: the Arrow table the network read builds (raw segment records decoded column-wise)
equals the one the AMQP consume path builds (``amqp.read_columns``) and, where the test can see
the broker's files (single node), the data-dir path's, over mixed records (varied properties,
nested headers, empty bodies, alike runs, several segments) under offset and timestamp bounds.
Then the endpoint's refusals: no credentials, a user without read permission (nothing
answered), a bad format version, and its size bound. Small counts; the rate is measured by
``benchmarks/spark.py``.
"""

from __future__ import annotations

import base64
import json
import mmap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import connect, is_external, unique, wait_until

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark.sql.datasource")

from test_spark_segment_arrow import NAMES, PA_SCHEMA, SCHEMA  # noqa: E402 - tests/ is on sys.path

from broker import recordwire  # noqa: E402
from broker.spark import amqp, netread  # noqa: E402
from broker.spark.rows import PropsDecoder, segment_batch, to_batch  # noqa: E402
from broker.spark.segment_arrow import columns, walk  # noqa: E402
from broker.store.paths import find_vhost_dir, queue_dir  # noqa: E402
from broker.store.segment import HEADER_SIZE  # noqa: E402
from broker.store.stream_store import list_segments  # noqa: E402

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = [pytest.mark.cluster_modes,
              pytest.mark.skipif(is_external(), reason="needs Skred's management API")]

N = 600


def _http(b: Any, user: str = "guest", password: str = "guest") -> str:
    return f"http://{user}:{password}@{b.host}:{b.mgmt_port}"


def _api(b: Any, method: str, path: str, body: Any = None, auth: tuple[str, str] | None = ("guest", "guest"),
         ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://{b.host}:{b.mgmt_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def stream(shared_broker: Any) -> str:
    """A stream of N mixed records over several small segments (published without a confirm
    each, which costs seconds under load; the fixture waits until all N are there)."""
    name = unique("recs")
    conn = connect(shared_broker)
    try:
        ch = conn.channel()
        ch.queue_declare(name, durable=True, arguments={
            "x-queue-type": "stream", "x-stream-max-segment-size-bytes": 8192})
        ch.queue_bind(name, "amq.direct", "rk")
        for i in range(N):
            kind = i % 7
            if 200 <= i < 260:  # an alike run: one body length, one properties value
                props, body = pika.BasicProperties(delivery_mode=2), b"same-%03d" % i
            elif kind == 0:
                props, body = pika.BasicProperties(), b""
            elif kind == 1:
                props = pika.BasicProperties(headers={"n": {"deep": [i, "x"]}, "s": "\u00e9"})
                body = b"h%d" % i
            else:
                props = pika.BasicProperties(content_type="text/plain", priority=kind,
                                             message_id=f"m{i}" if kind % 2 else None,
                                             headers={"i": i} if kind > 3 else None)
                body = b"x" * (i % 50)
            if kind == 3:  # another exchange and routing key
                ch.basic_publish("amq.direct", "rk", body, props)
            else:
                ch.basic_publish("", name, body, props)
    finally:
        conn.close()
    with netread.RecordsClient(_http(shared_broker), "/") as c:
        wait_until(lambda: c.extent(name) == (0, N), 20, "every record stored")
    return name


def _net_table(b: Any, queue: str, start: int, stop: int, ts: tuple[int | None, int | None] = (None, None),
               batch_rows: int = 97, max_bytes: int = 3000) -> Any:
    decoder = PropsDecoder()
    with netread.RecordsClient(_http(b), "/") as c:
        batches = [segment_batch(seg, PA_SCHEMA, decoder, NAMES, queue, 0)
                   for seg in netread.read_columns(c, queue, start, stop, batch_rows, max_bytes, *ts,
                                                   gap=lambda lo, hi: pytest.fail(f"gap {lo}..{hi}"))]
    return pa.Table.from_batches(batches, PA_SCHEMA)


def _amqp_table(b: Any, queue: str, start: int, stop: int,
                ts: tuple[int | None, int | None] = (None, None)) -> Any:
    decoder = PropsDecoder()
    batches = [to_batch(cols, PA_SCHEMA, decoder, NAMES, queue, 0)
               for cols in amqp.read_columns(b.url, queue, start, stop, 1000, *ts, timeout=20)]
    return pa.Table.from_batches(batches, PA_SCHEMA)


def _dir_table(data_dir: Path, queue: str, start: int, stop: int) -> Any:
    decoder = PropsDecoder()
    out = []
    for info in list_segments(queue_dir(find_vhost_dir(data_dir, "/"), queue)):
        if not info.count or info.first_offset is None:
            continue
        with open(info.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos, offset, done = HEADER_SIZE, info.first_offset, False
            while not done:
                at, stamps, pos, offset, done = walk(mm, len(mm), pos, offset, start, stop, 1 << 20, 1 << 30)
                if len(at):
                    seg = columns(mm, at, stamps, offset - len(at), None, None)
                    out.append(segment_batch(seg, PA_SCHEMA, decoder, NAMES, queue, 0))
    return pa.Table.from_batches(out, PA_SCHEMA)


def test_network_read_equals_the_amqp_and_data_dir_reads(shared_broker: Any, stream: str) -> None:
    b = shared_broker
    with netread.RecordsClient(_http(b), "/") as c:
        assert c.extent(stream) == (0, N)
    whole = _net_table(b, stream, 0, N)
    assert whole.column("offset").to_pylist() == list(range(N))
    assert whole.equals(_amqp_table(b, stream, 0, N))
    if b.data_dir is not None:  # a single node: its files are here
        assert whole.equals(_dir_table(b.data_dir, stream, 0, N))
    # offset bounds inside segments, and a timestamp window
    assert _net_table(b, stream, 137, 411).equals(_amqp_table(b, stream, 137, 411))
    stamps = whole.column("timestamp").cast(pa.int64()).to_pylist()
    lo, hi = stamps[150] // 1000, stamps[450] // 1000  # microseconds -> ms
    assert _net_table(b, stream, 0, N, (lo, hi)).equals(_amqp_table(b, stream, 0, N, (lo, hi)))
    with netread.RecordsClient(_http(b), "/") as c:
        assert c.first_at(stream, lo) == next(i for i, t in enumerate(stamps) if t // 1000 >= lo)


def test_records_refused_without_login_or_read_permission(shared_broker: Any, stream: str) -> None:
    b = shared_broker
    path = f"/api/streams/%2F/{stream}/records?offset=0"
    status, _headers, body = _api(b, "GET", path, auth=None)
    assert status == 401 and not body.startswith(recordwire.MAGIC)
    user = unique("reader")
    assert _api(b, "PUT", f"/api/users/{user}", {"password": "pw", "tags": ""})[0] in (201, 204)
    try:
        assert _api(b, "PUT", f"/api/permissions/%2F/{user}",
                    {"configure": ".*", "write": ".*", "read": "^nothing$"})[0] in (201, 204)
        status, _headers, body = _api(b, "GET", path, auth=(user, "pw"))
        assert status == 401 and b"read" in body and not body.startswith(recordwire.MAGIC), (status, body)
        with netread.RecordsClient(_http(b, user, "pw"), "/") as c, \
                pytest.raises(netread.RecordsError, match="401"):
            c.extent(stream)
        # the read permission is what counts, not a management tag (AMQP's rule)
        assert _api(b, "PUT", f"/api/permissions/%2F/{user}",
                    {"configure": "", "write": "", "read": ".*"})[0] in (201, 204)
        with netread.RecordsClient(_http(b, user, "pw"), "/") as c:
            assert c.get(stream, 1 << 20, offset=0).count > 0
        # a tagless user is still no management user
        assert _api(b, "GET", "/api/queues", auth=(user, "pw"))[0] == 401
    finally:
        _api(b, "DELETE", f"/api/users/{user}")


def test_records_size_bound_and_version(shared_broker: Any, stream: str) -> None:
    b = shared_broker
    base = f"/api/streams/%2F/{stream}/records"
    head = recordwire.HEAD.size

    def get(query: str) -> tuple[recordwire.Head, bytes]:
        status, _headers, body = _api(b, "GET", f"{base}?{query}")
        assert status == 200, body
        return recordwire.unpack(body), body[head:]

    h, recs = get("offset=5&max_bytes=300")
    assert 0 < len(recs) <= 300 and h.first == 5 and h.count > 0
    assert (h.stream_first, h.stream_next) == (0, N)
    h, recs = get("offset=5&max_bytes=1")  # one record all the same
    assert h.count == 1 and recs
    assert get("offset=5&end=8")[0].count == 3
    h, recs = get("offset=first&max_bytes=0")
    assert (h.count, recs, h.stream_next) == (0, b"", N)
    for bad in (f"max_bytes={(64 << 20) + 1}", "offset=-1", "offset=abc", "end=x", "offset=0&timestamp=5"):
        assert _api(b, "GET", f"{base}?{bad}")[0] == 400, bad
    status, _headers, body = _api(b, "GET", f"{base}?version=2")
    assert status == 400 and b"version" in body
    assert _api(b, "GET", f"/api/streams/%2F/{unique('none')}/records")[0] == 404
    with pytest.raises(ValueError, match="version 2"):
        recordwire.unpack(recordwire.HEAD.pack(recordwire.MAGIC, 2, 0, 0, 0, 0, 0))


def test_records_removed_by_retention_are_data_loss(shared_broker: Any, cleanup: Any) -> None:
    """The source's partition read over raw records (what a Spark task runs) fails on offsets
    retention removed unless failOnDataLoss=false, which reads on from the first one held."""
    from broker.spark.options import TopicPartition
    from broker.spark.source import DataLoss, RangePartition, _Options

    b = shared_broker
    q = cleanup.queue()
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments={"x-queue-type": "stream", "x-max-length": 40,
                                                     "x-stream-max-segment-size-bytes": 2048})
        for i in range(300):
            ch.basic_publish("", q, b"r%03d" % i + b"." * 40)
    finally:
        conn.close()
    with netread.RecordsClient(_http(b), "/") as c:
        wait_until(lambda: c.extent(q)[1] == 300, 20, "every record stored")
        first, nxt = c.extent(q)
    assert 0 < first < nxt == 300
    part = RangePartition(TopicPartition(q, 0, q), 0, nxt)
    strict = _Options({"uri": _http(b), "queue": q})
    with pytest.raises(DataLoss, match=f"offsets 0..{first - 1}"):
        list(strict.batches(part, SCHEMA))
    lenient = _Options({"uri": _http(b), "queue": q, "failOnDataLoss": "false"})
    rows = pa.Table.from_batches(list(lenient.batches(part, SCHEMA)), PA_SCHEMA)
    assert rows.column("offset").to_pylist() == list(range(first, nxt))
    assert rows.column("value").to_pylist()[-1] == b"r299" + b"." * 40


def test_source_options_over_raw_records(shared_broker: Any, stream: str) -> None:
    """The source's planning over raw records, as Spark drives it (without Spark): a batch read
    bounded by offsets and a start timestamp, and a rate-limited streaming micro-batch."""
    from broker.spark.source import SkredBatchReader, SkredStreamReader, _Options

    def rows(reader: Any, parts: list[Any]) -> list[int]:
        out: list[int] = []
        for p in parts:
            for batch in reader.read(p):
                out += batch.column(NAMES.index("offset")).to_pylist()
        return out

    uri = {"uri": _http(shared_broker), "subscribe": stream}
    whole = _net_table(shared_broker, stream, 0, N)
    ts = whole.column("timestamp").cast(pa.int64()).to_pylist()[300] // 1000
    first = next(i for i, t in enumerate(whole.column("timestamp").cast(pa.int64()).to_pylist())
                 if t // 1000 >= ts)
    batch = SkredBatchReader(_Options({**uri, "startingTimestamp": str(ts), "minPartitions": "3",
                                       "endingOffsets": json.dumps({stream: {"0": 550}})}), SCHEMA)
    parts = batch.partitions()
    assert len(parts) == 3
    assert rows(batch, parts) == list(range(first, 550))
    streaming = SkredStreamReader(_Options({**uri, "startingOffsets": "earliest",
                                            "maxOffsetsPerTrigger": "250"}), SCHEMA)
    start = streaming.initialOffset()
    end = streaming.latestOffset(start, streaming.getDefaultReadLimit())
    assert (start, end) == ({stream: {"0": 0}}, {stream: {"0": 250}})
    assert rows(streaming, streaming.partitions(start, end)) == list(range(250))
