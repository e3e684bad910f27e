#!/usr/bin/env python3
"""How long ``GET /api/mqtt/sessions`` takes with many MQTT sessions (issue 32).

Starts a broker of this checkout (``tests/integration/_support.SkredProcess``: free ports, its
own data dir), makes ``--sessions`` persistent MQTT 3.1.1 sessions (CONNECT with clean session
0, SUBSCRIBE at QoS 1 to a topic of their own, DISCONNECT: each leaves a durable subscription
queue behind, a session "away"), of which the last ``--connected`` stay connected, then times
the requests the UI's MQTT sessions page and a script make, ``--runs`` times each, and prints
the median and maximum in milliseconds and the broker's CPU time per request (user + system, from
``/proc``: the steadier figure on a loaded machine). For a before/after table run the same script
from the other checkout (it starts that checkout's broker), at the same time for a fair ratio.

    python benchmarks/mqtt_sessions.py --sessions 10000 --connected 500
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import struct
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration._support import SkredProcess  # noqa: E402

AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
REQUESTS = [
    "/api/mqtt/sessions?page=1&page_size=100&sort=client_id",  # what the UI's list asks
    "/api/mqtt/sessions?page=1&page_size=100&sort=client_id&sort_reverse=true&name=bench-009",
    "/api/mqtt/sessions/%2F?page=1&page_size=100",
    "/api/mqtt/sessions/%2F/bench-00042",  # one session's page
    "/api/mqtt/sessions",  # every session, rendered (a script's full dump)
]
DEADLINE = 900.0  # seconds the sessions may take to make


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def _packet(kind: int, body: bytes) -> bytes:
    n, length = len(body), b""
    while True:
        byte, n = n % 128, n // 128
        length += bytes((byte | (0x80 if n else 0),))
        if not n:
            return bytes((kind,)) + length + body


def _connect(client_id: str) -> bytes:
    # MQTT 3.1.1, username and password, clean session 0 (a persistent session), keepalive 600 s
    return _packet(0x10, _str("MQTT") + bytes((4, 0xC0)) + struct.pack(">H", 600) + _str(client_id)
                   + _str("guest") + _str("guest"))


async def make_session(host: str, port: int, client_id: str, stay: bool) -> asyncio.StreamWriter | None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_connect(client_id))
    ack = await reader.readexactly(4)
    assert ack[0] == 0x20 and ack[3] == 0, f"CONNACK {ack!r}"
    writer.write(_packet(0x82, struct.pack(">H", 1) + _str(f"bench/{client_id}/#") + b"\x01"))
    suback = await reader.readexactly(5)
    assert suback[0] == 0x90 and suback[4] == 1, f"SUBACK {suback!r}"
    if stay:
        return writer
    writer.write(b"\xe0\x00")  # DISCONNECT
    await writer.drain()
    writer.close()
    return None


async def make_sessions(host: str, port: int, n: int, connected: int, parallel: int = 32
                        ) -> list[asyncio.StreamWriter]:
    kept: list[asyncio.StreamWriter] = []
    ids = iter(range(n))
    deadline = time.monotonic() + DEADLINE

    async def worker() -> None:
        for i in ids:
            assert time.monotonic() < deadline, "making the sessions took too long"
            w = await make_session(host, port, f"bench-{i:05d}", i >= n - connected)
            if w is not None:
                kept.append(w)

    await asyncio.gather(*(worker() for _ in range(parallel)))
    return kept


def cpu_ms(pid: int) -> float:
    """A process's user + system CPU time so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def timed(url: str) -> tuple[float, int]:
    req = urllib.request.Request(url, headers={"Authorization": AUTH})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        size = len(resp.read())
    return (time.perf_counter() - t0) * 1000, size


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="skred-mqtt-sessions-") as tmp:
        b = SkredProcess(Path(tmp) / "data", ["--log-level", "warning", "--workers", "1", "--no-sync"])
        b.start()
        try:
            t0 = time.monotonic()
            kept = await make_sessions(b.host, b.mqtt_port, args.sessions, args.connected)
            print(f"{args.sessions} sessions ({len(kept)} connected) made in {time.monotonic() - t0:.1f} s",
                  file=sys.stderr)
            base = f"http://{b.host}:{b.mgmt_port}"
            print(f"| request ({args.sessions} sessions, {args.connected} connected) | median ms | max ms | "
                  "broker CPU ms | bytes |\n| --- | ---: | ---: | ---: | ---: |")
            assert b.pid is not None
            for path in REQUESTS:
                timed(base + path)  # warm-up
                cpu0 = cpu_ms(b.pid)
                runs = [timed(base + path) for _ in range(args.runs)]
                cpu = (cpu_ms(b.pid) - cpu0) / args.runs
                ms = [t for t, _ in runs]
                print(f"| `{path}` | {statistics.median(ms):.1f} | {max(ms):.1f} | {cpu:.0f} "
                      f"| {runs[-1][1]:,} |")
            for w in kept:
                w.close()
        finally:
            b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--connected", type=int, default=500, help="of the sessions, how many stay connected")
    ap.add_argument("--runs", type=int, default=7)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
