"""benchmarks/latency.py (issue 31): the open-loop generator's messages carry their intended
send time where its consumer reads it, and run.py's latency rows name cells it has."""

from __future__ import annotations

import random
import struct
from array import array

from pamqp import commands
from pamqp import frame as pframe
from test_bench_latency_floor import _load


def test_a_celery_message_carries_the_stamp_at_the_start_of_its_body() -> None:
    latency = _load("latency")
    head, tail = latency.celery_message("q", random.Random(1), 7, persistent=True)
    stamp = struct.pack(">q", 123456789)
    data = head + stamp + tail
    frames = []
    while data:
        used, _, f = pframe.unmarshal(data)
        frames.append(f)
        data = data[used:]
    publish, header, body = frames
    assert isinstance(publish, commands.Basic.Publish) and publish.routing_key == "q"
    assert header.properties.delivery_mode == 2 and header.properties.headers["id"] == "7"
    assert 200 <= header.body_size <= 2048 and body.value[:8] == stamp


def test_percentiles_are_exact_over_every_sample() -> None:
    latency = _load("latency")
    r = latency._pcts(array("q", range(1_000_000, 1_001_000 * 1000 + 1, 1_000_000)))  # 1..1001 ms
    assert (r["p50_ms"], r["p99_ms"], r["max_ms"]) == (501.0, 991.0, 1001.0)


def test_the_latency_rows_of_run_name_cells_of_latency() -> None:
    run, latency = _load("run"), _load("latency")
    rows = [s for s in run.scenarios(1000).values() if s.tool == "latency"]
    assert len(rows) == 20 and all(s.args[0] in latency.CELLS for s in rows)
