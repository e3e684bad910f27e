"""Route an AMQP connection by its vhost: read the handshake up to ``connection.open``, then
replay it to the node that owns the vhost (per-shard data path, ``[clustering] shard_leaders``).

Theory of operation
-------------------
AMQP 0-9-1 names the vhost only in ``connection.open``, the client's fourth step, and has no
redirect: the node a client reaches must carry the connection to the vhost's owner itself. Two
sans-IO machines do it, with no socket of their own (``vhost_router.py`` and a follower's
proxy, ``proxy.py``, move their bytes):

* ``OpenReader`` faces the client and plays the server's side up to ``connection.open``:
  ``connection.start`` (the owner's server properties; mechanisms PLAIN, AMQPLAIN), then,
  once the client's ``start-ok`` came, it waits (``login``) until the caller had a serving node
  accept that login (``admit``) before it answers ``connection.tune`` with this node's limits;
  it keeps the client's ``start-ok``, ``tune-ok`` and ``open`` frames *as they arrived* and
  every byte after ``open`` (a client may pipeline its first channel). It does not
  authenticate: a serving node does, when it gets the same ``start-ok``, so no credential is
  judged by a node that does not serve, and every rule (users, permissions, the loopback-only
  guest, the login throttle, vhost limits) is the owner's own.
* ``Replay`` faces a serving node and plays the client's side with the kept frames, in two
  steps. Login: the protocol header, ``start-ok`` on ``connection.start``; the node's
  ``connection.tune`` means it accepted the credentials (``admitted``), its
  ``connection.close`` (403) that it did not, and that ``close`` goes to the client byte for
  byte *before* any ``tune``, as from a broker reached directly (pika names it an
  authentication failure, not "probable access denied"). Open (``finish``): the client's
  ``tune-ok``, ``open`` and the bytes after it; from then on the two sockets are spliced, so
  ``open-ok`` (or 530 for a vhost the user may not use) reaches the client byte for byte. The
  node's ``start`` and ``tune`` go no further (the client already had ours). The node that
  accepts the login is the one the caller expects to serve; when ``open`` names a vhost
  another node serves, the caller replays the whole handshake there (both steps at once),
  and that node authenticates again. A node whose limits are below what the client accepted
  from us (nodes configured differently) fails the route before ``open`` is sent, and the
  client is told 320 (CONNECTION_FORCED) rather than being cut later by a frame too large.

Bounds: the handshake is at most ``MAX_INPUT`` bytes and (the caller's) ``HANDSHAKE_TIMEOUT``
seconds; a malformed or oversized frame ends it (``Failed``), nothing is forwarded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from pamqp import commands, exceptions, frame, header, heartbeat

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
MAX_INPUT: Final = 64 * 1024  # handshake bytes read from either side, at most
HANDSHAKE_TIMEOUT: Final = 10.0  # seconds from accept to the owner's answer to open
REPLY_CODE: Final = 320  # CONNECTION_FORCED: the client may retry


class Failed(Exception):
    """The handshake cannot be routed; ``answer`` is what the client is told (may be empty)."""

    def __init__(self, why: str, answer: bytes = b"") -> None:
        super().__init__(why)
        self.answer = answer


@dataclass(frozen=True)
class Limits:
    """What this node's ``connection.tune`` offers (the node's ``[amqp]`` settings)."""

    channel_max: int
    frame_max: int
    heartbeat: int


@dataclass
class Opened:
    """A client's handshake up to ``connection.open``, as it arrived."""

    vhost: str
    start_ok: bytes
    tune_ok: bytes
    open: bytes
    rest: bytes  # bytes the client sent after open
    channel_max: int
    frame_max: int


def _frames(buf: bytearray) -> Iterator[tuple[bytes, object]]:
    """Complete frames at the front of ``buf``, each with its raw bytes, taken out of ``buf`` one
    by one as they are yielded (a caller that stops leaves the rest in ``buf``)."""
    while len(buf) >= 7:
        size = int.from_bytes(buf[3:7], "big")
        if size > MAX_INPUT:
            raise Failed("a handshake frame larger than allowed")
        if len(buf) < size + 8:
            return  # not complete yet
        try:  # one frame's bytes only: a read of many small frames costs no copy of the rest
            used, _channel, value = frame.unmarshal(bytes(buf[:size + 8]))
        except exceptions.UnmarshalingException as exc:
            raise Failed(f"malformed handshake frame: {exc}") from None
        except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:
            raise Failed(f"malformed handshake frame: {exc}") from None
        raw = bytes(buf[:used])
        del buf[:used]
        yield raw, value


def refusal(why: str) -> bytes:
    """``connection.close`` 320 with ``why``, for a client whose handshake cannot be routed."""
    text = f"CONNECTION_FORCED - {why}".encode()[:255].decode(errors="ignore")
    return frame.marshal(commands.Connection.Close(REPLY_CODE, text, 0, 0), 0)


class OpenReader:
    """The server's side of the handshake up to ``connection.open`` (see the module's comment).

    ``receive(bytes) -> bytes to send``; ``login`` is set once ``start-ok`` came, and nothing
    more is read until ``admit() -> bytes to send``; ``opened`` is set once ``connection.open``
    came."""

    def __init__(self, limits: Limits, server_properties: dict[str, Any]) -> None:
        self.limits = limits
        self.server_properties = server_properties  # the owner's (the node hands the broker's own)
        self.opened: Opened | None = None
        self.login: bytes | None = None  # the client's start-ok, raw, once it came
        self.admitted = False
        self._buf = bytearray()
        self._seen = 0
        self._started = False
        self._start_ok = b""
        self._tune_ok = b""
        self._tuned: commands.Connection.TuneOk | None = None

    def receive(self, data: bytes) -> bytes:
        if self.opened is not None:
            self.opened.rest += data
            return b""
        self._seen += len(data)
        if self._seen > MAX_INPUT:
            raise Failed("handshake too long")
        self._buf += data
        out = b""
        if not self._started:
            if len(self._buf) < len(PROTOCOL_HEADER):
                if not PROTOCOL_HEADER.startswith(bytes(self._buf)):
                    raise Failed("not AMQP 0-9-1", PROTOCOL_HEADER)
                return b""
            if not self._buf.startswith(PROTOCOL_HEADER):
                raise Failed("not AMQP 0-9-1", PROTOCOL_HEADER)  # spec 4.2.2: say what we speak
            del self._buf[:len(PROTOCOL_HEADER)]
            self._started = True
            out += frame.marshal(commands.Connection.Start(
                server_properties=self.server_properties,
                mechanisms="PLAIN AMQPLAIN", locales="en_US"), 0)
        return out + self._read()

    def admit(self) -> bytes:
        """A serving node accepted the client's login: tune the client, read on."""
        assert self.login is not None and not self.admitted
        self.admitted = True
        lim = self.limits
        return frame.marshal(commands.Connection.Tune(channel_max=lim.channel_max, frame_max=lim.frame_max,
                                                      heartbeat=lim.heartbeat), 0) + self._read()

    def _read(self) -> bytes:
        out = b""
        if self.login is not None and not self.admitted:
            return out  # waiting for a serving node to accept the login
        for raw, value in _frames(self._buf):
            out += self._on(raw, value)
            if self._waiting():
                break
            opened = self._opened()  # (a call: mypy would keep self.opened narrowed to None)
            if opened is not None:
                opened.rest = bytes(self._buf)
                self._buf.clear()
                break
        return out

    def _opened(self) -> Opened | None:
        return self.opened

    def _waiting(self) -> bool:
        return self.login is not None and not self.admitted

    def _on(self, raw: bytes, value: object) -> bytes:
        if isinstance(value, heartbeat.Heartbeat):
            return b""
        if isinstance(value, commands.Connection.StartOk) and not self._start_ok:
            self._start_ok = self.login = raw
            return b""  # tune once admitted
        if isinstance(value, commands.Connection.TuneOk) and self._start_ok and not self._tune_ok:
            self._tune_ok, self._tuned = raw, value
            return b""
        if isinstance(value, commands.Connection.Open) and self._tuned is not None:
            self.opened = Opened(value.virtual_host, self._start_ok, self._tune_ok, raw, b"",
                                 self._tuned.channel_max, self._tuned.frame_max)
            return b""
        raise Failed(f"unexpected {type(value).__name__} in the handshake")


class Joining:
    """A handshake toward a serving node that ends joined to the client: until then the node's
    bytes are bounded (``MAX_INPUT``), from then on (``spliced``) kept for the client
    (``to_client``). ``Replay`` here, ``stream_route.StreamReplay`` for the stream protocol."""

    def __init__(self) -> None:
        self.spliced = False
        self.to_client = b""
        self._seen = 0

    def _handshaking(self, data: bytes, too_long: Callable[[], Failed]) -> bool:
        """Whether ``data`` is the handshake's (False: spliced, it went to ``to_client``)."""
        if self.spliced:
            self.to_client += data
            return False
        self._seen += len(data)
        if self._seen > MAX_INPUT:
            raise too_long()
        return True


class Replay(Joining):
    """The client's side of the handshake toward a serving node, with the frames ``OpenReader``
    kept (see the module's comment).

    ``start() -> bytes`` first; then ``receive(node bytes) -> bytes to the node`` until
    ``admitted`` (the login accepted) or ``spliced`` (refused: ``to_client`` holds the node's
    ``connection.close``); once admitted, ``finish(opened) -> bytes to the node`` and the
    sockets are joined, ``to_client`` holding the node's bytes so far."""

    def __init__(self, start_ok: bytes) -> None:
        super().__init__()
        self.start_ok = start_ok
        self.admitted = False
        self._tune: commands.Connection.Tune | None = None
        self._buf = bytearray()
        self._started = False

    def start(self) -> bytes:
        return PROTOCOL_HEADER

    def receive(self, data: bytes) -> bytes:
        if not self._handshaking(data, lambda: Failed("the owner's handshake too long",
                                                      refusal("the vhost's node did not answer"))):
            return b""
        self._buf += data
        if not self._started:
            if len(self._buf) < len(PROTOCOL_HEADER):
                return b""
            if self._buf.startswith(b"AMQP"):  # the owner refused our protocol header
                raise Failed("the owner refused AMQP 0-9-1", refusal("the vhost's node refused"))
        if self.admitted:
            return b""  # kept for the client until finish (the node waits for tune-ok)
        out = b""
        for raw, value in _frames(self._buf):
            out += self._on(raw, value)
            if self._done():
                break
        if self._spliced():
            self.to_client += bytes(self._buf)
            self._buf.clear()
        return out

    def finish(self, opened: Opened) -> bytes:
        """The client's tune-ok, open and what followed, for the node that admitted its login."""
        tune = self._tune
        assert tune is not None and not self.spliced
        if _below(tune.channel_max, opened.channel_max) or _below(tune.frame_max, opened.frame_max):
            raise Failed(f"the vhost's node offers channel_max {tune.channel_max}, frame_max "
                         f"{tune.frame_max}; the client took {opened.channel_max}, {opened.frame_max}",
                         refusal("the vhost's node has lower limits than this one"))
        self.spliced = True
        self.to_client += bytes(self._buf)
        self._buf.clear()
        return opened.tune_ok + opened.open + opened.rest

    def _spliced(self) -> bool:
        return self.spliced  # (a call: mypy would keep self.spliced narrowed to False)

    def _done(self) -> bool:
        return self.spliced or self.admitted

    def _on(self, raw: bytes, value: object) -> bytes:
        if isinstance(value, heartbeat.Heartbeat | header.ProtocolHeader):
            return b""
        if isinstance(value, commands.Connection.Start) and not self._started:
            self._started = True
            return self.start_ok
        if isinstance(value, commands.Connection.Tune) and self._started:
            self._tune, self.admitted = value, True
            return b""
        if isinstance(value, commands.Connection.Close):
            self.spliced = True  # refused before tune (bad credentials): the client reads why
            self.to_client += raw
            return b""
        raise Failed(f"unexpected {type(value).__name__} from the vhost's node",
                     refusal("the vhost's node answered out of turn"))


def _below(offered: int, taken: int) -> bool:
    """Whether the owner's limit ``offered`` is below the client's ``taken`` (0: no limit)."""
    if offered == 0:
        return False
    return taken == 0 or taken > offered
