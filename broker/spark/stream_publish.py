"""The sink's exactly-once path to a stream: a stream-protocol publisher with deduplication.

Theory of operation
-------------------
RabbitMQ's stream protocol deduplicates by publisher: a publisher declared with a *reference*
(a name) has a sequence, the highest publishing id the stream stored for it, and a message whose
id is not above it is confirmed without being stored again. Skred keeps that sequence in order
with the log (``broker/store/sequences.py``), so it survives restart, kill -9 and failover. The
sink uses it for ``exactlyOnce`` rows whose target is a stream: the reference is
``<query id>.<task partition>`` and the publishing id ``batch id << 32 | row number``, both the
same when Spark re-runs a task or a micro-batch, and increasing from one batch to the next. So
a retried task's rows that were stored are confirmed and dropped, the rest stored, once.

The publisher is a small client of the protocol (PeerProperties, PLAIN SaslHandshake and
SaslAuthenticate, Tune, Open, DeclarePublisher, Publish version 1, PublishConfirm and
PublishError). Rows are framed a *piece* at a time, a quarter of the confirm window (as many
Publish frames as ``frame_max`` needs, built from the task's Arrow batch without Python code per
row: ``arrow_frames.py``), and each piece is written with one call while fewer than ``window``
rows await their confirm, so up to four pieces are in flight and the next is framed while the
broker confirms the oldest; the task ends once every id is confirmed. A PublishError, a Close, a lost
connection or ``confirm_timeout`` without progress raises, which fails the task (Spark retries
it). A row's value becomes the message body as sent (stream clients read it as is; AMQP
consumers get it as the body); per-row ``headers`` cannot ride on this path and are refused.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Final
from urllib.parse import unquote, urlparse

from broker.spark.arrow_frames import RowTooLarge, publish_frames
from broker.streamwire import (
    CLOSE,
    DECLARE_PUBLISHER,
    HEARTBEAT,
    OK,
    OPEN,
    PEER_PROPERTIES,
    PUBLISH_CONFIRM,
    PUBLISH_ERROR,
    RESPONSE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    STREAM_DOES_NOT_EXIST,
    TUNE,
)

_HEAD: Final = struct.Struct(">IHH")  # size, key, version
_PUB_HEAD: Final = struct.Struct(">Bi")  # publisher id, count
_CORR_CODE: Final = struct.Struct(">IH")
MAX_FRAME: Final = 1 << 20  # what we ask for in Tune (the broker may lower it)
MAX_INCOMING: Final = 8 << 20  # the largest frame we read from the broker


class StreamSinkError(RuntimeError):
    """The broker refused or did not confirm rows: the task fails."""


class NoSuchStream(StreamSinkError):
    """The target is not a stream."""


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">H", len(raw)) + raw


def _frame(key: int, body: bytes) -> bytes:
    return _HEAD.pack(len(body) + 4, key, 1) + body


def publishing_id(batch_id: int, row: int) -> int:
    """A row's id: the batch in the high 32 bits, so ids keep rising from batch to batch."""
    return (batch_id << 32) | row


class StreamPublisher:
    """One connection, one deduplicating publisher on one stream."""

    def __init__(self, uri: str, port: int, vhost: str | None, stream: str, reference: str,
                 window: int, timeout: float) -> None:
        u = urlparse(uri)
        self.host = u.hostname or "127.0.0.1"
        self.port = port
        self.user = unquote(u.username or "guest")
        self.password = unquote(u.password or "guest")
        self.vhost = vhost or (unquote(u.path[1:]) if len(u.path) > 1 else "/")
        self.stream = stream
        self.reference = reference
        self.window = window
        self.timeout = timeout
        self.frame_max = MAX_FRAME
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._corr = 0
        self._pending: list[tuple[int, bytes]] = []  # framed at the next flush
        self._unconfirmed: set[int] = set()
        self._progress = asyncio.Event()
        self._error: BaseException | None = None
        self._answers: dict[int, asyncio.Future[bytes]] = {}
        self._tune: asyncio.Future[tuple[int, int]] | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ connection
    async def open(self) -> None:
        async with asyncio.timeout(self.timeout):
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._tune = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop())
        props = {"connection_name": f"skred-spark-sink {self.reference}", "product": "skred-spark"}
        body = struct.pack(">i", len(props)) + b"".join(_s(k) + _s(v) for k, v in props.items())
        await self._request(PEER_PROPERTIES, body)
        await self._request(SASL_HANDSHAKE, b"")
        creds = f"\0{self.user}\0{self.password}".encode()
        await self._request(SASL_AUTHENTICATE, _s("PLAIN") + struct.pack(">i", len(creds)) + creds)
        async with asyncio.timeout(self.timeout):
            frame_max, heartbeat = await self._tune
        self.frame_max = min(frame_max, MAX_FRAME) if frame_max else MAX_FRAME
        self._send(_frame(TUNE, struct.pack(">II", self.frame_max, heartbeat)))
        await self._request(OPEN, _s(self.vhost))
        code = await self._request(DECLARE_PUBLISHER, bytes([1]) + _s(self.reference) + _s(self.stream),
                                   check=False)
        if code == STREAM_DOES_NOT_EXIST:
            raise NoSuchStream(f"no stream '{self.stream}' in vhost '{self.vhost}'")
        if code != OK:
            raise StreamSinkError(f"skred sink: declaring the publisher on '{self.stream}' failed "
                                  f"(code {code})")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass

    def _send(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.write(data)

    async def _request(self, key: int, body: bytes, check: bool = True) -> int:
        self._corr += 1
        corr = self._corr
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._answers[corr] = answer
        self._send(_frame(key, struct.pack(">I", corr) + body))
        async with asyncio.timeout(self.timeout):
            payload = await answer
        code = _CORR_CODE.unpack_from(payload, 0)[1]
        if check and code != OK:
            raise StreamSinkError(f"skred sink: stream protocol command {key} refused (code {code})")
        return int(code)

    async def _read_loop(self) -> None:
        reader = self._reader
        assert reader is not None
        try:
            while True:
                (size,) = struct.unpack(">I", await reader.readexactly(4))
                if not 4 <= size <= MAX_INCOMING:
                    raise StreamSinkError(f"skred sink: bad frame size {size} from the broker")
                frame = await reader.readexactly(size)
                key, _version = struct.unpack_from(">HH", frame)
                self._on_frame(key, memoryview(frame)[4:])
        except (OSError, asyncio.IncompleteReadError, StreamSinkError) as exc:
            self._fail(exc if isinstance(exc, StreamSinkError) else
                       StreamSinkError(f"skred sink: stream connection lost: {exc!r}"))

    def _on_frame(self, key: int, body: memoryview) -> None:
        if key & RESPONSE:
            corr = struct.unpack_from(">I", body, 0)[0]
            answer = self._answers.pop(corr, None)
            if answer is not None and not answer.done():
                answer.set_result(bytes(body))
        elif key == PUBLISH_CONFIRM:
            _pub, n = _PUB_HEAD.unpack_from(body, 0)
            self._unconfirmed.difference_update(struct.unpack_from(f">{n}Q", body, 5))
            self._progress.set()
        elif key == PUBLISH_ERROR:
            _pub, n = _PUB_HEAD.unpack_from(body, 0)
            first_id, code = struct.unpack_from(">QH", body, 5)
            self._fail(StreamSinkError(f"skred sink: {n} row(s) refused by '{self.stream}' "
                                       f"(first id {first_id}, code {code})"))
        elif key == TUNE:
            if self._tune is not None and not self._tune.done():
                self._tune.set_result(struct.unpack_from(">II", body, 0))
        elif key == CLOSE:
            corr, code = _CORR_CODE.unpack_from(body, 0)
            self._send(_frame(CLOSE | RESPONSE, _CORR_CODE.pack(corr, OK)))
            self._fail(StreamSinkError(f"skred sink: the broker closed the stream connection (code {code})"))
        elif key == HEARTBEAT:
            self._send(_HEAD.pack(4, HEARTBEAT, 1))

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(exc)
        self._answers.clear()
        if self._tune is not None and not self._tune.done():
            self._tune.set_exception(exc)
        self._progress.set()

    # ------------------------------------------------------------------ publishing
    @property
    def piece(self) -> int:
        """Rows framed and written at once: a quarter of the window, so up to four pieces are
        in flight while the broker confirms the oldest."""
        return max(self.window // 4, 1)

    async def add(self, pid: int, body: bytes) -> None:
        """Queue one row (the per-row path: rows whose target varies); a piece's worth is
        framed and written at once."""
        self._pending.append((pid, body))
        if len(self._pending) >= self.piece:
            await self._flush()

    async def add_batch(self, first_id: int, values: Any) -> None:
        """An Arrow batch's values, the i-th with publishing id ``first_id + i``: framed a piece
        at a time straight from the batch (``arrow_frames``), each written while fewer than
        ``window`` rows await their confirm."""
        import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]

        await self._flush()
        for lo in range(0, len(values), self.piece):
            part = values.slice(lo, self.piece)
            await self._write(np.arange(first_id + lo, first_id + lo + len(part), dtype=np.uint64), part)

    async def finish(self) -> None:
        """Write what is queued and wait until every row is confirmed."""
        await self._flush()
        await self._room(0)

    async def _flush(self) -> None:
        if self._pending:
            import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]
            import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]

            rows, self._pending = self._pending, []
            ids = np.fromiter((pid for pid, _ in rows), dtype=np.uint64, count=len(rows))
            await self._write(ids, pa.array([body for _, body in rows], pa.binary()))

    async def _write(self, ids: Any, values: Any) -> None:
        """Frame ``values`` with publishing ids ``ids`` and write them in one call once there
        is room in the window for them."""
        try:
            frames = publish_frames(1, ids, values, self.frame_max)
        except RowTooLarge as exc:
            raise StreamSinkError(str(exc)) from None
        await self._room(self.window - len(ids))
        assert self._writer is not None
        self._writer.writelines(frames)
        self._unconfirmed.update(ids.tolist())

    async def _room(self, at_most: int) -> None:
        """Wait until at most ``at_most`` rows await their confirm (raising on an error or on
        ``timeout`` seconds without a confirm)."""
        while True:
            if self._error is not None:
                raise self._error
            if len(self._unconfirmed) <= max(at_most, 0):
                return
            self._progress.clear()
            try:
                async with asyncio.timeout(self.timeout):
                    await self._progress.wait()
            except TimeoutError:
                raise StreamSinkError(f"skred sink: {len(self._unconfirmed)} row(s) to '{self.stream}' "
                                      f"not confirmed within {self.timeout:g}s") from None
