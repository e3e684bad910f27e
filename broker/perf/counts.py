"""``skred-perf queue-count`` / ``connection-count``: broker memory per queue / per connection.

Theory of operation: measure the broker's memory, create N queues (queue.declare pipelined in
batches on one connection: the broker answers in order, so we send a batch and then read the
same number of declare-oks) or N idle connections (asyncio, a bounded number of handshakes in
flight, each connection with channel 1 open), measure again and report the difference per
object. Memory comes from ``/proc/PID/status`` (VmRSS) with ``--pid`` and/or from the management
API's ``GET /api/nodes`` (``mem_used``) with ``--mgmt-uri``. Queues we declared are deleted at
the end unless ``--keep``; connections are closed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import resource
import struct
import sys
import time
import urllib.request
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

from broker.perf import codec
from broker.perf.client import CHANNEL, AmqpUri, Client
from broker.perf.handshake import Handshake, PerfError

DECLARE_BATCH = 500
_FRAME_HEAD = struct.Struct(">BHI")


def rss_from_pid(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (VmRSS)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise PerfError(f"cannot read /proc/{pid}/status: {exc}") from exc
    raise PerfError(f"no VmRSS in /proc/{pid}/status")


def mem_from_mgmt(mgmt_uri: str) -> int:
    """``mem_used`` of the first node reported by the management API, in bytes."""
    parts = urlsplit(mgmt_uri)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{host}:{parts.port}" if parts.port else host
    url = f"{parts.scheme or 'http'}://{netloc}{parts.path.rstrip('/')}/api/nodes"
    user = unquote(parts.username or "guest")
    password = unquote(parts.password or "guest")
    req = urllib.request.Request(url)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            nodes = json.load(resp)
    except (OSError, ValueError) as exc:
        raise PerfError(f"GET {url} failed: {exc}") from exc
    if not nodes or "mem_used" not in nodes[0]:
        raise PerfError(f"GET {url}: no mem_used in the answer")
    return int(nodes[0]["mem_used"])


def measure(pid: int, mgmt_uri: str) -> dict[str, int]:
    out: dict[str, int] = {}
    if pid:
        out["rss"] = rss_from_pid(pid)
    if mgmt_uri:
        out["mem_used"] = mem_from_mgmt(mgmt_uri)
    return out


def _report(
    kind: str, count: int, before: dict[str, int], after: dict[str, int], extra: dict[str, Any], as_json: bool
) -> None:
    result: dict[str, Any] = {kind: count, **extra}
    for key in after:
        result[f"{key}_before"] = before.get(key, 0)
        result[f"{key}_after"] = after[key]
        per = (after[key] - before.get(key, 0)) / count if count else 0.0
        result[f"{key}_per_{kind[:-1]}"] = round(per, 1)
    log = sys.stderr if as_json else sys.stdout
    lines = [f"{count} {kind}: " + ", ".join(f"{k} {v}" for k, v in extra.items())]
    for key in after:
        lines.append(
            f"  broker {key}: {before.get(key, 0) / 2**20:.1f} MiB -> {after[key] / 2**20:.1f} MiB"
            f" ({result[f'{key}_per_{kind[:-1]}']:.0f} bytes per {kind[:-1]})"
        )
    if not after:
        lines.append("  (give --pid or --mgmt-uri to see the broker's memory)")
    print("\n".join(lines), file=log)
    if as_json:
        print(json.dumps(result))


def queue_count(
    uri: str, count: int, *, pid: int, mgmt_uri: str, durable: bool, keep: bool, hold: float, as_json: bool
) -> int:
    ctl = Client(AmqpUri.parse(uri), name="skred-perf queue-count")
    prefix = f"skred-perf-qc-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{i}" for i in range(count)]
    before = measure(pid, mgmt_uri)
    t0 = time.monotonic()
    declared = 0
    try:
        for i in range(0, count, DECLARE_BATCH):
            chunk = names[i : i + DECLARE_BATCH]
            ctl.send(b"".join(codec.queue_declare(CHANNEL, n, durable=durable) for n in chunk))
            for _ in chunk:
                ctl.wait_for(codec.QUEUE_DECLARE_OK, timeout=60.0)
                declared += 1
        took = time.monotonic() - t0
        after = measure(pid, mgmt_uri)
        _report("queues", declared, before, after, {"declare_s": round(took, 2)}, as_json)
        if hold:
            time.sleep(hold)  # the operator asked to keep them around for a while
    finally:
        if not keep:
            for i in range(0, declared, DECLARE_BATCH):
                chunk = names[i : min(declared, i + DECLARE_BATCH)]
                ctl.send(b"".join(codec.queue_delete(CHANNEL, n) for n in chunk))
                for _ in chunk:
                    ctl.wait_for(codec.QUEUE_DELETE_OK, timeout=60.0)
        ctl.close()
    return 0


async def _open_idle(uri: AmqpUri, timeout: float) -> asyncio.StreamWriter:
    """One connection through the handshake plus channel.open; returns its writer."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(uri.host, uri.port)
    try:
        hs = Handshake(uri.user, uri.password, uri.vhost, client_name="skred-perf idle")
        writer.write(hs.initial())
        channel_open_sent = False
        while True:
            async with asyncio.timeout(timeout):
                head = await reader.readexactly(7)
            ftype, channel, size = _FRAME_HEAD.unpack(head)
            async with asyncio.timeout(timeout):
                payload = await reader.readexactly(size + 1)
            if ftype != codec.FRAME_METHOD:
                continue
            cls, meth = codec.class_method(payload)
            if not hs.done:
                writer.write(hs.on_method(channel, cls, meth, payload[4:-1]))
            elif (cls, meth) == codec.CHANNEL_OPEN_OK:
                return writer
            elif (cls, meth) in (codec.CONNECTION_CLOSE, codec.CHANNEL_CLOSE):
                raise PerfError("broker closed the connection while opening a channel")
            if hs.done and not channel_open_sent:
                writer.write(codec.channel_open(CHANNEL))
                channel_open_sent = True
    except BaseException:
        writer.close()
        raise


async def _open_many(uri: AmqpUri, count: int, concurrency: int) -> list[asyncio.StreamWriter]:
    sem = asyncio.Semaphore(max(1, concurrency))
    writers: list[asyncio.StreamWriter] = []

    failed: list[BaseException] = []

    async def one() -> None:
        async with sem:
            if failed:  # fail fast: a broker at its connection limit will not get better
                return
            try:
                writers.append(await _open_idle(uri, 30.0))
            except BaseException as exc:
                failed.append(exc)
                raise

    results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for w in writers:
            w.close()
        raise PerfError(f"{len(errors)} of {count} connections failed, first: {errors[0]!r}")
    return writers


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            print(f"warning: file descriptor limit {new} < {want}; expect failures", file=sys.stderr)


def connection_count(
    uri: str, count: int, *, pid: int, mgmt_uri: str, concurrency: int, hold: float, as_json: bool
) -> int:
    parsed = AmqpUri.parse(uri)
    _raise_fd_limit(count)

    async def run() -> None:
        before = measure(pid, mgmt_uri)
        t0 = time.monotonic()
        writers = await _open_many(parsed, count, concurrency)
        took = time.monotonic() - t0
        try:
            after = measure(pid, mgmt_uri)
            _report("connections", len(writers), before, after, {"open_s": round(took, 2)}, as_json)
            if hold:
                await asyncio.sleep(hold)  # the operator asked to keep them open for a while
        finally:
            for w in writers:
                try:
                    w.write(codec.connection_close())
                except (OSError, RuntimeError):
                    pass
                w.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)

    asyncio.run(run())
    return 0
