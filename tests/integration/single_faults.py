"""Single-node fault trials for ``test_single_chaos.py`` and ``benchmarks/chaos.py`` (not a test module).

Theory of operation: every trial runs against one real broker process (``SkredProcess``, or
``NamespacedBroker`` on a small tmpfs for the full disk), which it kills with SIGKILL and
starts again on the same data dir. The clients are pika connections in threads.

- ``live``: a confirmed publisher and an acking consumer (one ack per message) run on one
  queue; kill -9 at a random moment. *Lost*: confirmed, never acked, not back. *Resurrected*:
  acked at least ``ack_sync_interval`` + a margin before the kill, and back (younger acks may
  come back: that is the window). *Missing redelivered*: delivered before the kill, back
  without the flag.
- ``settled``: confirmed messages acked one by one, rejected, nacked (requeue false) and
  purged, plus some delivered and held unacked; the window passes; kill -9.
- ``settled, synchronous``: the same with ``ack_sync_interval = 0`` and no wait at all.
- ``full disk``: confirmed publishing (runs of pipelined publishes, two queues by fanout)
  until the disk is full, kill -9, space freed, restart. *Lost* as above; *wrong*: a nacked
  message that was stored, or a duplicate.
- ``fuzz frames`` / ``fuzz properties``: a bounded number of malformed inputs (the
  generators of ``test_chaos_fuzz.py``), counting broker deaths, tracebacks in its log and
  answers with a reply code the spec does not give for the input.

A ``Trial`` holds the counts; ``benchmarks/chaos.py`` tables them next to the cluster's.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from hypothesis import HealthCheck, given, settings
from pamqp import commands

from ._raw import NoAnswer, RawConn, frame_bytes, header_payload, method_bytes
from ._support import SkredProcess, connect, unique

WINDOW = 1.0  # the default ack_sync_interval (seconds)
MARGIN = 0.5  # an ack this much older than the window must not come back (client-side clock)
N_SETTLE = 200  # messages per settlement kind in a ``settled`` trial


@dataclass
class Trial:
    fault: str
    confirmed: int = 0
    lost: int = 0
    settled: int = 0  # settlements older than the window (must stay settled)
    resurrected: int = 0
    recent_back: int = 0  # settled inside the window, back after the kill (allowed)
    delivered: int = 0
    missing_redelivered: int = 0
    inputs: int = 0  # fuzz inputs sent
    deaths: int = 0
    tracebacks: int = 0
    wrong: int = 0  # wrong reply codes (fuzz), nacked-but-stored or duplicated messages (disk)
    notes: list[str] = field(default_factory=list)


def drain(b: SkredProcess, queue: str, **kw: Any) -> list[tuple[int, bool]]:
    """(id, redelivered) of everything in ``queue``, consumed with autoack (``kw``: connection
    parameters, e.g. ``virtual_host``)."""
    conn = connect(b, **kw)
    ch = conn.channel()
    got: list[tuple[int, bool]] = []
    for _ in range(1_000_000):
        m, _, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            break
        got.append((int.from_bytes(body[:8], "big"), bool(m.redelivered)))
    conn.close()
    return got


def _msg(i: int, size: int = 64) -> bytes:
    return i.to_bytes(8, "big") + b"m" * max(0, size - 8)


PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _restart_after_kill(b: SkredProcess, trial: Trial) -> None:
    if not b.alive():
        trial.deaths += 1
        trial.notes.append("broker died before the kill")
    b.kill9()
    b.start()


# ------------------------------------------------------------------ live traffic

class _Publisher(threading.Thread):
    def __init__(self, b: SkredProcess, queue: str) -> None:
        super().__init__(daemon=True)
        self.b, self.queue = b, queue
        self.confirmed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            conn = connect(self.b)
            ch = conn.channel()
            ch.confirm_delivery()
            i = 0
            while not self.stop.is_set() and i < 1_000_000:
                ch.basic_publish("", self.queue, _msg(i), PERSISTENT)
                self.confirmed.append(i)
                i += 1
        except (pika.exceptions.AMQPError, OSError):
            pass  # the kill


class _Acker(threading.Thread):
    def __init__(self, b: SkredProcess, queue: str) -> None:
        super().__init__(daemon=True)
        self.b, self.queue = b, queue
        self.acked: list[tuple[int, float]] = []
        self.delivered: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            conn = connect(self.b)
            ch = conn.channel()
            ch.basic_qos(prefetch_count=50)
            for m, _p, body in ch.consume(self.queue, inactivity_timeout=0.2):
                if self.stop.is_set():
                    break
                if m is None:
                    continue
                n = int.from_bytes(body[:8], "big")
                self.delivered.append(n)
                ch.basic_ack(m.delivery_tag)
                self.acked.append((n, time.monotonic()))
        except (pika.exceptions.AMQPError, OSError):
            pass  # the kill


def trial_live(b: SkredProcess, rng: random.Random) -> Trial:
    trial = Trial("live")
    q = unique("live")
    conn = connect(b)
    conn.channel().queue_declare(q, durable=True)
    conn.close()
    pub, acker = _Publisher(b, q), _Acker(b, q)
    pub.start()
    acker.start()
    killed_at = fault_moment(acker.acked, rng)
    b.kill9()
    pub.stop.set()
    acker.stop.set()
    pub.join(10)
    acker.join(10)
    b.start()
    score(trial, set(pub.confirmed), acker.acked, acker.delivered, drain(b, q), killed_at)
    trial.confirmed = len(pub.confirmed)
    return trial


def fault_moment(acked: list[tuple[int, float]], rng: random.Random) -> float:
    """Wait (bounded) for traffic under way, then for a random moment past one sync window:
    the moment of the fault."""
    deadline = time.monotonic() + 30
    while len(acked) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)  # progress poll (bounded): traffic under way before the fault
    time.sleep(rng.uniform(WINDOW + MARGIN, 3.0))  # the fault's moment: random, past one window
    return time.monotonic()


def score(trial: Trial, confirmed: set[int], acked: list[tuple[int, float]], delivered: list[int],
          got: list[tuple[int, bool]], killed_at: float) -> None:
    """A live trial's outcome: what was confirmed, acked (when) and delivered before the fault,
    against what the queue holds after it (``got``: id, redelivered)."""
    back = {n for n, _ in got}
    acked_ids = {n for n, _ in acked}
    old = {n for n, t in acked if t < killed_at - WINDOW - MARGIN}
    trial.lost = len(confirmed - acked_ids - back)
    trial.settled = len(old)
    trial.resurrected = len(old & back)
    trial.recent_back = len((acked_ids - old) & back)
    seen = set(delivered)
    trial.delivered = len(seen)
    trial.missing_redelivered = len({n for n, r in got if not r} & seen)


# ------------------------------------------------------------------ settlements

def trial_settled(b: SkredProcess, rng: random.Random, synchronous: bool = False) -> Trial:
    """Acks, rejects, nacks, purges and held deliveries, then kill -9: after the window, or
    at once when the broker runs with ``ack_sync_interval = 0`` (``synchronous``)."""
    trial = Trial("settled, synchronous" if synchronous else "settled")
    names = {k: unique(k) for k in ("ack", "reject", "nack", "purge", "held")}
    conn = connect(b)
    pub = conn.channel()
    pub.confirm_delivery()
    n = 0
    for q in names.values():
        pub.queue_declare(q, durable=True)
        for _ in range(N_SETTLE):
            pub.basic_publish("", q, _msg(n), PERSISTENT)
            n += 1
    trial.confirmed = n
    settle: dict[str, Callable[[pika.adapters.blocking_connection.BlockingChannel, int], None]] = {
        "ack": lambda c, t: c.basic_ack(t),
        "reject": lambda c, t: c.basic_reject(t, requeue=False),
        "nack": lambda c, t: c.basic_nack(t, requeue=False),
    }
    order = list(settle)
    rng.shuffle(order)
    for kind in order:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=N_SETTLE)
        tags = []
        for m, _p, _b in ch.consume(names[kind], inactivity_timeout=5):
            if m is None:
                break
            tags.append(m.delivery_tag)
            if len(tags) == N_SETTLE:
                break
        for t in tags:
            settle[kind](ch, t)
        ch.close()  # a round trip: every settlement before it was processed
    pub.queue_purge(names["purge"])
    holder = conn.channel()
    holder.basic_qos(prefetch_count=N_SETTLE)
    held: list[int] = []
    for m, _p, body in holder.consume(names["held"], inactivity_timeout=5):
        if m is None:
            break
        held.append(int.from_bytes(body[:8], "big"))
        if len(held) == N_SETTLE:
            break
    pub.queue_declare(names["held"], passive=True)  # a round trip after the deliveries
    if not synchronous:
        time.sleep(WINDOW + MARGIN)  # the window passes: the property under test
    _restart_after_kill(b, trial)
    trial.settled = 4 * N_SETTLE
    trial.resurrected = sum(len(drain(b, names[k])) for k in ("ack", "reject", "nack", "purge"))
    got = drain(b, names["held"])
    trial.delivered = len(held)
    trial.missing_redelivered = len({i for i, r in got if not r} & set(held))
    trial.lost = len(set(held) - {i for i, _ in got})
    return trial


# ------------------------------------------------------------------ full disk

def confirm_pipelined(b: SkredProcess, exchange: str, size: int, batch: Callable[[], int],
                      max_batches: int = 2000) -> tuple[set[int], set[int], str | None]:
    """Confirmed persistent publishes of ``size`` bytes (8-byte id first) to ``exchange``,
    sent in batches of ``batch()`` in one write each (so the broker takes them as runs),
    every one answered before the next batch, until the first nack. Returns (acked ids,
    nacked ids, what went wrong or None)."""
    acked: set[int] = set()
    nacked: set[int] = set()
    props = header_payload(0, commands.Basic.Properties(delivery_mode=2))[12:]
    try:
        with RawConn(b.host, b.port, timeout=10) as c:
            c.handshake()
            c.open_channel(1)
            c.send_method(1, commands.Confirm.Select())
            c.expect(commands.Confirm.SelectOk, 1)
            publish = method_bytes(1, commands.Basic.Publish(exchange=exchange, routing_key=""))
            header = frame_bytes(2, 1, struct.pack(">HHQ", 60, 0, size) + props)
            seq = 0
            for _ in range(max_batches):
                out = []
                for _ in range(batch()):
                    seq += 1
                    out.append(publish + header + frame_bytes(3, 1, _msg(seq, size)))
                c.send(b"".join(out))
                answered = max(acked | nacked, default=0)
                while answered < seq:  # every publish answered, ack or nack (multiple or not)
                    kind, m = c.next_answer(timeout=30)
                    if kind not in ("ack", "nack"):
                        return acked, nacked, f"publisher got {kind} on a full disk"
                    tags = range(answered + 1, m.delivery_tag + 1) if m.multiple else [m.delivery_tag]
                    (acked if kind == "ack" else nacked).update(tags)
                    answered = max(answered, m.delivery_tag)
                if nacked:
                    break
    except (NoAnswer, OSError) as exc:
        return acked, nacked, f"publisher: {type(exc).__name__}"
    return acked, nacked, None


def delayed_to_queue(ch: pika.adapters.blocking_connection.BlockingChannel, exchange: str,
                     queue: str) -> None:
    """A durable delayed-message exchange (direct underneath) routing key ``k`` to a durable queue."""
    ch.exchange_declare(exchange, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, routing_key="k")


def fanout_pair(b: SkredProcess) -> tuple[str, str, str]:
    """A durable fanout exchange and the two durable queues bound to it: (ex, qa, qb)."""
    ex, qa, qb = unique("fan"), unique("qa"), unique("qb")
    conn = connect(b)
    ch = conn.channel()
    ch.exchange_declare(ex, "fanout", durable=True)
    for q in (qa, qb):
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, ex)
    conn.close()
    return ex, qa, qb


def trial_full_disk(b: SkredProcess, rng: random.Random, mnt: Path,
                    run_inside: Callable[..., object]) -> Trial:
    """Pipelined confirmed publishes (fanout to two queues) until nacks, on a disk another
    process filled to a random few MiB; kill -9, free the space, restart."""
    trial = Trial("full disk")
    ex, qa, qb = fanout_pair(b)
    run_inside("dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64K")
    run_inside("truncate", "-s", f"-{rng.randint(1, 4)}M", f"{mnt}/filler")
    size = rng.choice([200, 3000, 9000])
    acked, nacked, note = confirm_pipelined(b, ex, size, lambda: rng.randint(20, 200))
    if note:
        trial.notes.append(note)
    if not nacked and not trial.notes:
        trial.notes.append("the disk never filled")
    trial.confirmed = len(acked)
    if not b.alive():
        trial.deaths += 1
    b.kill9()
    run_inside("rm", "-f", f"{mnt}/filler")
    b.start()
    for q in (qa, qb):
        got = [i for i, _ in drain(b, q)]
        stored = set(got)
        trial.lost += len(acked - stored)
        trial.wrong += len(stored & nacked) + len(got) - len(stored)
    conn = connect(b)
    for q in (qa, qb):
        conn.channel().queue_delete(q)
    conn.channel().exchange_delete(ex)
    conn.close()
    trial.tracebacks = b.log_text().count("Traceback")
    return trial


# ------------------------------------------------------------------ fuzz

def trial_fuzz(b: SkredProcess, rng: random.Random, what: str, examples: int = 25) -> Trial:
    """``examples`` malformed frames or property lists (``test_chaos_fuzz``'s generators)."""
    from .test_chaos_fuzz import _bad_frame, _clients_decode, _mutated_props

    trial = Trial(f"fuzz {what}")
    queue = unique("fuzz")
    conn = connect(b)
    conn.channel().queue_declare(queue)
    conn.close()
    before = b.log_text().count("Traceback")
    fuzz_settings = settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                             suppress_health_check=list(HealthCheck))

    def one(send: bytes, allowed: tuple[int, ...], may_ack: bool) -> None:
        trial.inputs += 1
        try:
            with RawConn(b.host, b.port, timeout=5) as c:
                c.handshake()
                c.open_channel(1)
                if what == "properties":
                    c.send_method(1, commands.Confirm.Select())
                    c.expect(commands.Confirm.SelectOk, 1)
                c.send(send)
                kind, m = c.next_answer()
        except (NoAnswer, OSError, AssertionError) as exc:
            trial.wrong += 1
            trial.notes.append(f"{type(exc).__name__} for {send[:40]!r}")
            return
        if kind == "ack":
            if not may_ack:
                trial.wrong += 1
                trial.notes.append(f"confirmed what clients cannot decode: {send[:40]!r}")
        elif kind not in ("connection.close", "channel.close") or m.reply_code not in allowed:
            trial.wrong += 1
            trial.notes.append(f"{kind} {getattr(m, 'reply_code', None)} for {send[:40]!r}")
        if not b.alive():
            trial.deaths += 1
            b.start()

    if what == "frames":
        @fuzz_settings
        @given(case=_bad_frame())
        def run(case: tuple[str, bytes, tuple[int, ...]]) -> None:
            one(case[1], case[2], False)
    else:
        @fuzz_settings
        @given(props=_mutated_props())
        def run(props: bytes) -> None:
            data = (method_bytes(1, commands.Basic.Publish(exchange="", routing_key=queue))
                    + frame_bytes(2, 1, struct.pack(">HHQ", 60, 0, 4) + props) + frame_bytes(3, 1, b"body"))
            one(data, (501,) if len(props) < 2 else (502,), _clients_decode(props))

    run()
    trial.tracebacks = b.log_text().count("Traceback") - before
    if not b.alive():
        trial.deaths += 1
        b.start()
    conn = connect(b)
    conn.channel().queue_delete(queue)
    conn.close()
    return trial
