"""Producer and consumer process bodies for ``skred-perf throughput``.

Theory of operation: each client runs in its own process with its own connection (channel 1),
so the load generator scales past one core and never shares a GIL with the broker client it
measures against. A child connects, reports ``ready`` over its pipe, waits for the shared
``go`` event, runs its loop and finally sends a result dict (counts, the monotonic time of its
last useful work, its own CPU seconds spent after ``go``) or ``{"error": ...}``.

Producers send one pre-encoded batch (``per_batch`` copies of the message, see ``codec.py``) per
``sendall``; with latency on they stamp ``time.monotonic_ns()`` into each body of the batch
first (one ``pack_into`` per message). In confirm mode they keep at most ``window`` messages
unconfirmed, reading confirms between batches; otherwise they peek for incoming frames (a
connection.close, channel.flow) with a zero-timeout ``select`` once per batch.

Consumers ``recv_into`` a 4 MiB buffer and count with the frame scanner; in manual-ack mode they
send basic.ack(multiple=true) once at least ``ack_every`` deliveries are unacknowledged.
Live counts go to a shared ``RawArray`` (one writer per slot, read by the parent each tick).
"""

from __future__ import annotations

import os
import resource
import select
import signal
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import SynchronizedArray
from typing import Any, Protocol

from broker.perf import codec
from broker.perf.client import CHANNEL, AmqpUri, Client, ConsumerCancelled
from broker.perf.handshake import PerfError

# Counter slots per client in the shared array.
SLOT_COUNT = 0  # published (producers) / consumed (consumers)
SLOT_SETTLED = 1  # confirmed or nacked (producers) / body bytes (consumers)
SLOTS = 2

# About 64 KiB per sendall: large enough that syscall cost vanishes per message, small
# enough that a confirm window or a -C bound is not overshot by much.
BATCH_BYTES = 65536
MAX_BATCH_MESSAGES = 4096
_STAMP = struct.Struct(">Q")


class Flag(Protocol):
    value: int


class GoEvent(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class ProducerJob:
    uri: str
    exchange: str
    routing_key: str
    body_size: int
    persistent: bool
    confirm_window: int  # 0 = no confirms
    count: int  # 0 = unbounded (time limit only)
    seconds: float  # 0 = no time limit
    latency: bool
    batch_bytes: int = BATCH_BYTES
    message_ids: bool = False  # a distinct message-id property per message of a batch


@dataclass(frozen=True)
class ConsumerJob:
    uri: str
    queue: str
    ack_every: int  # 0 = autoack
    prefetch: int  # 0 = no basic.qos
    latency: bool
    tag: str


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def message_body(size: int) -> bytes:
    # Printable filler so a broker's message browser shows something sensible.
    return (b"skred-perf " * (size // 11 + 1))[:size]


def run_child(
    job: ProducerJob | ConsumerJob,
    slot: int,
    counters: SynchronizedArray[Any],
    stop: Flag,
    go: GoEvent,
    pipe: Connection,
) -> None:
    """Process entry point: Ctrl-C is the parent's business; report errors through the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's terminate() must just work
    client: Client | None = None
    try:
        client = Client(AmqpUri.parse(job.uri), name=f"skred-perf {os.getpid()}")
        if isinstance(job, ProducerJob):
            result = _produce(client, job, slot, counters, stop, go, pipe)
        else:
            result = _consume(client, job, slot, counters, stop, go, pipe)
        pipe.send(result)
    except (PerfError, codec.CodecError, OSError) as exc:
        pipe.send({"error": str(exc)})
    except BaseException as exc:  # noqa: BLE001 - a child must always report
        pipe.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        if client is not None:
            client.close()
        pipe.close()


def _stopped(stop: Flag) -> bool:
    return bool(stop.value)


def _wait_go(go: GoEvent, pipe: Connection, stop: Flag) -> bool:
    pipe.send({"ready": True})
    while not go.wait(0.2):
        if stop.value:
            return False
    return not stop.value


def _produce(
    client: Client,
    job: ProducerJob,
    slot: int,
    counters: SynchronizedArray[Any],
    stop: Flag,
    go: GoEvent,
    pipe: Connection,
) -> dict[str, Any]:
    window = job.confirm_window
    if window:
        client.rpc(codec.confirm_select(CHANNEL), codec.CONFIRM_SELECT_OK)
    body = message_body(job.body_size)
    msg = codec.encode_message(
        CHANNEL, job.exchange, job.routing_key, body, client.frame_max, persistent=job.persistent
    )
    id_len = codec.MESSAGE_ID_LEN if job.message_ids else 0
    if id_len:
        msg = codec.encode_message(CHANNEL, job.exchange, job.routing_key, body, client.frame_max,
                                   persistent=job.persistent, message_id=b"0" * id_len)
    per_batch = max(1, min(MAX_BATCH_MESSAGES, job.batch_bytes // len(msg)))
    if window:
        per_batch = min(per_batch, max(1, window // 2))
    if id_len:
        # what a client library setting message_id sends: every header differs, so the
        # broker cannot take consecutive publishes as one run (all of one encoded length)
        batch = bytearray(b"".join(
            codec.encode_message(CHANNEL, job.exchange, job.routing_key, body, client.frame_max,
                                 persistent=job.persistent, message_id=b"%0*d" % (id_len, i))
            for i in range(per_batch)))
    else:
        batch = bytearray(msg * per_batch)
    view = memoryview(batch)
    stamp_at: list[int] = []
    if job.latency:
        first = codec.body_offset(CHANNEL, job.exchange, job.routing_key, persistent=job.persistent,
                                  message_id_len=id_len)
        stamp_at = [i * len(msg) + first for i in range(per_batch)]
    stamp = _STAMP.pack_into
    confirms = client.scanner.confirms
    sock = client.sock
    base = slot * SLOTS

    if not _wait_go(go, pipe, stop):
        return {"published": 0, "confirmed": 0, "nacked": 0, "end": time.monotonic(), "cpu": 0.0}
    cpu0 = cpu_seconds()
    t0 = time.monotonic()
    deadline = t0 + job.seconds if job.seconds else float("inf")
    published = 0
    end_time = t0
    count = job.count
    while not stop.value:
        k = per_batch
        if count:
            k = min(k, count - published)
            if k <= 0:
                break
        if window:
            # Keep at most `window` unconfirmed: read confirms until this batch fits.
            while published - confirms.settled + k > window and not _stopped(stop):
                client.pump(0.2)
                counters[base + SLOT_SETTLED] = confirms.settled
            if _stopped(stop):
                break
        elif _readable(sock):
            client.pump(1.0)
        if stamp_at:
            now = time.monotonic_ns()
            for off in stamp_at[:k]:
                stamp(batch, off, now)
        client.send(view[: k * len(msg)] if k != per_batch else view)
        published += k
        counters[base + SLOT_COUNT] = published
        end_time = time.monotonic()
        if end_time >= deadline:
            break
    cpu = cpu_seconds() - cpu0
    if window:
        # Collect outstanding confirms (for up to 5 s) so the summary can say what was settled.
        settle_deadline = time.monotonic() + 5.0
        while confirms.settled < published and time.monotonic() < settle_deadline:
            client.pump(0.2)
            counters[base + SLOT_SETTLED] = confirms.settled
    return {
        "published": published,
        "confirmed": confirms.acked,
        "nacked": confirms.nacked,
        "end": end_time,
        "cpu": cpu,
    }


def _consume(
    client: Client,
    job: ConsumerJob,
    slot: int,
    counters: SynchronizedArray[Any],
    stop: Flag,
    go: GoEvent,
    pipe: Connection,
) -> dict[str, Any]:
    manual = job.ack_every > 0
    if job.prefetch:
        client.rpc(codec.basic_qos(CHANNEL, job.prefetch), codec.BASIC_QOS_OK)
    scanner = client.scanner
    scanner.track_tags = manual
    if job.latency:
        from broker.perf.stats import new_histogram

        scanner.latency = new_histogram()
    base = slot * SLOTS
    if not _wait_go(go, pipe, stop):
        return {"consumed": 0, "bytes": 0, "end": time.monotonic(), "cpu": 0.0, "latency": None}
    cpu0 = cpu_seconds()
    end_time = time.monotonic()
    client.rpc(codec.basic_consume(CHANNEL, job.queue, job.tag, no_ack=not manual), codec.BASIC_CONSUME_OK)
    ack_every = job.ack_every
    acked = 0
    seen = scanner.completed
    latency = job.latency
    cancelled = False
    while not stop.value:
        try:
            got = client.pump(0.1, latency)
        except ConsumerCancelled:
            cancelled = True
            break
        if not got:
            continue
        if manual and scanner.delivered - acked >= ack_every:
            client.send(codec.basic_ack(CHANNEL, scanner.last_tag, multiple=True))
            acked = scanner.delivered
        completed = scanner.completed
        if completed != seen:
            seen = completed
            end_time = time.monotonic()
            counters[base + SLOT_COUNT] = completed
            counters[base + SLOT_SETTLED] = scanner.body_bytes
    cpu = cpu_seconds() - cpu0
    return {
        "consumed": scanner.completed,
        "bytes": scanner.body_bytes,
        "end": end_time,
        "cpu": cpu,
        "latency": scanner.latency,
        "cancelled": cancelled,
    }


def _readable(sock: Any) -> bool:
    """Bytes to read now: in the TLS layer's buffer (which select cannot see) or the socket's."""
    pending = getattr(sock, "pending", None)
    return bool(pending is not None and pending()) or bool(select.select((sock,), (), (), 0)[0])
