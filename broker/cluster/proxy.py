"""Follower proxy: clients may connect to any node; followers splice them to the leader.

Theory of operation
-------------------
A follower listens on the client ports (AMQP and, when the management API is
enabled, HTTP; AMQPS and HTTPS with a certificate; LMQ's HTTP and RPC) once its
first bulk sync completed, so a client never reaches a node that has never been
in sync with the cluster. Each accepted connection is spliced to the current
leader, which announces the number of each of its client ports in the
replication welcome (a node's port numbers need not match its peers'):

* plain ports (AMQP, HTTP, LMQ): through a tunnel on the leader's replication
  port (``broker.cluster.tunnel``), TLS whenever the replication link is, so no
  client byte crosses the network between nodes in clear; the tunnel names the
  client's address, and the leader reports it as the connection's peer;
* MQTTS: tunnelled like the plain ports, with TLS end to end between the client and the leader's
  MQTTS listener inside the tunnel (MQTT's listener takes no PROXY header; the tunnel names the
  client instead);
* Unix sockets (``unix_path`` of ``[amqp]``, ``[mqtt]``, ``[mgmt]``): the follower binds its own
  path with ``[main] unix_mode`` and tunnels each client to the leader's AMQP, MQTT or HTTP port
  as ``codec.UNIX_CLIENT``, which the leader treats as a local client, as the follower would;
* AMQPS and HTTPS: to the leader's own TLS port, prefixed with a PROXY protocol
  v1 header (``PROXY TCP4 src dst sport dport``, in clear before the client's
  TLS bytes; the leader honours it only because we are a cluster member), then
  passed through as they are: TLS runs end to end between the client and the
  leader, so client certificates and EXTERNAL work through any node.

With ``[clustering] shard_leaders`` the AMQP port is *routed* (``Routed``): the proxy plays the
handshake itself (``vhost_route.OpenReader``, no authentication); at the client's ``start-ok``
it opens the tunnel to the node that checks logins (``Routed.login``) and replays it there
(``vhost_route.Replay``), so that node authenticates and a refusal reaches the client before
tune, as from a node reached directly; at ``connection.open`` it asks which node serves the
vhost and goes on on the same tunnel when it is that node, else replays the whole handshake on
a tunnel to the one that is; the serving node answers ``open-ok``; then the tunnel is spliced
as above. With no node to check the login the client is tuned anyway and told 320 after its
``open``, as ``unavailable.py`` does (a close right after ``start-ok`` reads as a failed login).
Today the node serving every vhost is still the cluster leader; once a
shard's leader serves it (docs/architecture.md, *Per-shard leaders*) only ``serving`` changes.

When the leader changes or is lost (its key gone, our lease gone, the
replication link silent) the runner calls ``drop_clients``: every spliced
connection is closed, so clients reconnect (to the new leader) instead of
waiting on a leader that may be partitioned away and will never send the FIN
itself, and clears the targets: until a leader welcomes us again, and whenever
the leader cannot be reached, a client is answered in its own protocol that
there is no leader yet (``broker.cluster.unavailable``: an AMQP
``connection.close`` 320, an HTTP 503), never just dropped. A tunnel carries
a keepalive (``broker.cluster.tunnel``), so a dead link closes its client on
both nodes within ``[clustering] tunnel_keepalive`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from broker.cluster import codec, unavailable
from broker.cluster.tunnel import TunnelRefused, open_tunnel, pump, read_framed, splice, write_framed
from broker.cluster.vhost_route import HANDSHAKE_TIMEOUT, Failed, Limits, OpenReader, refusal
from broker.cluster.vhost_router import login, read_login, read_open, replay

log = logging.getLogger(__name__)



def proxy_header(src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    family = "TCP6" if ipaddress.ip_address(src[0]).version == 6 else "TCP4"
    return f"PROXY {family} {src[0]} {dst[0]} {src[1]} {dst[1]}\r\n".encode("ascii")


class Target:
    """Where clients are spliced to; updated by the runner as the leader changes."""

    def __init__(self, host: str | None = None, port: int = 0) -> None:
        self.host = host
        self.port = port


@dataclass(frozen=True)
class Tunnelled:
    """A proxy whose target is the leader's replication port: each client gets a tunnel."""

    which: int  # codec.AMQP_PORT ...
    secret: Callable[[], bytes]  # read per connection: the runner re-reads it from etcd
    tls: Callable[[], ssl.SSLContext | None]  # the replication link's client context (None: clear)
    node_id: str = ""  # ours: the leader cuts our tunnels when it drops us
    keepalive: float = 0.0  # seconds of silence after which a tunnel is presumed dead (0: never)


@dataclass(frozen=True)
class Routed:
    """AMQP read up to connection.open and carried to the node serving its vhost
    (``[clustering] shard_leaders``: ``vhost_route.py``); ``serving(vhost)`` is that node's
    target (the cluster leader for every vhost until a shard's leader serves it)."""

    limits: Limits
    server_properties: dict[str, Any]
    serving: Callable[[str], Target]
    login: Callable[[], Target]  # the node that checks a client's credentials before its open


# A carried client's handshake played to the serving node: given the tunnel's framed read and
# write, it returns the node's bytes for the client once the two may be spliced (``Failed``: not
# carried, with the client's answer).
Play = Callable[[Callable[[], Awaitable[bytes]], Callable[[bytes], None]], Awaitable[bytes]]


@dataclass(frozen=True)
class Carried:
    """A client the cluster leader's broker carries to the node serving its vhost (``adopt``):
    the tunnel's port (``which``, codec.AMQP_PORT ...), the handshake to replay there, and what
    the client is told, in its protocol, when that node cannot be reached in time."""

    vhost: str
    which: int
    play: Play
    refusal: Callable[[str], bytes]
    peer_tls: bytes = b""  # the client's TLS this node ended (``broker.tls.carried``), for that node
    to: Target | None = None  # this member rather than the vhost's server (``Elsewhere.open_member``)


class SpliceProxy:
    def __init__(self, name: str, target: Target, send_proxy_header: bool, source_ip: str | None,
                 tunnel: Tunnelled | None = None, routed: Routed | None = None) -> None:
        self.name = name
        self.routed = routed if tunnel is not None else None  # over a tunnel only
        self.target = target
        self.send_proxy_header = send_proxy_header
        self.source_ip = source_ip
        self.tunnel = tunnel
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._unix_path = ""

    async def start(self, bind: str, port: int) -> int:
        """Listen; returns the port bound (``port`` 0: any free one)."""
        self._server = await asyncio.start_server(self._handle, bind, port, reuse_address=True)
        log.info("%s proxy listening on %s:%d", self.name, bind, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def start_unix(self, path: str, mode: int) -> None:
        """Listen on a Unix socket at ``path`` (a stale socket file there is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(self._handle, path)
        os.chmod(path, mode)
        self._unix_path = path
        log.info("%s proxy listening on Unix socket %s", self.name, path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self._unix_path:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
            self._unix_path = ""
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, why: str) -> None:
        """No leader to splice to: say so in the client's protocol (``broker.cluster.unavailable``),
        within ANSWER_TIMEOUT, then close. TLS ports (end to end to the leader) are just closed."""
        which = self.tunnel.which if self.tunnel is not None else None
        try:
            async with asyncio.timeout(unavailable.ANSWER_TIMEOUT):
                await _answer(which, reader, writer, why)
        except (TimeoutError, OSError, RuntimeError):
            pass

    async def _leg(self, host: str, port: int, client: tuple[str, int], which: int | None = None,
                   peer_tls: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to ``host:port`` for ``client`` (a tunnel when this proxy tunnels, to
        client port ``which``: this proxy's own unless named, naming the client's TLS we ended)."""
        if self.tunnel is not None:
            t = self.tunnel
            lreader, upstream = await open_tunnel(
                host, port, which=t.which if which is None else which, client=client, secret=t.secret(),
                tls=t.tls(), source_ip=self.source_ip, node_id=t.node_id, keepalive=t.keepalive,
                peer_tls=peer_tls)
        else:
            local = (self.source_ip, 0) if self.source_ip else None
            async with asyncio.timeout(5.0):
                lreader, upstream = await asyncio.open_connection(host, port, local_addr=local)
        self._writers.add(upstream)
        return lreader, upstream

    async def _routed_leg(self, target: Target, client: tuple[str, int], which: int | None = None,
                          answer: Callable[[str], bytes] = refusal, peer_tls: bytes = b""
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A tunnel to ``target`` for a routed client (``Failed`` with ``answer(why)`` to send:
        AMQP's 320 unless the protocol's own is named)."""
        if target.host is None or not target.port:
            raise Failed("no serving node", answer("no cluster leader yet"))
        try:
            return await self._leg(target.host, target.port, client, which, peer_tls)
        except (TimeoutError, OSError) as exc:  # TunnelRefused is a ConnectionError
            why = str(exc) if isinstance(exc, TunnelRefused) else "the cluster leader cannot be reached"
            raise Failed(f"cannot reach {target.host}:{target.port}: {why}",
                         answer(f"no cluster leader yet: {why}")) from None

    async def _route(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter,
                     client: tuple[str, int], routed: Routed
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The routed handshake (module comment), bounded; the leg to splice the client with
        (None: the client left or was answered; its leg is closed)."""
        reader = OpenReader(routed.limits, routed.server_properties)
        leg: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                start_ok = await read_login(creader, cwriter, reader)
                if start_ok is None:
                    return None
                first = routed.login()
                at = (first.host, first.port)
                try:
                    leg = await self._routed_leg(first, client)
                    rep = await login(start_ok, *_on(leg))
                except Failed:
                    # nobody checked the login: the client hears why after its open, as from a
                    # node with no leader (unavailable.py; a close now reads as a failed login)
                    cwriter.write(reader.admit())
                    if await read_open(creader, cwriter, reader) is None:
                        raise Failed("the client left") from None
                    raise
                if rep.spliced:  # refused: the node's close to the client, its close-ok back
                    cwriter.write(rep.to_client)
                    return leg
                cwriter.write(reader.admit())
                opened = await read_open(creader, cwriter, reader)
                if opened is None:
                    raise Failed("the client left")
                target = routed.serving(opened.vhost)
                if (target.host, target.port) == at:
                    write_framed(leg[1], rep.finish(opened))
                    cwriter.write(rep.to_client)
                    return leg
                leg[1].close()  # another node serves the vhost: the whole handshake there
                self._writers.discard(leg[1])
                leg = await self._routed_leg(target, client)
                cwriter.write(await replay(opened, *_on(leg)))
                return leg
        except TimeoutError:
            log.info("%s proxy: %s not routed within %.0fs", self.name, client, HANDSHAKE_TIMEOUT)
            answer = refusal("the vhost's node did not answer") if reader.opened is not None else b""
        except Failed as exc:
            log.info("%s proxy: %s not routed: %s", self.name, client, exc)
            answer = exc.answer
        if leg is not None:
            leg[1].close()
            self._writers.discard(leg[1])
        await _tell(cwriter, answer)
        return None

    def adopt(self, sock: socket.socket, client: tuple[str, int], carried: Carried) -> None:
        """Carry a client whose handshake the cluster leader's own broker read up to its vhost
        (``sock``, ours now) to the node serving ``carried.vhost``: a tunnel to that node's
        port of the client's protocol, the handshake replayed there (``carried.play``: that
        node checks the login again), then spliced, as ``_route`` does for a client of this
        proxy's port (``broker.cluster.elsewhere``)."""
        task = asyncio.get_running_loop().create_task(self._adopted(sock, client, carried))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopted(self, sock: socket.socket, client: tuple[str, int], carried: Carried) -> None:
        assert self.routed is not None
        try:
            creader, cwriter = await asyncio.open_connection(sock=sock)
        except OSError as exc:
            sock.close()
            log.info("%s: %s not carried: %s", self.name, client, exc)
            return
        self._writers.add(cwriter)
        self._clients.add(cwriter)
        leg: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                    target = carried.to if carried.to is not None else self.routed.serving(carried.vhost)
                    leg = await self._routed_leg(target, client, carried.which,
                                                 carried.refusal, carried.peer_tls)
                    cwriter.write(await carried.play(*_on(leg)))
            except TimeoutError:
                log.info("%s: %s not routed within %.0fs", self.name, client, HANDSHAKE_TIMEOUT)
                await _tell(cwriter, carried.refusal("the vhost's node did not answer"))
                return
            except Failed as exc:
                log.info("%s: %s not routed: %s", self.name, client, exc)
                await _tell(cwriter, exc.answer)
                return
            await splice((creader, cwriter), leg, self.tunnel.keepalive if self.tunnel is not None else 0.0)
        except (OSError, RuntimeError, asyncio.IncompleteReadError) as exc:
            log.info("%s: %s", self.name, exc or type(exc).__name__)
        except asyncio.CancelledError:
            log.info("%s: client connection closed (stopped)", self.name)
        finally:
            for w in (cwriter, leg[1] if leg is not None else None):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
                    self._clients.discard(w)

    def drop_clients(self) -> int:
        """Close every spliced connection (both ends); returns how many client sockets."""
        clients = 0
        for w in list(self._writers):
            clients += w in self._clients
            w.close()
        return clients

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(cwriter)
        self._clients.add(cwriter)
        lwriter: asyncio.StreamWriter | None = None
        try:
            host, port = self.target.host, self.target.port
            src = cwriter.get_extra_info("peername")
            # a Unix socket's peer has no address: the leader hears of a local client
            client = (str(src[0]), int(src[1])) if isinstance(src, tuple) else (codec.UNIX_CLIENT, 0)
            if self.routed is not None:
                leg = await self._route(creader, cwriter, client, self.routed)
                if leg is None:
                    return
                lreader, upstream = leg
                lwriter = upstream
                await splice((creader, cwriter), (lreader, upstream), self.tunnel.keepalive
                             if self.tunnel is not None else 0.0)
                return
            if host is None or not port:
                why = ("no cluster leader yet" if host is None
                       else "the cluster leader does not serve this port")
                await self._refuse(creader, cwriter, why)
                return
            try:
                lreader, upstream = await self._leg(host, port, client)
            except (TimeoutError, OSError) as exc:  # TunnelRefused is a ConnectionError
                log.info("%s proxy: cannot reach the leader at %s:%d: %s", self.name, host, port,
                         exc or type(exc).__name__)
                why = str(exc) if isinstance(exc, TunnelRefused) else "the cluster leader cannot be reached"
                await self._refuse(creader, cwriter, f"no cluster leader yet: {why}")
                return
            lwriter = upstream
            if self.send_proxy_header:
                dst = cwriter.get_extra_info("sockname")
                upstream.write(proxy_header(client, (str(dst[0]), int(dst[1]))))
            if self.tunnel is not None:
                await splice((creader, cwriter), (lreader, upstream), self.tunnel.keepalive)
            else:
                await asyncio.gather(pump(creader, upstream), pump(lreader, cwriter))
        except (TimeoutError, OSError, RuntimeError, asyncio.IncompleteReadError) as exc:
            log.info("%s proxy: %s", self.name, exc or type(exc).__name__)
        except asyncio.CancelledError:
            # stop() ended this connection on purpose: end normally, since asyncio's stream
            # callback reads the handler task's exception and logs a cancelled one as a traceback
            log.info("%s proxy: client connection closed (proxy stopped)", self.name)
        finally:
            for w in (cwriter, lwriter):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
                    self._clients.discard(w)
            if task is not None:
                self._tasks.discard(task)


def _on(leg: tuple[asyncio.StreamReader, asyncio.StreamWriter]
        ) -> tuple[Callable[[], Awaitable[bytes]], Callable[[bytes], None]]:
    """A tunnel leg's framed read and write, for the handshake machines (``vhost_router.py``)."""
    return (lambda: read_framed(leg[0])), (lambda data: write_framed(leg[1], data))


async def _tell(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write a last answer to a client (its connection is closed after)."""
    if data and not writer.is_closing():
        writer.write(data)
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            async with asyncio.timeout(unavailable.ANSWER_TIMEOUT):
                await writer.drain()


async def _answer(which: int | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  why: str) -> None:
    if which == codec.AMQP_PORT:
        amqp = unavailable.AmqpRefusal(why)
        while not amqp.done:
            data = await reader.read(unavailable.MAX_INPUT)
            if not data:
                return
            if out := amqp.receive(data):
                writer.write(out)
                await writer.drain()
    elif which in (codec.HTTP_PORT, codec.LMQ_HTTP_PORT):
        head = b""
        while not unavailable.http_head_complete(head):
            data = await reader.read(unavailable.MAX_INPUT)
            if not data or len(head) + len(data) > unavailable.MAX_INPUT:
                break
            head += data
        writer.write(unavailable.http_response(why))
        await writer.drain()
    elif which == codec.MQTT_PORT:  # MQTTS is TLS end to end: just closed
        data = b""
        while (answer := unavailable.mqtt_connack(data)) is None:
            more = await reader.read(unavailable.MAX_INPUT)
            if not more or len(data) + len(more) > unavailable.MAX_INPUT:
                return
            data += more
        writer.write(answer)
        await writer.drain()
