"""The asyncio side of AMQP: listener, per-connection protocol, heartbeats.

Theory of operation
-------------------
``AMQPProtocol`` is a thin adapter: ``data_received`` feeds the sans-IO
session, lets it coalesce confirms, then writes everything the session
produced in ONE ``transport.write``. Output produced outside a read (a
delivery triggered by another connection's publish, a group commit finishing)
calls ``wakeup()``, which schedules one flush on the next loop turn.

Backpressure: when the transport's write buffer passes the high-water mark
(``pause_writing``) the session stops being ``writable`` and its consumers
report no capacity; ``resume_writing`` reschedules their queues. Reading is
not paused for that: the client's acks are what frees its capacity. Only when
replies it has not read pass ``[amqp] max_bytes_in_flight`` (a client that
publishes mandatory messages to nowhere or gets large messages and never
reads) is the client not read until ``resume_writing``. Reading is also paused
by resource alarms (broker/amqp/alarms.py) and by the memory gate for bodies
being assembled (broker/amqp/memory.py).

Heartbeats and handshake/close timeouts run from one periodic tick over all
connections instead of a timer per connection. A connection we are not reading
(``_read_paused``: held, blocked by an alarm, waiting for memory) is never timed
out for missed heartbeats, as RabbitMQ pauses its heartbeat monitor while a
connection is blocked; the clock restarts when reading does. One that we do not
read because it does not read us is: its silence is its own.

Hand-over (a node of several workers, ``broker/shards``): when connection.open names a
vhost another worker owns, the session stops parsing (state HANDOVER) and
``_hand_over`` gives the connection away: a plain TCP or Unix socket is passed itself
(its descriptor, duplicated, goes to the owner with the negotiated state; this process then
drops its copy without a word to the client); a TLS connection, or one on a WebSocket,
cannot be passed (the TLS state lives in this process), so a socket pair stands in for
it: one end goes to the owner, and this process relays the decrypted bytes between the
client and the other end (``Relay``). The owner builds an ``AMQPProtocol`` on what it got
and ``resume``s it: it answers the connection.open the client sent and reads on.

Listeners (``broker.net.listener``): the plain AMQP port and the AMQPS port
share one ``AMQPServer`` (one set of connections, one tick); the listener has
already stripped any PROXY header and finished the TLS handshake when it
creates an ``AMQPProtocol``, and hands it the effective peer address.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

from broker import errors, tls
from broker.aio import Relay, hand_off, take_over
from broker.amqp import codec
from broker.amqp.alarms import check_consumer_timeouts
from broker.amqp.broker import NEED_MORE, Broker, start_ok_secret, start_ok_user
from broker.amqp.connection import State
from broker.amqp.session import Session
from broker.net import proxy
from broker.net.listener import Listener, Peer

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT = 10.0  # seconds to finish connection.open
_CLOSE_TIMEOUT = 2.0  # seconds to wait for close-ok before dropping the socket
_WRITE_HIGH_WATER = 1024 * 1024
# seconds between timed looks at a held publisher's consumers. Not less than 1 ms: uvloop
# (libuv) keeps timers in whole milliseconds and turns a shorter delay into call_soon, so 0.5 ms
# had a held publisher looked at on every loop turn, a loop spinning through each hold (issue
# 31). The look that matters is not timed: a write to a consumer rechecks the held (``flush``).
_HOLD_POLL = 0.001
_HOLD_SECONDS = 0.005  # how long a publisher may wait for consumers of its queues to catch up
# seconds of one read's methods (not publishes or acks) before the session gives the loop a turn
# (broker/amqp/connection.py, "Turns"): a burst of deletes in one read held every other
# connection for all of it (issue 31)
_TURN_BUDGET = 0.001


class AMQPProtocol(asyncio.Protocol):
    def __init__(self, broker: Broker, protocols: set[AMQPProtocol], peer: Peer) -> None:
        self.broker = broker
        self.protocols = protocols
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self._flush_scheduled = False
        self.last_read = self.last_write = self.started = time.monotonic()
        self.closing_since = 0.0
        self._read_paused = False
        self._hold: asyncio.TimerHandle | None = None  # the next timed look while held
        self._hold_until = 0.0
        self._header_fed = 0  # protocol-header bytes given to the session before connection.start
        self._admitted = False  # the login throttle let this connection's start-ok through
        self._login_held = b""  # a start-ok arriving in pieces, held until whole (its user name)
        self._out_limit = _WRITE_HIGH_WATER
        # memory gate (broker/amqp/memory.py): body bytes admitted, and whether we wait for more
        self.reserved = 0
        self._mem_wait = False
        # replies the client has not read yet past max_bytes_in_flight: not read until it does
        self._out_wait = False
        self.relay: Relay | None = None  # a TLS connection handed over: its bytes go through us

    # ---------------------------------------------------------------- events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        # past the high-water mark, so resume_writing is sure to follow
        self._out_limit = max(self.broker.config.amqp.max_bytes_in_flight, _WRITE_HIGH_WATER)
        self.session = Session(self.broker, self.peer, self.wakeup)
        peer_tls = tls.PeerTLS.of(transport.get_extra_info("ssl_object"))
        if peer_tls is None and self.broker.proxied_tls:  # carried here by a member that ended its TLS
            leg = transport.get_extra_info("peername")
            if isinstance(leg, tuple):
                peer_tls = self.broker.proxied_tls.get((str(leg[0]), int(leg[1])))
        if peer_tls is not None:
            self.session.tls = peer_tls
            if peer_tls.cert:  # a verified client certificate: EXTERNAL may log in with it
                self.session.mechanisms = "EXTERNAL PLAIN AMQPLAIN"
        self.session.flush_now = self.flush
        self.session.write_now = self.write_now
        self.session.turn_budget = _TURN_BUDGET
        self.protocols.add(self)

    def data_received(self, data: bytes) -> None:
        s = self.session
        if s is None:
            if self.relay is not None:
                self.relay.to_owner(data)
            return
        self.last_read = time.monotonic()
        if data:  # not the rest of a read a turn interrupted (_go_on)
            s.recv_cnt += 1
            s.recv_oct += len(data)
        if not self._admitted:
            data = self._before_login(s, data)
            if not data:
                return
        try:
            s.receive_data(data)
            s.after_batch()
        except Exception as exc:  # a bug must cost one connection, never the broker
            log.exception("internal error on connection %s", s.name)
            s.close_connection(errors.InternalError(f"internal error: {type(exc).__name__}"))
        if s.state is State.HANDOVER:
            self._hand_over(s)
            return
        alarm = self.broker.alarm
        disk = alarm.disk
        disk.read_since_check += len(data)
        if disk.read_since_check >= disk.next_check:
            alarm.note_read(self.broker.connections)
        if alarm.memory.limit:
            wanted = s.assembling()
            if wanted != self.reserved:
                self._assembling(wanted)
        self.flush()
        t = self.transport
        if t is not None and t.get_write_buffer_size() > self._out_limit and not self._out_wait:
            # A client that does not read what we answer is not read either (resume_writing).
            self._out_wait = True
            self._pause_reading()
        if s.yielded:
            # The session stopped mid-read to give other connections a turn: read nothing
            # new until it has gone on with the rest (_go_on)
            s.yielded = False
            self._pause_reading()
            asyncio.get_running_loop().call_soon(self._go_on)
            return
        if s.batch_publishes:
            # Fairness: a publisher gets one read per loop turn. The delivery
            # passes its publishes scheduled run before we read from it again;
            # otherwise libuv's read loop lets one flooding client starve every
            # consumer (measured: 130k/s in, 4k/s out). A publisher with nothing
            # in flight (every confirm sent) is waiting for us: never held.
            s.batch_publishes = 0
            if not s.publishes_in_flight() and not self.broker.alarm.active:
                s.batch_queues.clear()
                return
            t = self.transport
            if t is not None and not t.is_closing() and not self._read_paused:
                self._read_paused = True
                t.pause_reading()
                loop = asyncio.get_running_loop()
                loop.call_soon(self._resume_reading, loop.time() + _HOLD_SECONDS)

    def _go_on(self) -> None:
        """The loop's turn is over: handle the rest of the read the session stopped in, then
        read on unless something in it (or a gate meanwhile) paused reading. Bytes read in
        between (a gate resumed us) came after that rest, and the session took them after it."""
        t = self.transport
        if self.session is None or t is None or t.is_closing():
            return
        self._read_paused = False
        self.data_received(b"")
        if not self._read_paused and not self._mem_wait and not self._out_wait:
            self._read_on()

    def _hand_over(self, s: Session) -> None:
        """Give this connection to the worker that owns its vhost (see the module doc)."""
        t = self.transport
        shards = self.broker.shards
        if t is None or t.is_closing() or shards is None:
            return
        t.pause_reading()
        if s.out:  # nothing is expected here (open-ok is the owner's), but never lose a byte
            t.write(bytes(s.out))
            s.out = bytearray()
        if t.get_write_buffer_size():
            asyncio.get_running_loop().call_later(0.005, self._hand_over, s)
            return
        state = s.handed_state()
        state.update(peer=s.peer, tls=s.tls, mechanism=s.auth_mechanism)
        if shards.replays_login:  # another node's broker (only then: a worker is trusted)
            state["login"] = s.handed_login()
        self.protocols.discard(self)
        self.session = None  # gone: nothing of it is ours to log or clean up
        self.relay = hand_off(t, shards, state, f"connection {s.name}")

    def resume(self, state: dict[str, Any]) -> None:
        """The owner's side of a hand-over: continue the connection another worker accepted."""
        s = self.session
        assert s is not None
        s.tls = state.get("tls")
        s.auth_mechanism = str(state.get("mechanism", ""))
        self._admitted = True
        s.resume(state)
        self.flush()
        rest = bytes(state.get("rest", b""))
        if rest:
            self.data_received(rest)

    def _before_login(self, s: Session, data: bytes) -> bytes:
        """Hold connection.start-ok until the login throttle admits its source and user.

        The protocol header goes to the session on its own first (so a start-ok
        sent in the same read cannot skip the throttle); what follows it waits
        out ``LoginThrottle.admit``, with reading paused, or the connection is
        closed when that source and user have piled up more attempts than the throttle
        takes (``broker.auth.throttle``).
        """
        t = self.transport
        assert t is not None
        if s.state == State.HEADER:
            take = len(codec.PROTOCOL_HEADER) - self._header_fed
            self._header_fed += min(take, len(data))
            s.receive_data(data[:take])
            self.flush()
            data = data[take:]
        if not data or s.state != State.START_OK:
            return data
        data = self._login_held + data
        user = start_ok_user(data)
        if user is NEED_MORE:  # the throttle's key needs the user name: wait for the whole frame
            self._login_held = data
            return b""
        self._login_held = b""
        users = self.broker.users
        wait = users.throttle.admit(users.throttle_key(s.peer[0], user), time.monotonic())
        if wait is None:
            log.info("closing %s: too many failed logins from its address, try again later", s.name)
            t.close()
            return b""
        if wait > 0:
            t.pause_reading()
            asyncio.get_running_loop().call_later(wait, self._admit, data)
            return b""
        if self._fetch_keys(data):
            t.pause_reading()
            return b""
        self._admitted = True
        return data

    def _fetch_keys(self, held: bytes) -> bool:
        """True when the start-ok in ``held`` carries a token signed by a key not fetched yet:
        ``_admit`` takes it once the issuer's keys are fetched (``broker.auth.oauth_keys``)."""
        keys = self.broker.users.pending(start_ok_secret(held))
        if keys is None:
            return False
        asyncio.ensure_future(keys).add_done_callback(lambda _: self._admit(held, fetched=True))
        return True

    def _admit(self, held: bytes, fetched: bool = False) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if not fetched and self._fetch_keys(held):
            return
        self._admitted = True
        t.resume_reading()
        self.data_received(held)

    def _assembling(self, wanted: int) -> None:
        """The bodies this connection is assembling now add up to ``wanted`` bytes: ask the
        memory gate; if it says wait, stop reading until ``admitted``."""
        alarm = self.broker.alarm
        held = self.reserved
        if alarm.memory.request(self, held, wanted):
            if self._mem_wait:
                self.admitted(wanted)
            self.reserved = wanted
            if wanted < held and (alarm.memory.waiting or alarm.memory.active):
                alarm.memory_changed(self.broker.connections)  # a body is stored: measure again
            return
        self._mem_wait = True
        self._pause_reading()
        alarm.memory_changed(self.broker.connections)

    def admitted(self, total: int) -> None:
        """The memory gate admitted our bodies: read on, whatever alarm is in effect (an
        admitted body must complete, or its memory is never given back)."""
        self.reserved = total
        self._mem_wait = False
        self._read_on()

    def _pause_reading(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing() and not self._read_paused:
            self._read_paused = True
            t.pause_reading()

    def _read_on(self) -> None:
        self._read_paused = False
        t = self.transport
        if t is not None and not t.is_closing():
            t.resume_reading()

    def _resume_reading(self, hold_until: float) -> None:
        self._end_hold()  # a timed look, or a recheck: either way the next look is decided here
        if self._mem_wait or self._out_wait:
            return  # the memory gate (admitted) or the client reading its replies resumes us
        if self.broker.alarm.active and not self.reserved:
            # an alarm is on: a publisher is not read until it clears, unless it is in the
            # middle of an admitted body
            self.broker.alarm.parked.add(self)
            return
        s = self.session
        if s is not None and s.batch_queues:
            # Consumers of the queues we just fed still have a backlog: give their
            # acks up to _HOLD_SECONDS of loop turns to arrive before reading more, so
            # the publisher goes at the consumers' pace instead of taking the CPU they
            # need (1p1c manual ack: 405k/s consumed with a 30-turn hold, 630-680k/s
            # with this one). The bound is time, not turns: on a busy loop a turn is long.
            # A publisher whose confirms have all gone out meanwhile is let go at once.
            if self._consumers_behind(s) and s.publishes_in_flight():
                loop = asyncio.get_running_loop()
                if loop.time() < hold_until:
                    # look again shortly, not every loop turn: a loop kept spinning for
                    # this would burn the CPU the consumers need. Sooner if a write to
                    # a consumer finds them caught up (``recheck_hold``).
                    self._hold = loop.call_later(_HOLD_POLL, self._resume_reading, hold_until)
                    self._hold_until = hold_until
                    self.broker.held.add(self)
                    return
            s.batch_queues.clear()
        if s is not None:
            s.unanswered = False
        self._read_on()

    @staticmethod
    def _consumers_behind(s: Session) -> bool:
        return any(q.store.ready_count and q.consumers for q in s.batch_queues)

    def recheck_hold(self) -> None:
        """Read on at once if the consumers this publisher is held for have caught up, or if
        it has nothing in flight any more (its confirms went out: a synchronous publisher waits
        for us): one let go only by the next timed look would wait up to ``_HOLD_POLL`` for
        nothing, and so would everything it sends meanwhile."""
        s = self.session
        if self._hold is not None and (s is None or not self._consumers_behind(s)
                                       or not s.publishes_in_flight()):
            self._resume_reading(self._hold_until)

    def _end_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
            self.broker.held.discard(self)

    def unpark(self) -> None:
        """The disk alarm cleared: read this publisher again."""
        self._resume_reading(0.0)

    def wakeup(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self.session is not None:
                self.session.flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        s = self.session
        if s is not None:
            s.flush_pending = False
        t = self.transport
        if s is None or t is None:
            return
        if s.out:
            data = s.out
            s.out = bytearray()
            if not t.is_closing():
                t.write(data)
                s.send_cnt += 1
                s.send_oct += len(data)
                self.last_write = time.monotonic()
            self._recheck_held()
        if s.want_close:
            t.close()
        elif s.state == State.CLOSING and not self.closing_since:
            self.closing_since = time.monotonic()

    def write_now(self, data: bytes) -> None:
        """Write ``data`` after whatever ``out`` holds, keeping the frame order."""
        self.flush()
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)
            if self.session is not None:
                self.session.send_cnt += 1
                self.session.send_oct += len(data)
            self.last_write = time.monotonic()
            self._recheck_held()

    def _recheck_held(self) -> None:
        """What we wrote may be what a held publisher waits for (the deliveries that emptied
        its queues, its own confirms): see ``recheck_hold``."""
        held = self.broker.held
        if held:
            for p in list(held):
                p.recheck_hold()

    def pause_writing(self) -> None:
        if self.session is not None:
            self.session.set_writable(False)
        elif self.relay is not None and self.relay.owner is not None:
            self.relay.owner.pause_reading()  # the client does not read: neither do we, from the owner

    def resume_writing(self) -> None:
        if self.session is not None:
            self.session.set_writable(True)
        elif self.relay is not None and self.relay.owner is not None:
            self.relay.owner.resume_reading()
        if self._out_wait:
            self._out_wait = False
            self._resume_reading(0.0)

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocols.discard(self)
        self._end_hold()
        if self.relay is not None:
            self.relay.client_gone()
        if self.reserved or self._mem_wait:
            alarm = self.broker.alarm
            alarm.memory.release(self, self.reserved)
            self.reserved = 0
            self._mem_wait = False
            alarm.memory_changed(self.broker.connections)
        if self.session is not None:
            try:
                self.session.connection_lost()
            except Exception:
                log.exception("cleanup of connection %s failed", self.session.name)
        self.transport = None

    # ------------------------------------------------------------------ tick
    def tick(self, now: float) -> None:
        s = self.session
        t = self.transport
        if s is None or t is None or t.is_closing():
            return
        if s.state == State.CLOSING:
            if self.closing_since and now - self.closing_since > _CLOSE_TIMEOUT:
                t.close()
            return
        if s.state != State.OPEN:
            if now - self.started > _HANDSHAKE_TIMEOUT:
                log.info("closing %s: handshake timeout", s.name)
                t.close()
            return
        if s.credential_expired():  # RabbitMQ closes a connection whose token expired
            log.info("closing %s: the access token of user %r expired", s.name, s.username)
            self.force_close("credential expired")
            return
        if s.chs and check_consumer_timeouts(s, now, self.broker.config.main.consumer_timeout):
            self.flush()
        hb = s.heartbeat
        if hb:
            if self._read_paused and not self._out_wait:
                # We are not reading it (blocked by an alarm, or held for its consumers): its
                # heartbeats wait unread in the socket, which says nothing about the peer.
                self.last_read = now
            elif now - self.last_read > 2 * hb:
                # a client gone without a word: a warning, as RabbitMQ logs it (once: not again
                # as an unexpected close when the transport goes)
                log.warning("closing %s: missed heartbeats from client (timeout %ss)", s.name, hb)
                s.timed_out = True
                t.close()
                return
            if now - self.last_write >= hb / 2:
                s.send_heartbeat()
                self.flush()

    def force_close(self, reason: str) -> None:
        if self.session is not None:
            self.session.close_connection(errors.ConnectionForced(reason))
            self.flush()


class AMQPServer:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.protocols: set[AMQPProtocol] = set()
        self.listeners: list[Listener] = []
        self._ticker: asyncio.Task[None] | None = None
        self.reuse_port = False  # one of several workers on the node's ports (broker/shards)

    def trusted(self, ip: str) -> bool:
        """May ``ip`` send a PROXY header? Configured proxies and cluster members."""
        return proxy.is_trusted(ip, self.broker.config.amqp.trusted_proxies, self.broker.trusted_peers)

    async def start(self, host: str, port: int,
                    tls_context: Callable[[], ssl.SSLContext] | None = None) -> tuple[str, int]:
        """Open one listener (plain, or AMQPS with ``tls_context``); returns its bound address."""
        listener = Listener("AMQPS" if tls_context else "AMQP",
                            lambda peer: AMQPProtocol(self.broker, self.protocols, peer),
                            self.trusted, tls=tls_context, nodelay=self.broker.config.amqp.tcp_nodelay,
                            remap=self.broker.proxied_peers, reuse_port=self.reuse_port)
        address = await listener.start(host, port)
        self.listeners.append(listener)
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_loop())
        return address

    async def start_unix(self, path: str, mode: int) -> tuple[str, int]:
        """A listener on a Unix socket (``[amqp] unix_path``)."""
        listener = Listener("AMQP (Unix socket)",
                            lambda peer: AMQPProtocol(self.broker, self.protocols, peer),
                            self.trusted, nodelay=False)
        address = await listener.start_unix(path, mode)
        self.listeners.append(listener)
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_loop())
        return address

    async def resume(self, fd: int, state: dict[str, Any]) -> None:
        """Serve a connection another worker of this node accepted (its socket ``fd`` and the
        ``state`` it negotiated: see the module doc, Hand-over)."""
        peer = state.get("peer")
        where = (str(peer[0]), int(peer[1])) if isinstance(peer, (tuple, list)) else ("", 0)
        proto = await take_over(fd, lambda: AMQPProtocol(self.broker, self.protocols, where))
        if proto is None:
            log.info("handed-over connection lost before it resumed")
            return
        cast(AMQPProtocol, proto).resume(state)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for p in list(self.protocols):
                try:
                    p.tick(now)
                except Exception:
                    log.exception("heartbeat tick failed")
            try:
                self.broker.alarm.check([p.session for p in self.protocols if p.session is not None])
                for p in list(self.protocols):
                    p.flush()
            except Exception:
                log.exception("disk alarm check failed")

    async def stop(self, reason: str) -> None:
        """Stop accepting, close every connection with 320, wait briefly for close-ok."""
        for listener in self.listeners:
            await listener.stop()
        if self._ticker is not None:
            self._ticker.cancel()
        for p in list(self.protocols):
            p.force_close(reason)
        deadline = time.monotonic() + 2.0
        while self.protocols and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for p in list(self.protocols):
            if p.transport is not None:
                p.transport.abort()
