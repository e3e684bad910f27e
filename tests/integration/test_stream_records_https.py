"""The Spark source's network read over HTTPS (``uri=https://...``, the management TLS port).

A broker with the management API on TLS too (certificates from ``_tls.make_pki``); the source's
batch reader (as Spark drives it, without Spark) reads a stream through
``GET /api/streams/{vhost}/{queue}/records`` over HTTPS, trusting the test CA named in the URI
(``?cafile=``, the AMQP path's URI parameter), and gets the table the plain-HTTP read of the
same broker gets. A URI without the CA is refused by certificate verification with a clear error,
and a wrong password with the broker's 401: nothing is read either way. Small counts.
"""

from __future__ import annotations

import socket
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, free_port, unique, wait_until
from ._tls import PKI, make_pki, tls_args

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark.sql.datasource")

from test_spark_segment_arrow import SCHEMA  # noqa: E402 - tests/ is on sys.path

from broker.spark import netread  # noqa: E402
from broker.spark.source import SkredBatchReader, _Options  # noqa: E402

N = 300


class _Node:
    def __init__(self, proc: SkredProcess, https_port: int, pki: PKI) -> None:
        self.proc, self.https_port, self.pki = proc, https_port, pki


def _https_answers(port: int, pki: PKI) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw, \
                pki.client_context().wrap_socket(raw, server_hostname="localhost"):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("https-records")
    pki = make_pki(tmp / "pki")
    https_port = free_port()
    proc = SkredProcess(tmp / "data", tls_args(pki, "--mgmt-tls-port", str(https_port)))
    proc.start()
    try:
        wait_until(lambda: _https_answers(https_port, pki), 30, "the management TLS port")
        yield _Node(proc, https_port, pki)
    finally:
        proc.close()


@pytest.fixture(scope="module")
def stream(node: Any) -> str:
    name = unique("tls-recs")
    with pika.BlockingConnection(pika.URLParameters(node.proc.url)) as conn:
        ch = conn.channel()
        ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream"})
        ch.confirm_delivery()
        for i in range(N):
            ch.basic_publish("", name, b"r%d" % i, pika.BasicProperties(
                delivery_mode=2, headers={"i": i, "nested": {"even": i % 2 == 0}}))
    return name


def _https(node: Any, password: str = "guest", ca: Path | None = None) -> str:
    query = f"?cafile={urllib.parse.quote(str(ca))}" if ca is not None else ""
    return f"https://guest:{password}@localhost:{node.https_port}/{query}"


def _table(uri: str, stream: str) -> Any:
    reader = SkredBatchReader(_Options({"uri": uri, "subscribe": stream, "minPartitions": "2",
                                        "includeHeaders": "true"}), SCHEMA)
    parts = reader.partitions()
    return pa.Table.from_batches([b for p in parts for b in reader.read(p)])


def test_source_reads_records_over_https(node: Any, stream: str) -> None:
    table = _table(_https(node, ca=node.pki.ca.cert_path), stream)
    assert table.column("offset").to_pylist() == list(range(N))
    assert table.column("value").to_pylist() == [b"r%d" % i for i in range(N)]
    plain = _table(f"http://guest:guest@{node.proc.host}:{node.proc.mgmt_port}", stream)
    assert table.equals(plain)


def test_https_refusals(node: Any, stream: str) -> None:
    with pytest.raises(ConnectionError) as ei:  # the test CA is not in the system's trust store
        with netread.RecordsClient(_https(node), "/") as c:
            c.extent(stream)
    assert isinstance(ei.value.__cause__, ssl.SSLCertVerificationError), ei.value
    with pytest.raises(netread.RecordsError, match="HTTP 401"):
        with netread.RecordsClient(_https(node, "wrong", node.pki.ca.cert_path), "/") as c:
            c.extent(stream)
