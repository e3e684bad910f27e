"""skred-perf runs against a real broker and reports sane numbers (no timing assertions).

The tests share the module's broker: skred-perf names its queues per run (the message-id test
names its own).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from ._support import Broker, connect

REPO_ROOT = Path(__file__).resolve().parents[2]


def perf(*args: str, timeout: float = 90.0) -> dict[str, Any]:
    """Run ``skred-perf ARGS -j`` (as ``python -m broker.perf``) and return its JSON summary."""
    proc = subprocess.run(
        [sys.executable, "-m", "broker.perf", *args, "-j"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"skred-perf failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got: {proc.stdout!r}"
    result: dict[str, Any] = json.loads(lines[0])
    assert result["errors"] == []
    assert not result["interrupted"]
    return result


def assert_queues_deleted(broker: Broker, names: list[str]) -> None:
    assert names, "the summary should list the queues the tool declared"
    conn = connect(broker)
    try:
        for name in names:
            ch = conn.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
                ch.queue_declare(name, passive=True)
            assert err.value.reply_code == 404
    finally:
        if conn.is_open:
            conn.close()


def test_throughput_autoack_count_bound(shared_broker: Broker) -> None:
    r = perf("throughput", "--uri", shared_broker.url, "-z", "30", "-C", "3000", "-s", "16")
    assert r["published"] == 3000
    assert r["consumed"] == r["published"]
    assert r["publish_rate"] > 0 and r["consume_rate"] > 0
    assert r["tool_cpu_percent"] >= 0
    assert r["server"]["product"]
    assert_queues_deleted(shared_broker, r["deleted_queues"])


def test_throughput_time_bound(shared_broker: Broker) -> None:
    r = perf("throughput", "--uri", shared_broker.url, "-z", "2")
    assert r["published"] > 0
    assert 0 < r["consumed"] <= r["published"]
    assert r["median_1s_publish"] >= 0
    assert_queues_deleted(shared_broker, r["deleted_queues"])


def test_throughput_manual_ack_confirms_persistent(shared_broker: Broker) -> None:
    r = perf(
        "throughput",
        "--uri",
        shared_broker.url,
        "-z",
        "30",
        "-C",
        "2000",
        "-a",
        "50",
        "-P",
        "200",
        "-c",
        "100",
        "-p",
        "-l",
        "-s",
        "64",
    )
    assert r["published"] == 2000
    assert r["consumed"] == 2000
    assert r["confirmed"] + r["nacked"] == 2000
    assert r["nacked"] == 0
    lat = r["latency_us"]
    assert 0 <= lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]


def test_throughput_fanout_and_large_bodies(shared_broker: Broker) -> None:
    r = perf("throughput", "--uri", shared_broker.url, "-z", "30", "-C", "300", "-s", "70000",
             "--fanout-queues", "3")
    assert r["published"] == 300
    assert r["consumed"] == 900  # every queue gets every message
    assert r["consume_mib_s"] > 0
    assert len(r["queues"]) == 3
    assert_queues_deleted(shared_broker, r["deleted_queues"])


def test_throughput_prefill_then_consume(shared_broker: Broker) -> None:
    r = perf("throughput", "--uri", shared_broker.url, "-z", "30", "-x", "0", "--prefill", "5000")
    assert r["published"] == 0
    assert r["consumed"] == 5000


def test_queue_count(shared_broker: Broker) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "broker.perf", "queue-count", "50", "--uri", shared_broker.url, "-j"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["queues"] == 50


def test_throughput_message_ids_give_each_message_its_own(shared_broker: Broker) -> None:
    """--message-ids: every message of a batch carries a distinct message-id (and the
    body and latency stamps still land where they should)."""
    q = "perf-ids"
    conn = connect(shared_broker)
    try:
        conn.channel().queue_declare(q)
        r = perf("throughput", "--uri", shared_broker.url, "-x", "1", "-y", "0", "-C", "300", "-u", q,
                 "--message-ids", "-s", "24")
        assert r["published"] == 300
        ch = conn.channel()
        ids = []
        for _ in range(300):
            m, props, body = ch.basic_get(q, auto_ack=True)
            assert m is not None and len(body) == 24
            ids.append(props.message_id)
        assert all(isinstance(i, str) and len(i) == 12 for i in ids)
        assert len(set(ids)) > 100
        r = perf("throughput", "--uri", shared_broker.url, "-C", "2000", "--message-ids", "-l", "-z", "30")
        assert r["consumed"] == r["published"] == 2000
        assert 0 <= r["latency_us"]["p50"] <= r["latency_us"]["p99"] < 30_000_000
    finally:
        conn.close()
