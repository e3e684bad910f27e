"""Sans-IO AMQP 0-9-1 server connection: bytes in, hook calls, bytes out.

Theory of operation
-------------------
``receive_data(data)`` parses every complete frame in ``data`` (plus what was
left over from the previous call) and ``out`` collects every byte the server
wants to send, so the network layer writes once per read batch. No asyncio,
no sockets: the network layer owns timers and the transport.

Connection negotiation (protocol header -> start/start-ok -> tune/tune-ok ->
open) is driven by ``_CONNECTION_TABLE``: for each state, the methods that
may arrive and the handler that takes them. Anything else on channel 0 is a
hard error. Once open, channel methods go to hooks the broker session
implements (``handle_method``, ``handle_publish``, ``handle_ack``).

Errors: a hook raises an ``AMQPError``. Soft errors close the channel
(channel.close; the channel discards everything until the client's
close-ok), hard errors close the connection (connection.close; everything
but close/close-ok is discarded, then ``want_close`` tells the network layer
to drop the socket). Malformed input never escapes as another exception:
struct errors become 502, unknown methods 540, bad framing 501, content out
of order 505.

Content assembly: basic.publish is followed by a header frame and body
frames on the same channel (other channels may interleave). A body that
fits one frame is passed on as the very bytes object sliced from the read
buffer; larger bodies are joined once.

Turns (``turn_budget``): a read may hold hundreds of methods that each do real
work (a burst of ``queue.delete``s: files closed, a directory renamed), and
the loop reads no other socket until ``receive_data`` returns. With a budget
set (the network layer sets one), once a read's non-publish methods have taken
longer than it, ``receive_data`` stops after the method it just handled, keeps
the rest as the next call's leftover and sets ``yielded``: the network layer
stops reading, gives the loop a turn and calls ``receive_data(b"")`` to go on.
Order is kept (the leftover goes before any later bytes), and publishes and
acks, whose runs are bounded by their own fairness, do not look at the clock.
None (sans-IO callers and tests) handles every read to its end, as before.
"""

from __future__ import annotations

import enum
import functools
import struct
import time
from typing import Any

from pamqp import commands, frame
from pamqp.base import Frame as PFrame

from broker import errors, properties
from broker.amqp import codec

_PUBLISH = codec.PUBLISH
_ACK = codec.ACK
_FRAME_HDR = codec.FRAME_HDR
_METHOD_ID = codec.METHOD_ID
_U64 = codec.U64
_ACK_FRAME_SIZE = 21  # a basic.ack frame: header 7, method id 4, delivery tag 8, bits 1, frame end 1
_ACK_HEAD = struct.Struct(">BHII").pack  # its first 11 bytes: type 1, channel, size 13, method id


@functools.lru_cache(maxsize=2048)
def _ack_head(channel: int) -> bytes:
    return _ACK_HEAD(1, channel, 13, _ACK)


_HEADER_PREFIX = codec.HEADER_PREFIX
_HEADER_FRAME = struct.Struct(">BHIHHQ")  # frame type, channel, size + class, weight, body size
_HEADER_START = struct.Struct(">BH").pack  # frame type, channel
_HEADER_REST = struct.Struct(">IIQ")  # a header frame's size, class + weight, body size
_HEADER_TAIL = struct.Struct(">II")  # frame end, frame type + channel of the next frame; its size
_BASIC_CLASS_WEIGHT = 60 << 16
# Bodies below this are sliced out of the read buffer and may join a publish run; larger
# ones stay views of it (the store writes those with pwritev: segment.PWRITE_MIN).
_SMALL_BODY = 16 * 1024
_props_valid = properties.valid
_CHANNEL_CLOSE = 0x00140028
_CHANNEL_CLOSE_OK = 0x00140029
# access.request (class 30, AMQP 0-8, dropped in 0-9-1 but still sent by old clients): RabbitMQ
# answers access.request-ok with ticket 1, so does Skred. pamqp has no class 30, hence raw bytes.
_ACCESS_REQUEST = 0x001E000A
_OPEN_OK = struct.Struct(">BHIIIB")  # channel.open-ok frame: type, channel, size, ids, channel-id, end
_ACCESS_REQUEST_OK = b"\x00\x00\x00\x06\x00\x1e\x00\x0b\x00\x01\xce"  # size, 30/11, ticket 1, end


class State(enum.Enum):
    HEADER = "awaiting protocol header"
    START_OK = "awaiting connection.start-ok"
    TUNE_OK = "awaiting connection.tune-ok"
    OPEN_WAIT = "awaiting connection.open"
    OPEN = "open"
    CLOSING = "closing"  # we sent connection.close, waiting for close-ok
    CLOSED = "closed"
    # connection.open named a vhost another worker of this node owns (broker/shards): nothing
    # more is parsed here; the network layer hands the socket and ``handed_state`` to the owner
    HANDOVER = "handed over"


# Channel states.
CH_OPEN = 1
CH_CLOSING = 2  # we sent channel.close; drop frames until close-ok


class PublishArgs:
    """basic.publish's arguments, decoded once per distinct encoding and then reused.

    A connection keeps the ones it has seen by their wire bytes, so a stream of
    publishes to the same exchange and routing key decodes nothing: the same
    ``str`` objects (hashes cached) and encoded forms come back every time.
    """

    __slots__ = ("exchange", "routing_key", "mandatory", "exchange_b", "routing_key_b", "exrk")

    def __init__(self, exchange: str, routing_key: str, mandatory: bool) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.exchange_b = exchange.encode()
        self.routing_key_b = routing_key.encode()
        # the two short strings as basic.deliver and the store carry them
        self.exrk = codec.shortstr(self.exchange_b) + codec.shortstr(self.routing_key_b)


# Distinct (exchange, routing key, flags) encodings kept per connection, bounded in count and in
# bytes. A client that publishes to many queues through the default exchange (one routing key per
# queue, in turn) must find them all here: a cache smaller than its set of keys and cleared when
# full misses on every publish of such a cycle. Each entry is charged its encoding three times
# (the encoding, the decoded strings, their encoded short strings) plus the objects around them.
_PUBLISH_ARGS_CACHE = 2048
_PUBLISH_ARGS_BYTES = 512 * 1024
_PUBLISH_ARGS_ENTRY = 256  # bytes charged per entry besides 3 x its encoding


class PendingContent:
    """A publish waiting for its header and body frames."""

    __slots__ = ("args", "props", "size", "chunks", "got")

    def __init__(self, args: PublishArgs) -> None:
        self.args = args
        self.props: bytes | None = None
        self.size = 0
        self.chunks: list[bytes] = []
        self.got = 0


class AMQPConnection:
    """The server side of one AMQP connection, without IO."""

    def __init__(
        self,
        *,
        frame_max: int = 131072,
        channel_max: int = 2047,
        heartbeat: int = 60,
        max_message_size: int = 128 * 1024 * 1024,
        max_bytes_in_flight: int = 0,
        server_properties: dict[str, Any] | None = None,
    ) -> None:
        self.out = bytearray()
        self.state = State.HEADER
        self.want_close = False  # the network layer should close the transport after writing out
        self.server_frame_max = frame_max
        self.server_channel_max = channel_max
        self.server_heartbeat = heartbeat
        self.max_message_size = max_message_size
        self.max_bytes_in_flight = max_bytes_in_flight  # body bytes being assembled, all channels
        self.frame_max = codec.FRAME_MIN_SIZE  # until tune-ok
        self.channel_max = channel_max or 65535
        self.vanished = False  # the transport went away while open, with no connection.close
        self.timed_out = False  # the network layer closed it for missed heartbeats (logged there)
        self.heartbeat = 0
        self.client_properties: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.username = ""
        self.mechanisms = "PLAIN AMQPLAIN"  # offered in connection.start (EXTERNAL with a client cert)
        self.vhost = ""
        self.handover_rest = b""  # bytes read past a connection.open that hands the connection over
        # the client's start-ok, kept until its open only: a cluster leader carries a connection
        # for a vhost another node serves there, whose broker checks the same login (handed_login)
        self._start_ok: commands.Connection.StartOk | None = None
        self.channels: dict[int, int] = {}
        self._pending: dict[int, PendingContent] = {}
        self._pub_args: dict[bytes, PublishArgs] = {}
        self._pub_args_bytes = 0  # what the entries of ``_pub_args`` are charged (_publish_args)
        # (method frame + header frame + body frame header, channel, args, props, body size,
        # prefix length, method frame) of the last publish parsed in full (see _publish_run)
        self._repeat: tuple[bytes, int, PublishArgs, bytes, int, int, bytes] | None = None
        self._buf = b""
        self._parts: list[bytes] = []  # reads of one large frame, joined once complete
        self._have = 0
        self._need = 0
        self._server_properties = server_properties or {}
        # The one-pass publish parse and publish runs; off, every publish is assembled frame
        # by frame (PendingContent). Same outcome either way: tests switch it off to compare.
        self.fast_paths = True
        self.turn_budget: float | None = None  # seconds; see "Turns" in the module doc
        self.yielded = False  # the last receive_data stopped early: call it again with b""

    # ------------------------------------------------------------------ hooks
    def authenticate(self, mechanism: str, response: bytes) -> str:
        """Return the user name or raise ConnectionAccessRefused."""
        raise errors.ConnectionAccessRefused("no authenticator")

    def open_vhost(self, vhost: str) -> None:
        """Raise NotAllowed if the user may not use the vhost."""

    def channel_opened(self, channel: int) -> None:
        pass

    def may_open_channel(self) -> None:
        """Raise an AMQPError to refuse a channel.open (a limit of the user's)."""

    def channel_closed(self, channel: int) -> None:
        """Release everything the channel holds (requeue unacked, cancel consumers)."""

    def handle_method(self, channel: int, method: PFrame) -> None:
        raise errors.AMQPNotImplemented(f"{codec.method_name(method)} not implemented")

    def handle_publish(self, channel: int, args: PublishArgs, props: bytes, body: bytes | memoryview) -> None:
        pass

    def handle_publish_run(self, channel: int, args: PublishArgs, props: list[bytes], bodies: list[bytes],
                           same: bool) -> None:
        """Several publishes in a row on one channel with the same exchange, routing key
        and flags, parsed from one read: ``props[i]`` and ``bodies[i]`` (each body in
        one frame, under 16 KiB) are the i-th. ``same``: all properties are equal (the
        very same object) and all bodies are of one length.

        Same effect as ``handle_publish`` for each in turn, errors included: a publish
        that closes the channel or the connection drops the ones after it, as the
        frames behind a channel.close would be dropped. Subclasses may do the run at
        once where the outcome is the same.
        """
        self.publish_each(channel, args, props, bodies)

    def handle_publish_batch(self, channel: int, args: list[PublishArgs], props: list[bytes],
                             bodies: list[bytes]) -> None:
        """Several publishes in a row on one channel to one exchange, each with its own
        routing key and flags (``args[i]``), parsed from one read; otherwise as
        ``handle_publish_run`` (each body in one frame, under 16 KiB; the same effect as
        ``handle_publish`` for each in turn, errors included)."""
        self.publish_each(channel, args, props, bodies)

    def mixes_publishes(self, channel: int) -> bool:
        """Whether ``channel``'s publishes may share a batch with other channels' (its state
        adds nothing per publish that is the channel's own: no confirms, no transaction)."""
        return False

    def handle_publish_mixed(self, channels: list[int], args: list[PublishArgs], props: list[bytes],
                             bodies: list[bytes]) -> None:
        """Publishes in a row to one exchange on channels of their own (``channels[i]``, each
        one that ``mixes_publishes``), parsed from one read: issue 31's many queues, a producer
        with a channel per queue writing to each in turn. Otherwise as ``handle_publish_batch``:
        the same effect as ``handle_publish`` for each in turn, errors included (a publish that
        closes its channel drops the later ones on that channel, not the other channels')."""
        self.publish_each_mixed(channels, args, props, bodies)

    def publish_each_mixed(self, channels: list[int], args: list[PublishArgs], props: list[bytes],
                           bodies: list[bytes], first: int = 0, stop: int | None = None) -> bool:
        """``handle_publish`` for messages ``first`` to ``stop`` (default: all), each on its own
        channel; one on a channel an earlier one closed is dropped, as its frames would have
        been. Stops when the connection closes and returns False then."""
        for i in range(first, len(bodies) if stop is None else stop):
            ch = channels[i]
            if self.channels.get(ch) != CH_OPEN:
                continue
            try:
                self.handle_publish(ch, args[i], props[i], bodies[i])
            except errors.AMQPError as exc:
                self._frame_error(ch, exc)
            if self.state is not State.OPEN:
                return False
        return True

    def publish_each(self, channel: int, args: PublishArgs | list[PublishArgs], props: list[bytes],
                     bodies: list[bytes], first: int = 0, stop: int | None = None) -> bool:
        """``handle_publish`` for messages ``first`` to ``stop`` (default: all), one by one,
        with ``args`` or ``args[i]``; stops at a closing error and returns False then."""
        for i in range(first, len(bodies) if stop is None else stop):
            try:
                self.handle_publish(channel, args[i] if isinstance(args, list) else args, props[i], bodies[i])
            except errors.AMQPError as exc:
                self._frame_error(channel, exc)
            if self.channels.get(channel) != CH_OPEN or self.state is not State.OPEN:
                return False
        return True

    def handle_ack(self, channel: int, delivery_tag: int, multiple: bool) -> None:
        pass

    def handle_ack_run(self, channel: int, tags: list[int]) -> int:
        """Single acks of ``tags`` on ``channel``, in order, as one batch: settles the longest
        prefix of them that ``handle_ack`` would take without an error and returns its length."""
        return 0

    def _ack_run(self, channel: int, tag: int, data: bytes, pos: int, n: int) -> int:
        """Single acks in a row (issue 31: a client that acks each message sends a read's worth of
        21-byte basic.ack frames on one channel). ``tag``'s frame ends at ``pos``; the frames from
        ``pos`` that are single acks on ``channel`` join it and are settled as one batch
        (``handle_ack_run``), which the store takes as one ack of many. What a client sees is
        what acking them one by one gives: if one of them would fail (an unknown or repeated tag),
        the ones before it are settled, it fails as a lone ack does (closing the channel) and
        the frames after it are parsed as usual. Returns the position after the last frame taken."""
        head = _ack_head(channel)
        tags = [tag]
        at = pos
        while n - at >= _ACK_FRAME_SIZE and data.startswith(head, at) and data[at + 19] == 0 \
                and data[at + 20] == 0xCE:
            tags.append(_U64.unpack_from(data, at + 11)[0])
            at += _ACK_FRAME_SIZE
        done = self.handle_ack_run(channel, tags)
        if done == len(tags):
            return at
        # the first tag not taken fails (or is taken) on the ordinary path, in its place
        self.handle_ack(channel, tags[done], False)
        return pos + _ACK_FRAME_SIZE * done

    def connection_closing(self) -> None:
        """Called once when the connection starts closing for any reason."""

    def closed_by_server(self, channel: int, error: errors.AMQPError) -> None:
        """The server is closing ``channel`` (0: the connection) with ``error`` (for the log)."""

    def update_secret(self, secret: bytes, reason: str) -> bool:
        """connection.update-secret: raise an AMQPError to refuse the new secret; True when the
        answer (update-secret-ok, or the close) will be sent later by the subclass."""
        raise errors.NotAllowed("secret update is not supported", 10, 70)

    # ---------------------------------------------------------------- output
    def send_method(self, channel: int, method: PFrame) -> None:
        self.out += codec.encode_method(channel, method)

    def send_heartbeat(self) -> None:
        self.out += codec.HEARTBEAT_FRAME

    def close_channel(self, channel: int, error: errors.AMQPError) -> None:
        """Soft error: close one channel with the error's reply code."""
        if self.channels.get(channel) != CH_OPEN:
            return
        self.channels[channel] = CH_CLOSING
        self._pending.pop(channel, None)
        self.closed_by_server(channel, error)
        self.send_method(
            channel,
            commands.Channel.Close(error.reply_code, error.reply_text, error.class_id, error.method_id),
        )
        self.channel_closed(channel)

    def close_connection(self, error: errors.AMQPError) -> None:
        """Hard error (or shutdown): send connection.close and wait for close-ok."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        if self.state == State.HEADER:
            self.state = State.CLOSED
            self.want_close = True
            return
        self.state = State.CLOSING
        self._pending.clear()
        self.closed_by_server(0, error)
        self.send_method(
            0, commands.Connection.Close(error.reply_code, error.reply_text, error.class_id, error.method_id)
        )
        self._release_all()

    def _release_all(self) -> None:
        for ch in list(self.channels):
            if self.channels.get(ch) == CH_OPEN:
                self.channel_closed(ch)
        self.channels.clear()
        self.connection_closing()

    def connection_lost(self) -> None:
        """The transport is gone: release everything without writing."""
        if self.state != State.CLOSED:
            prev = self.state
            self.state = State.CLOSED
            self.vanished = prev == State.OPEN and not self.timed_out  # gone without connection.close
            if prev != State.CLOSING:
                self._release_all()

    # ----------------------------------------------------------------- input
    def receive_data(self, data: bytes) -> None:
        if self._need:
            # A large frame arrives in many reads: collect them and join once.
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:
                return
            data = b"".join(self._parts)
            self._parts = []
            self._need = 0
        elif self._buf:
            data = self._buf + data
            self._buf = b""
        if self.state == State.HEADER:
            data = self._receive_header(data)
            if not data:
                return
        if self.state == State.CLOSED:
            return
        n = len(data)
        pos = 0
        # RabbitMQ checks a frame's payload, not the whole frame, against frame_max: clients
        # that cut bodies into frame_max-sized pieces send frames 8 bytes over, and work there.
        max_size = self.frame_max
        unpack_hdr = _FRAME_HDR.unpack_from
        unpack_mid = _METHOD_ID.unpack_from
        channel_state = self.channels.get  # both dicts are only ever mutated, never rebound
        pending = self._pending
        repeat = self._repeat
        fast = self.fast_paths
        budget = self.turn_budget
        began = time.perf_counter() if budget is not None else 0.0
        while n - pos >= 7:
            if repeat is not None and data.startswith(repeat[6], pos) \
                    and channel_state(repeat[1]) == CH_OPEN and repeat[1] not in pending:
                # The same basic.publish method frame as the last publish parsed in full:
                # take it and the ones after it that repeat it as one run.
                done = self._publish_run(data, pos, max_size)
                if done:
                    pos = done
                    repeat = self._repeat
                    if self.want_close or self.state is State.CLOSED:  # type: ignore[comparison-overlap]
                        return
                    continue
            ftype, ch, size = unpack_hdr(data, pos)
            end = pos + 7 + size
            if size > max_size:
                self._hard(errors.FrameError(f"frame size {size} exceeds frame_max {self.frame_max}"))
                return
            if end >= n:
                break
            if data[end] != 0xCE:
                self._hard(errors.FrameError("frame end octet missing"))
                return
            start = pos + 7
            pos = end + 1
            try:
                if ftype == 1:
                    if size < 4:
                        raise errors.FrameError("method frame too short")
                    mid = unpack_mid(data, start)[0]
                    if channel_state(ch) == CH_OPEN and ch not in pending:
                        if mid == _PUBLISH:
                            done = self._fast_publish(ch, data, start + 4, end, n, max_size) if fast else 0
                            if done:
                                pos = done
                                repeat = self._repeat
                                if self.want_close or self.state is State.CLOSED:  # type: ignore[comparison-overlap]
                                    return  # a batch of publishes met an error
                            else:
                                self._start_publish(ch, data, start + 4, end)
                            continue
                        if mid == _ACK and size == 13:
                            tag, bits = codec.ACK_ARGS.unpack_from(data, start + 4)
                            if fast and not bits & 1 and n - pos >= _ACK_FRAME_SIZE \
                                    and data.startswith(_ack_head(ch), pos):
                                pos = self._ack_run(ch, tag, data, pos, n)
                                continue
                            self.handle_ack(ch, tag, bool(bits & 1))
                            continue
                    self._method_frame(ch, mid, data[start:end])
                elif ftype == 3:
                    self._body_frame(ch, data, start, end)
                elif ftype == 2:
                    self._header_frame(ch, data, start, end)
                elif ftype == 8:
                    if ch != 0:
                        raise errors.FrameError("heartbeat on a non-zero channel")
                else:
                    raise errors.FrameError(f"unknown frame type {ftype}")
            except errors.AMQPError as exc:
                self._frame_error(ch, exc)
            if self.want_close or self.state is State.CLOSED:  # type: ignore[comparison-overlap]
                if self.state is State.HANDOVER:
                    self.handover_rest = bytes(data[pos:])
                return
            if budget is not None and ftype == 1 and n - pos >= 7 and time.perf_counter() - began > budget:
                self._buf = data[pos:]  # the loop's turn (module doc, "Turns")
                self.yielded = True
                return
        if pos < n:
            rest = data[pos:]
            if len(rest) >= 7:
                need = 8 + _FRAME_HDR.unpack_from(rest, 0)[2]
                if need > 16384:
                    self._parts = [rest]
                    self._have = len(rest)
                    self._need = need
                    return
            self._buf = rest

    def assembling(self) -> int:
        """Body bytes announced by the content headers of publishes not yet complete."""
        if not self._pending:
            return 0
        return sum(p.size for p in self._pending.values())

    def _frame_error(self, ch: int, exc: errors.AMQPError) -> None:
        if exc.soft and ch != 0 and self.state == State.OPEN:
            self.close_channel(ch, exc)
        else:
            # Framing is intact: keep parsing, the CLOSING state drops
            # everything but the close-ok that may follow in this read.
            self._hard(exc)

    def _receive_header(self, data: bytes) -> bytes:
        if len(data) < 8:
            if codec.PROTOCOL_HEADER.startswith(data):
                self._buf = data
                return b""
        elif data[:8] == codec.PROTOCOL_HEADER:
            self.state = State.START_OK
            self.send_method(
                0,
                commands.Connection.Start(
                    version_major=0,
                    version_minor=9,
                    server_properties=self._server_properties,
                    mechanisms=self.mechanisms,
                    locales="en_US",
                ),
            )
            return data[8:]
        # Wrong protocol: answer with the one we speak and close (spec 4.2.2).
        self.out += codec.PROTOCOL_HEADER
        self.state = State.CLOSED
        self.want_close = True
        return b""

    def _hard(self, exc: errors.AMQPError) -> None:
        if not isinstance(exc, errors.HardError):
            # A soft error where the channel cannot be closed (channel 0 or
            # before open) escalates, keeping the reply code.
            exc2 = errors.CommandInvalid(exc.text, exc.class_id, exc.method_id)
            exc2.reply_code = exc.reply_code
            exc = exc2
        self.close_connection(exc)

    # -------------------------------------------------------- method frames
    def _method_frame(self, ch: int, mid: int, payload: bytes) -> None:
        if ch and (self.state == State.CLOSING or self.channels.get(ch) == CH_CLOSING) \
                and mid not in (_CHANNEL_CLOSE, _CHANNEL_CLOSE_OK):
            return  # closing: whatever else arrives is dropped undecoded
        if mid == _ACCESS_REQUEST and ch and self.channels.get(ch) == CH_OPEN:
            self.out += b"\x01" + ch.to_bytes(2, "big") + _ACCESS_REQUEST_OK
            return
        try:
            method = codec.decode_method(payload)
        except KeyError:
            raise errors.AMQPNotImplemented(
                f"unknown method class={mid >> 16} method={mid & 0xFFFF}", mid >> 16, mid & 0xFFFF
            ) from None
        except codec.Truncated as exc:  # as RabbitMQ: arguments cut short are a frame error
            raise errors.FrameError(str(exc), mid >> 16, mid & 0xFFFF) from None
        except ValueError as exc:
            raise errors.AMQPSyntaxError(str(exc), mid >> 16, mid & 0xFFFF) from None
        if ch == 0:
            self._connection_method(method, mid)
            return
        if self.state == State.CLOSING:
            return
        if self.state != State.OPEN:
            raise errors.UnexpectedFrame(f"{method.name} before connection.open", mid >> 16, mid & 0xFFFF)
        chstate = self.channels.get(ch)
        if chstate == CH_CLOSING:
            if isinstance(method, commands.Channel.CloseOk):
                del self.channels[ch]
            elif isinstance(method, commands.Channel.Close):
                self.send_method(ch, commands.Channel.CloseOk())
            return
        if chstate is None and len(self.channels) >= self.channel_max:
            # As RabbitMQ: channel-max bounds how many channels are open (closing ones count
            # until their close-ok), whatever their numbers; any frame on a new channel is
            # refused once the count is reached.
            raise errors.NotAllowed(f"number of channels opened ({len(self.channels)}) has reached "
                                    f"the negotiated channel_max ({self.channel_max})")
        if isinstance(method, commands.Channel.Open):
            if chstate is not None:
                raise errors.ChannelError(f"second channel.open on channel {ch}", 20, 10)
            self.may_open_channel()
            self.channels[ch] = CH_OPEN
            # channel-id is reserved: an empty long string, as RabbitMQ sends (pamqp encodes '0')
            self.out += _OPEN_OK.pack(1, ch, 8, 0x0014000B, 0, codec.FRAME_END)
            self.channel_opened(ch)
            return
        if chstate is None:
            raise errors.ChannelError(f"expected channel.open on channel {ch}", mid >> 16, mid & 0xFFFF)
        if mid >> 16 == 10:  # a connection-class method belongs on channel 0 (RabbitMQ's words)
            raise errors.CommandInvalid("unimplemented method", 10, mid & 0xFFFF)
        if ch in self._pending:  # RabbitMQ names the publish whose content is incomplete
            raise errors.UnexpectedFrame(f"expected content on channel {ch}, got {method.name}", 60, 40)
        if isinstance(method, commands.Channel.Close):
            del self.channels[ch]
            self.channel_closed(ch)
            self.send_method(ch, commands.Channel.CloseOk())
            return
        if isinstance(method, commands.Channel.CloseOk):
            return  # a stray close-ok for a channel we did not close: ignore
        if isinstance(method, commands.Basic.Publish):
            # Reached only when the fast path did not take it (never in practice).
            args = PublishArgs(method.exchange, method.routing_key, method.mandatory)
            self._pending[ch] = PendingContent(args)
            return
        try:
            self.handle_method(ch, method)
        except errors.AMQPError as exc:
            if not exc.class_id:
                exc.class_id, exc.method_id = mid >> 16, mid & 0xFFFF
            raise

    def _connection_method(self, method: PFrame, mid: int) -> None:
        handler = _CONNECTION_TABLE.get(self.state, {}).get(type(method))
        if handler is None:
            if self.state == State.CLOSING:
                return  # discard everything until close-ok
            if isinstance(method, commands.Connection.Close):
                handler = AMQPConnection._on_close
            elif isinstance(method, (commands.Connection.Blocked, commands.Connection.Unblocked)):
                return
            elif mid >> 16 != 10 and self.state == State.OPEN:  # a channel's method on channel 0
                raise errors.ChannelError(f"{method.name} on channel 0", mid >> 16, mid & 0xFFFF)
            else:
                raise errors.CommandInvalid(
                    f"{method.name} not allowed while {self.state.value}", mid >> 16, mid & 0xFFFF
                )
        handler(self, method)

    def _on_start_ok(self, m: commands.Connection.StartOk) -> None:
        self.client_properties = dict(m.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.capabilities = dict(caps) if isinstance(caps, dict) else {}
        response = m.response.encode("latin-1") if isinstance(m.response, str) else bytes(m.response or b"")
        self._start_ok = m
        try:
            self.username = self.authenticate(m.mechanism, response)
        except errors.AMQPError as exc:
            raise errors.ConnectionAccessRefused(exc.text, 0, 0) from None  # as RabbitMQ
        self.state = State.TUNE_OK
        self.send_method(
            0,
            commands.Connection.Tune(
                channel_max=self.server_channel_max,
                frame_max=self.server_frame_max,
                heartbeat=self.server_heartbeat,
            ),
        )

    def _on_tune_ok(self, m: commands.Connection.TuneOk) -> None:
        frame_max = m.frame_max or self.server_frame_max
        problem = (f"frame_max {frame_max} below minimum {codec.FRAME_MIN_SIZE}"
                   if frame_max < codec.FRAME_MIN_SIZE else
                   f"frame_max {frame_max} exceeds the server's {self.server_frame_max}"
                   if frame_max > self.server_frame_max else None)
        if problem is not None:
            # The spec: "the server MUST close the connection without attempting a negotiated
            # close" (above the server's); RabbitMQ does so for both. The log says why.
            self.closed_by_server(0, errors.NotAllowed(problem, 10, 31))
            self._release_all()
            self.state = State.CLOSED
            self.want_close = True
            return
        self.frame_max = frame_max
        # 0 from either side means no limit but the 16-bit channel number's
        self.channel_max = min(m.channel_max or 65535, self.server_channel_max or 65535)
        self.heartbeat = m.heartbeat
        self.state = State.OPEN_WAIT

    def _on_open(self, m: commands.Connection.Open) -> None:
        try:
            self.open_vhost(m.virtual_host)
        except errors.AMQPError as exc:
            raise errors.NotAllowed(exc.text, 10, 40) from None
        if self.state is State.HANDOVER:
            return  # open_vhost asked for a hand-over (Session.open_vhost): the owner answers
        self._start_ok = None
        self.vhost = m.virtual_host
        self.state = State.OPEN
        self.send_method(0, commands.Connection.OpenOk())

    def hand_over(self, vhost: str) -> None:
        """From ``open_vhost``: another worker owns ``vhost``; stop parsing after this frame
        (``want_close`` ends the read loop; the network layer sees HANDOVER and does not close)."""
        self.vhost = vhost
        self.state = State.HANDOVER
        self.want_close = True

    def handed_state(self) -> dict[str, Any]:
        """What the owner needs to continue this connection as if it had accepted it."""
        return {"username": self.username, "vhost": self.vhost, "frame_max": self.frame_max,
                "channel_max": self.channel_max, "heartbeat": self.heartbeat,
                "client_properties": self.client_properties, "capabilities": self.capabilities,
                "rest": self.handover_rest}

    def handed_login(self) -> bytes:
        """The client's start-ok as a frame, for a node that checks the login again (a
        connection handed over before its open-ok; b"" when there is none)."""
        m = self._start_ok
        return frame.marshal(m, 0) if m is not None else b""

    def resume(self, state: dict[str, Any]) -> None:
        """The owner's side of a hand-over: take the negotiated state, answer the
        connection.open the accepting worker parsed, then read on (the caller feeds ``rest``)."""
        self.username = str(state["username"])
        self.frame_max = int(state["frame_max"])
        self.channel_max = int(state["channel_max"])
        self.heartbeat = int(state["heartbeat"])
        self.client_properties = dict(state["client_properties"])
        self.capabilities = dict(state["capabilities"])
        self.state = State.OPEN_WAIT
        try:
            self._on_open(commands.Connection.Open(virtual_host=str(state["vhost"])))
        except errors.AMQPError as exc:
            self._hard(exc)

    def _on_update_secret(self, m: commands.Connection.UpdateSecret) -> None:
        raw = m.new_secret or b""
        secret = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
        try:
            answered_later = self.update_secret(secret, str(m.reason or ""))
        except errors.AMQPError as exc:
            raise errors.NotAllowed(exc.text, 10, 70) from None
        if not answered_later:
            self.send_method(0, commands.Connection.UpdateSecretOk())

    def _on_close(self, m: PFrame) -> None:
        self._release_all_if_open()
        self.send_method(0, commands.Connection.CloseOk())
        self.state = State.CLOSED
        self.want_close = True

    def _release_all_if_open(self) -> None:
        if self.state != State.CLOSING:
            self._release_all()

    def _on_close_while_closing(self, m: PFrame) -> None:
        # Both sides sent close at once: answer theirs, ours needs no more waiting.
        self.send_method(0, commands.Connection.CloseOk())
        self.state = State.CLOSED
        self.want_close = True

    def _on_close_ok(self, m: commands.Connection.CloseOk) -> None:
        self.state = State.CLOSED
        self.want_close = True

    # ------------------------------------------------------------- content
    def _publish_args(self, raw: bytes) -> PublishArgs:
        """Decode basic.publish's arguments (``raw``: from reserved-1 to the bits). With the
        fast paths off (the differential test's reference) nothing is taken from the cache."""
        a = self._pub_args.get(raw) if self.fast_paths else None
        if a is not None:
            return a
        # reserved-1 u16, exchange shortstr, routing-key shortstr, bits
        try:
            pos = 2
            ln = raw[pos]
            exchange = raw[pos + 1 : pos + 1 + ln].decode()
            pos += 1 + ln
            ln = raw[pos]
            routing_key = raw[pos + 1 : pos + 1 + ln].decode()
            pos += 1 + ln
            bits = raw[pos]
        except IndexError:  # arguments cut short: the frame cannot be decoded (501, as RabbitMQ)
            raise errors.FrameError("malformed basic.publish", 60, 40) from None
        except UnicodeDecodeError:
            raise errors.AMQPSyntaxError("malformed basic.publish", 60, 40) from None
        if bits & 2:
            raise errors.AMQPNotImplemented("immediate=true", 60, 40)
        a = PublishArgs(exchange, routing_key, bool(bits & 1))
        cost = 3 * len(raw) + _PUBLISH_ARGS_ENTRY
        if len(self._pub_args) >= _PUBLISH_ARGS_CACHE or self._pub_args_bytes + cost > _PUBLISH_ARGS_BYTES:
            self._pub_args.clear()
            self._pub_args_bytes = 0
        if raw not in self._pub_args:
            self._pub_args_bytes += cost
        self._pub_args[raw] = a
        return a

    def _start_publish(self, ch: int, data: bytes, pos: int, end: int) -> None:
        self._pending[ch] = PendingContent(self._publish_args(data[pos:end]))

    def _publish_run(self, data: bytes, pos: int, max_size: int) -> int:
        """Publishes at ``pos`` that repeat the method frame of the last one parsed in full
        (same channel, exchange, routing key and flags), each with its header and one body
        frame under 16 KiB complete in ``data``: handed over as one run. Returns the
        position after the run, or 0 if not even its first publish qualifies.

        A publish whose header frame and body-frame header also repeat the last one's
        byte for byte costs one ``startswith`` and a body slice; any other is checked
        frame by frame (``_content_at``) and becomes the one the next must repeat.
        """
        exact, ch, args, props, bsize, skip, method = self._repeat  # type: ignore[misc]
        # the method frame and the start of a header frame on the same channel
        method_h = method + _HEADER_START(2, ch)
        mlen = len(method_h)
        unpack_header = _HEADER_REST.unpack_from
        unpack_tail = _HEADER_TAIL.unpack_from
        tail = 0xCE03 << 16 | ch  # a header frame's end octet, then a body frame on ``ch``
        small = min(_SMALL_BODY, self.max_message_size + 1, max_size + 1)  # body sizes taken here
        # ``properties.valid``'s first check inlined: a list with the structure of one seen
        # before (a new message-id and timestamp on every message) passes a masked compare
        layouts = properties.LIST_LAYOUTS.get
        from_bytes = int.from_bytes
        props_l: list[bytes] = []
        bodies: list[bytes] = []
        same = True  # every publish of the run with the first one's properties and body size
        try:  # a frame that ends past the buffer (IndexError, struct.error) ends the run there
            while True:
                if same and data.startswith(exact, pos):
                    b = pos + skip
                    bend = b + bsize
                    if data[bend] != 0xCE:
                        break  # bad: the general path takes it
                    p = props
                elif data.startswith(method_h, pos):
                    # a header frame and one body frame on this channel, complete: the checks
                    # of ``_content_at`` inlined, with empty and large bodies left to the
                    # general path
                    h = pos + mlen
                    hsize, class_weight, bs = unpack_header(data, h)
                    hend = h + 4 + hsize
                    b = hend + 8
                    bend = b + bs
                    if class_weight != _BASIC_CLASS_WEIGHT or not 14 <= hsize <= max_size \
                            or not 0 < bs < small or data[bend] != 0xCE \
                            or unpack_tail(data, hend) != (tail, bs):
                        break
                    p = data[h + 16 : hend]
                    layout = layouts(hsize - 12)
                    if (layout is None or from_bytes(p) & layout[0] != layout[1]) and not _props_valid(p):
                        break  # the general path refuses it
                    if bodies:
                        same = False  # no exact repeats are looked for in this run from now on
                    else:  # the first of the run: what the ones after it may repeat
                        props = p
                        bsize = bend - b
                        skip = b - pos
                        exact = data[pos:b]
                else:
                    break
                props_l.append(p)
                bodies.append(data[b:bend])
                pos = bend + 1
        except (IndexError, struct.error):
            pass
        if not bodies:
            return 0
        self._repeat = (exact, ch, args, props, bsize, skip, method)
        try:
            if len(bodies) == 1:
                self.handle_publish(ch, args, props, bodies[0])
            else:
                self.handle_publish_run(ch, args, props_l, bodies, same)
        except errors.AMQPError as exc:
            self._frame_error(ch, exc)
        return pos

    def _content_at(self, data: bytes, h: int, ch: int, n: int, max_size: int) -> tuple[int, int] | None:
        """(header frame end, body frame end) of a basic content header at ``h`` on ``ch``
        and its body in one frame, both complete in ``data``; (end, end) for an empty
        body. None for anything else (split content, another channel, a bad frame),
        which the general path then handles or reports precisely."""
        if n - h < 21:
            return None
        # header frame: type, channel, size, class, weight, body size in one unpack
        htype, hch, hsize, class_id, _weight, bsize = _HEADER_FRAME.unpack_from(data, h)
        hend: int = h + 7 + hsize
        if htype != 2 or hch != ch or hsize < 14 or hsize > max_size or hend >= n or data[hend] != 0xCE \
                or class_id != 60 or bsize > self.max_message_size:
            return None
        if not bsize:
            return hend, hend
        b = hend + 1
        if n - b < 7:
            return None
        btype, bch, bfsize = _FRAME_HDR.unpack_from(data, b)
        bend: int = b + 7 + bfsize
        if btype != 3 or bch != ch or bfsize != bsize or bfsize > max_size or bend >= n or data[bend] != 0xCE:
            return None
        return hend, bend

    def _fast_publish(self, ch: int, data: bytes, p: int, end: int, n: int, max_size: int) -> int:
        """publish + header + one body frame, all in the buffer: one pass, no PendingContent.

        Returns the position after the body frame, or 0 to take the general
        path (content split over several frames or reads, or anything odd,
        which the general path then reports precisely).
        """
        raw = data[p:end]
        a = self._pub_args.get(raw)
        if a is None:
            try:
                a = self._publish_args(raw)
            except errors.AMQPError:
                return 0
        h = end + 1
        got = self._content_at(data, h, ch, n, max_size)
        if got is None:
            return 0
        hend, bend = got
        props = data[h + 19 : hend]
        if not _props_valid(props):
            return 0  # the general path refuses it
        if bend == hend:
            self.handle_publish(ch, a, props, b"")
            return hend + 1
        b = hend + 1
        # a large body stays a view of the read buffer: the store writes it with
        # pwritev, so slicing it out first would be one more full copy
        if bend - b - 7 >= _SMALL_BODY:
            self.handle_publish(ch, a, props, memoryview(data)[b + 7 : bend])
            return bend + 1
        method = data[p - 11 : end + 1]
        # what the next publishes repeat (receive_data, _publish_run)
        self._repeat = (data[p - 11 : b + 7], ch, a, props, bend - b - 7, b + 18 - p, method)
        body = data[b + 7 : bend]
        nxt = bend + 1
        if n - nxt > 20 and data[nxt] == 1 and data[nxt + 7 : nxt + 11] == method[7:11] \
                and not data.startswith(method, nxt) \
                and (data[nxt + 1 : nxt + 3] == method[1:3] or self.mixes_publishes(ch)):
            # another publish, not a repeat (on this channel, or on another when this one's
            # publishes may be mixed): a batch if it is to the same exchange
            sig = method[7 : 14 + method[13]]  # method id, reserved-1, exchange
            if data.startswith(sig, nxt + 7):
                return self._publish_batch(ch, a, props, body, data, nxt, n, max_size, sig)
        self.handle_publish(ch, a, props, body)
        return nxt

    def _publish_batch(self, ch: int, a: PublishArgs, props: bytes, body: bytes, data: bytes, pos: int,
                       n: int, max_size: int, sig: bytes) -> int:
        """The publish just parsed (``a``, ``props``, ``body``) and those at ``pos`` after it
        to the same exchange (``sig``: their method frames' bytes from the method id to the
        exchange name), each with a routing key or flags of its own and one body frame under
        16 KiB, complete in ``data``: handed over as one batch. Stops at a publish that repeats
        the one before it on its channel (the run parser's) and at anything else.

        All on channel ``ch``, or, where every channel involved ``mixes_publishes``, on open
        channels of their own without content in progress (``handle_publish_mixed``): issue
        31's producer with a channel per queue. Returns the position after the batch."""
        pub_args = self._pub_args
        unpack_hdr = _FRAME_HDR.unpack_from
        content_at = self._content_at
        channel_state = self.channels.get
        pending = self._pending
        mixes = self.mixes_publishes
        args_l = [a]
        props_l = [props]
        bodies = [body]
        chans: list[int] | None = None  # each publish's channel, once another than ``ch`` joins
        last = a
        last_ch = ch
        repeat = None
        while n - pos >= 7:
            ftype, fch, size = unpack_hdr(data, pos)
            end = pos + 7 + size
            if ftype != 1 or size > max_size or end >= n or data[end] != 0xCE \
                    or not data.startswith(sig, pos + 7):
                break
            if fch != ch and chans is None:
                if not (channel_state(fch) == CH_OPEN and fch not in pending and mixes(ch) and mixes(fch)):
                    break
                chans = [ch] * len(bodies)
            elif fch != last_ch and not (channel_state(fch) == CH_OPEN and fch not in pending and mixes(fch)):
                break
            raw = data[pos + 11 : end]
            got_args = pub_args.get(raw)
            if got_args is None:
                try:
                    got_args = self._publish_args(raw)
                except errors.AMQPError:
                    break  # the general path reports it
            a = got_args
            if a is last and fch == last_ch:
                break  # repeats the last one: a run (_publish_run)
            got = content_at(data, end + 1, fch, n, max_size)
            if got is None:
                break
            hend, bend = got
            b = hend + 1
            if not 0 < bend - b - 7 < _SMALL_BODY:
                break
            p = data[end + 20 : hend]
            if not _props_valid(p):
                break  # the general path refuses it
            args_l.append(a)
            props_l.append(p)
            bodies.append(data[b + 7 : bend])
            if chans is not None:
                chans.append(fch)
            repeat = (pos, b, end, bend)
            last = a
            last_ch = fch
            pos = bend + 1
        if repeat is not None:
            at, b, end, bend = repeat
            self._repeat = (data[at : b + 7], last_ch, last, props_l[-1], bend - b - 7, b + 7 - at,
                            data[at : end + 1])
        try:
            if len(bodies) == 1:
                self.handle_publish(ch, args_l[0], props, body)
            elif chans is not None:
                self.handle_publish_mixed(chans, args_l, props_l, bodies)
                return pos  # each channel's errors are its own, handled there
            else:
                self.handle_publish_batch(ch, args_l, props_l, bodies)
        except errors.AMQPError as exc:
            self._frame_error(ch, exc)
        return pos

    def _header_frame(self, ch: int, data: bytes, start: int, end: int) -> None:
        if self.state == State.CLOSING or self.channels.get(ch) == CH_CLOSING:
            return
        p = self._pending.get(ch)
        if p is None or p.props is not None:
            raise errors.UnexpectedFrame(f"unexpected content header frame on channel {ch}",
                                         *((0, 0) if p is None else (60, 40)))
        if end - start < 14:
            raise errors.FrameError("content header frame too short")
        class_id, _weight, size = _HEADER_PREFIX.unpack_from(data, start)
        if class_id != 60:
            raise errors.FrameError(f"content header for class {class_id}")
        if size > self.max_message_size:
            del self._pending[ch]
            raise errors.PreconditionFailed(
                f"message size {size} is larger than configured max size {self.max_message_size}", 60, 40
            )
        if self.max_bytes_in_flight and size + self.assembling() > self.max_bytes_in_flight:
            del self._pending[ch]
            raise errors.PreconditionFailed(
                f"message of {size} bytes would take the bodies in flight on this connection past "
                f"max_bytes_in_flight ({self.max_bytes_in_flight})", 60, 40)
        props = data[start + 12 : end]
        if not _props_valid(props):
            raise errors.AMQPSyntaxError(f"malformed message properties: {properties.problem(props)}", 60, 40)
        p.props = props
        p.size = size
        if size == 0:
            del self._pending[ch]
            self.handle_publish(ch, p.args, p.props, b"")

    def _body_frame(self, ch: int, data: bytes, start: int, end: int) -> None:
        if self.state == State.CLOSING or self.channels.get(ch) == CH_CLOSING:
            return
        p = self._pending.get(ch)
        if p is None or p.props is None:
            raise errors.UnexpectedFrame(f"unexpected content body frame on channel {ch}",
                                         *((0, 0) if p is None else (60, 40)))
        ln = end - start
        got = p.got + ln
        if got > p.size:
            raise errors.FrameError(f"body larger than the {p.size} bytes announced")
        if got == p.size and not p.chunks:
            body = data[start:end]
        else:
            p.chunks.append(data[start:end])
            p.got = got
            if got < p.size:
                return
            body = b"".join(p.chunks)
            p.chunks = []  # the parts go now, not after the publish: one copy of the body at a time
        del self._pending[ch]
        self.handle_publish(ch, p.args, p.props, body)


_CONNECTION_TABLE: dict[State, dict[type, Any]] = {
    State.START_OK: {commands.Connection.StartOk: AMQPConnection._on_start_ok},
    State.TUNE_OK: {commands.Connection.TuneOk: AMQPConnection._on_tune_ok},
    State.OPEN_WAIT: {commands.Connection.Open: AMQPConnection._on_open},
    State.OPEN: {commands.Connection.Close: AMQPConnection._on_close,
                 commands.Connection.UpdateSecret: AMQPConnection._on_update_secret},
    State.CLOSING: {
        commands.Connection.CloseOk: AMQPConnection._on_close_ok,
        commands.Connection.Close: AMQPConnection._on_close_while_closing,
    },
}
