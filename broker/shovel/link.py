"""One running shovel: open both ends, move messages, settle at the source, reconnect.

Theory of operation
-------------------
A run opens the destination, then the source, and forwards every delivery: the destination
publishes it (``Destination.send``) and, by ``ack-mode``:
- ``on-confirm`` (default): ``send`` returns once the destination confirmed it (a publisher
  confirm, the group commit of this broker, an HTTP 2xx), and only then is the source message
  acked. A kill -9 of either broker or a cut link between them loses nothing: what was not
  acked at the source is delivered again (at-least-once: messages in flight may arrive twice).
- ``on-publish``: the source is acked once the message was handed to the destination.
- ``no-ack``: the source consumes without acknowledgements (fastest; a crash loses what is in
  flight).

**Bounded in flight**: the source holds at most ``src-prefetch-count`` unsettled messages, so
a destination that is slow, blocks its publishers (flow control) or refuses messages for now
(``reject-publish`` overflow: a nack; HTTP 5xx) slows the shovel down: a refused message is sent
again after a back-off (50 ms doubling to ``RETRY_CAP``) and the source is not drained meanwhile.
A message the destination refuses **for good** (an HTTP 4xx other than 408/425/429) is
dead-lettered at the source when the source is a queue of this broker with a dead-letter
exchange; otherwise it goes back to the source after the back-off. Nothing is dropped.

**Reconnect**: when either end breaks (or cannot be opened: unreachable host, wrong
credentials, a missing queue), both are closed (the source gives back its unsettled messages),
the status becomes ``terminated`` with the reason, and the next run starts after
``reconnect-delay`` seconds, doubled after each run that failed within ``STABLE_AFTER`` seconds,
up to 8 times ``reconnect-delay`` (and at most ``MAX_BACKOFF`` unless ``reconnect-delay`` is longer):
never a hot loop. ``reconnect-delay`` 0 means no
reconnect (RabbitMQ's meaning): the shovel stays terminated until restarted.

**src-delete-after**: a count, or ``queue-length`` (the source queue's length when the run
opened it): once that many were settled the shovel is done and the manager deletes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from broker.shovel.definition import ShovelDef
from broker.shovel.ends import Destination, EndLost, Message, Settle, Source, Verdict

log = logging.getLogger(__name__)

RETRY_FIRST = 0.05  # seconds before a refused message is sent again
RETRY_CAP = 5.0  # the longest wait between two attempts at one message
STABLE_AFTER = 30.0  # a run that lasted this long resets the reconnect back-off
MAX_BACKOFF = 60.0  # seconds: the reconnect back-off's ceiling (unless reconnect-delay is longer)
OPEN_TIMEOUT = 60.0  # seconds for both ends to open
DRAIN_TIMEOUT = 5.0  # seconds a stopping shovel waits for its in-flight messages to settle

MakeEnds = Callable[[ShovelDef, bool], tuple[Source, Destination]]


class Link:
    def __init__(self, d: ShovelDef, make_ends: MakeEnds, *, resumed: bool,
                 on_started: Callable[[], None], on_done: Callable[[], None]) -> None:
        self.d = d
        self.make_ends = make_ends
        self.resumed = resumed  # a run before this one consumed: resume where it left off
        self.on_started = on_started
        self.on_done = on_done
        self.state = "starting"
        self.reason = ""
        self.blocked = ""  # why messages are being retried right now
        self.since = time.time()
        self.transferred = 0  # settled as forwarded, over every run
        self.task: asyncio.Task[None] | None = None
        self._broken: asyncio.Future[str | None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._inbox: asyncio.Queue[Message] | None = None
        self._limit: int | None = None
        self._accepted = 0
        self._refused_wait = RETRY_FIRST
        self._stopping = False
        self._generation = 0  # counts runs: a verdict that arrives after its run closed is ignored
        self._pending = 0  # immediate sends waiting for their verdict (the group commit)
        self._idle: asyncio.Event | None = None  # set when _pending drops to 0 during a drain

    # ----------------------------------------------------------------- control
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"shovel {self.d.name}")

    async def stop(self) -> None:
        """Stop taking messages, let those in flight settle (up to ``DRAIN_TIMEOUT``), close."""
        task, self.task = self.task, None
        if task is None:
            return
        self._stopping = True
        if self.state == "running" and self._broken is not None and not self._broken.done():
            self._broken.set_result("stopped")
            try:
                async with asyncio.timeout(DRAIN_TIMEOUT + 5):
                    await asyncio.shield(task)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - cancelled below
                pass
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping, whatever it was doing
                pass

    def _set(self, state: str, reason: str = "") -> None:
        self.state, self.reason, self.since = state, reason, time.time()

    # --------------------------------------------------------------------- runs
    async def _run(self) -> None:
        failures = 0
        while True:
            began = time.monotonic()
            self._set("starting")
            try:
                reason = await self._one_run()
            except Exception as exc:  # noqa: BLE001 - a bug must not end the shovel for good
                log.exception("shovel '%s' in vhost '%s': a run failed", self.d.name, self.d.vhost)
                reason = f"internal error: {type(exc).__name__}: {exc}"
            if self._stopping:
                return
            if reason is None:  # src-delete-after reached
                self.on_done()
                return
            self._set("terminated", reason)
            log.warning("shovel '%s' in vhost '%s' terminated: %s", self.d.name, self.d.vhost, reason)
            if self.d.reconnect_delay == 0:
                return
            failures = 0 if time.monotonic() - began >= STABLE_AFTER else failures + 1
            delay = self.d.reconnect_delay
            await asyncio.sleep(min(delay * 2 ** min(max(failures - 1, 0), 3), max(delay, MAX_BACKOFF)))

    async def _one_run(self) -> str | None:
        """The reason this run ended, None when the shovel is done."""
        d = self.d
        src, dst = self.make_ends(d, self.resumed)
        broken: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._broken = broken
        self._accepted = 0
        serial = dst.concurrency <= 1
        self._inbox = asyncio.Queue() if serial else None
        worker: asyncio.Task[None] | None = None
        try:
            try:
                async with asyncio.timeout(OPEN_TIMEOUT):
                    await dst.open()
                if serial:
                    worker = asyncio.get_running_loop().create_task(self._serial(src, dst))
                async with asyncio.timeout(OPEN_TIMEOUT):
                    await src.open(lambda m: self._on_message(src, dst, m))
            except TimeoutError:
                return "the shovel's ends did not open in time"
            except EndLost as exc:
                return str(exc)
            except Exception as exc:  # noqa: BLE001 - whatever a client library raised: a reason, a retry
                return f"{type(exc).__name__}: {exc}"
            if not self.resumed:
                self.resumed = True
                self.on_started()
            self._limit = d.delete_after if isinstance(d.delete_after, int) else \
                src.length if d.delete_after == "queue-length" else None
            if self._limit is not None and self.transferred >= self._limit:
                return None
            self._set("running")
            waits: list[asyncio.Future[Any]] = [broken, src.lost, dst.lost]
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            result = next(iter(done)).result()
            return None if result is None else str(result)
        finally:
            if self._stopping:  # a clean stop: what the destination took is acked first
                await self._drain()
            self._generation += 1  # verdicts still to come are the old run's: its source requeues them
            for task in [*self._tasks, *([worker] if worker is not None else [])]:
                task.cancel()
            self._tasks.clear()
            await src.close()  # first: it gives back what was not forwarded
            await dst.close()
            self._inbox = None
            self.blocked = ""

    async def _drain(self) -> None:
        """Wait (up to ``DRAIN_TIMEOUT``) for the messages in flight to get their verdicts."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=DRAIN_TIMEOUT)
        while self._pending > 0 and time.monotonic() < deadline:
            self._idle = asyncio.Event()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._idle.wait()
            except TimeoutError:
                break
        self._idle = None

    # ----------------------------------------------------------------- messages
    def _on_message(self, src: Source, dst: Destination, msg: Message) -> None:
        if self._stopping:
            return  # left unsettled: given back when the source closes
        if self._limit is not None and self._accepted >= self._limit:
            return  # past src-delete-after: left unsettled, given back when the source closes
        self._accepted += 1
        self._outgoing(msg)
        if self._inbox is not None:
            self._inbox.put_nowait(msg)
        elif dst.immediate:
            self._send_now(src, dst, msg)
        else:
            self._spawn(src, dst, msg, None)

    def _spawn(self, src: Source, dst: Destination, msg: Message, verdict: Verdict | None) -> None:
        task = asyncio.get_running_loop().create_task(self._forward(src, dst, msg, verdict))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _send_now(self, src: Source, dst: Destination, msg: Message) -> None:
        """A destination that publishes at once (this broker): no task per message; the verdict
        comes now or from the group commit, and only a refusal takes the task path (its back-off)."""
        broken, run = self._broken, self._generation
        self._pending += 1

        def landed(verdict: Verdict) -> None:
            self._pending -= 1
            if not self._pending and self._idle is not None:
                self._idle.set()
            if run != self._generation:
                return  # that run closed its source, which gave the message back
            if verdict is Verdict.OK:
                self._forwarded(src, msg)
            else:
                self._spawn(src, dst, msg, verdict)
        try:
            verdict = dst.send_now(msg, landed)
        except EndLost as exc:
            self._pending -= 1
            if broken is not None and not broken.done():
                broken.set_result(str(exc))
            return
        if verdict is not None:
            landed(verdict)

    def _forwarded(self, src: Source, msg: Message) -> None:
        self.blocked = ""
        self._refused_wait = RETRY_FIRST
        src.settle(msg.tag, Settle.ACK)
        self.transferred += 1
        done = self._limit is not None and self.transferred >= self._limit
        if done and self._broken is not None and not self._broken.done():
            self._broken.set_result(None)

    async def _serial(self, src: Source, dst: Destination) -> None:
        assert self._inbox is not None
        inbox = self._inbox
        while True:
            await self._forward(src, dst, await inbox.get())

    async def _forward(self, src: Source, dst: Destination, msg: Message,
                       verdict: Verdict | None = None) -> None:
        """Send until the destination has it (``verdict``: the answer to a send already made)."""
        wait = RETRY_FIRST
        try:
            while True:
                if verdict is None:
                    verdict = await dst.send(msg)
                if verdict is Verdict.OK:
                    self._forwarded(src, msg)
                    return
                self.blocked = dst.problem
                if verdict is Verdict.RETRY:
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, RETRY_CAP)
                    verdict = None
                    continue
                if src.can_dead_letter:
                    src.settle(msg.tag, Settle.DEAD_LETTER)
                    return
                await asyncio.sleep(self._refused_wait)  # refused for good: back to the source
                self._refused_wait = min(self._refused_wait * 2, RETRY_CAP)
                src.settle(msg.tag, Settle.REQUEUE)
                return
        except EndLost as exc:
            if self._broken is not None and not self._broken.done():
                self._broken.set_result(str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug must not leave the run wedged: it restarts
            log.exception("shovel '%s': forwarding failed", self.d.name)
            if self._broken is not None and not self._broken.done():
                self._broken.set_result(f"internal error: {type(exc).__name__}: {exc}")

    def _outgoing(self, msg: Message) -> None:
        """Address ``msg`` for the destination and add what the definition asks for."""
        d = self.d
        msg.exchange, msg.routing_key = d.destination(msg.exchange, msg.routing_key)
        if not (d.publish_properties or d.forward_headers or d.timestamp_header):
            return
        p = msg.props
        for key, value in d.publish_properties.items():
            setattr(p, key, value)
        if d.forward_headers or d.timestamp_header:
            headers: dict[str, Any] = dict(p.headers or {})
            if d.forward_headers:
                before = headers.get("x-shovelled")
                headers["x-shovelled"] = [self._forward_info(), *(before if isinstance(before, list) else [])]
            if d.timestamp_header:
                headers["x-shovelled-timestamp"] = int(time.time())
            p.headers = headers

    def _forward_info(self) -> dict[str, Any]:
        d = self.d
        info: dict[str, Any] = {"shovel-type": "dynamic", "shovel-name": d.name, "shovel-vhost": d.vhost,
                                "src-uri": d.src_uris[0].redacted(), "dest-uri": d.dest_uris[0].redacted()}
        for key, value in (("src-queue", d.src_queue), ("src-exchange", d.src_exchange),
                           ("dest-queue", d.dest_queue), ("dest-exchange", d.dest_exchange)):
            if value is not None:
                info[key] = value
        return info

    # ------------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """RabbitMQ's ``/api/shovels`` fields for a dynamic shovel, and its transferred count."""
        d = self.d
        out: dict[str, Any] = {
            "name": d.name, "vhost": d.vhost, "type": "dynamic", "state": self.state,
            "timestamp": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.since)),
            "src_protocol": "amqp091", "dest_protocol": "amqp091",
            "src_uri": d.src_uris[0].redacted(), "dest_uri": d.dest_uris[0].redacted(),
            "blocked_status": "blocked" if self.blocked else "running",
            "messages_transferred": self.transferred, "ack_mode": d.ack_mode,
        }
        for key, value in (("src_queue", d.src_queue), ("src_exchange", d.src_exchange),
                           ("dest_queue", d.dest_queue), ("dest_exchange", d.dest_exchange)):
            if value is not None:
                out[key] = value
        if d.src_exchange is not None:
            out["src_exchange_key"] = d.src_exchange_key
        if d.dest_exchange_key is not None:
            out["dest_exchange_key"] = d.dest_exchange_key
        if self.reason:
            out["reason"] = self.reason
        if self.blocked:
            out["blocked_reason"] = self.blocked
        return out

