"""LMQ statistics to StatsD over UDP: queue lengths (gauges) and put/get/ack counts (counters).

Every ``[lmq] stats_interval`` milliseconds (LMQ's unit; ``run`` takes seconds) one datagram per
batch of lines, ``lmq.<queue>.length:<n>|g`` and ``lmq.<queue>.<put|get|ack>:<n>|c`` (the counts
since the last send). Characters StatsD treats specially in a queue name (``.:|@`` and white
space) become ``_``. UDP: a missing StatsD server costs nothing and is never an error.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket

from broker.lmq.engine import LMQ

log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[.:|@\s/]")
MAX_DATAGRAM = 1400  # stay under a typical MTU


def lines(lmq: LMQ) -> list[str]:
    out: list[str] = []
    for name, q in sorted(lmq.vhost.queues.items()):
        if q.exclusive_owner is None:
            out.append(f"lmq.{_UNSAFE.sub('_', name)}.length:{q.message_count}|g")
    counts, lmq.counters = lmq.counters, type(lmq.counters)()
    for (name, what), n in sorted(counts.items()):
        out.append(f"lmq.{_UNSAFE.sub('_', name)}.{what}:{n}|c")
    return out


def datagrams(all_lines: list[str]) -> list[bytes]:
    out: list[bytes] = []
    batch = b""
    for line in all_lines:
        data = line.encode()
        if batch and len(batch) + 1 + len(data) > MAX_DATAGRAM:
            out.append(batch)
            batch = b""
        batch = data if not batch else batch + b"\n" + data
    if batch:
        out.append(batch)
    return out


async def run(lmq: LMQ, host: str, port: int, interval: float) -> None:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    try:
        while True:
            await asyncio.sleep(interval)
            for datagram in datagrams(lines(lmq)):
                try:
                    sock.sendto(datagram, (host, port))
                except OSError as exc:  # e.g. no route: statistics are best effort
                    log.debug("StatsD send to %s:%d failed: %s", host, port, exc)
    finally:
        sock.close()
