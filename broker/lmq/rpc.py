"""LMQ's MessagePack-RPC interface (default port 18800).

Wire format (MessagePack-RPC): a request is ``[0, msgid, method, params]`` and is answered with
``[1, msgid, error, result]``; a notification ``[2, method, params]`` gets no answer. Requests on
one connection run concurrently (a long ``pull`` does not hold up a ``done``), answers carry
their msgid. Methods, as LMQ names them: ``push``, ``pull``, ``pull_any``, ``push_all``,
``done``, ``retain``, ``release``, ``delete``, ``update_props``, ``set_default_props``,
``get_default_props``. Contents are any MessagePack value (stored MessagePack-encoded, content
type ``application/x-msgpack``); LMQ's RPC keeps the older names ``pack`` for ``accum`` and
``package`` for a compound message. An error is a string naming the problem.

Login (Skred's addition; LMQ had none): ``authenticate(user, password)`` -> ``"ok"`` logs the
connection in as a broker user, through the same login throttle as AMQP (an error
``"login failed"``, or ``"too many failed logins ..."`` when the throttle refuses it unchecked).
With ``[lmq] auth`` on (the default) every other call before it is answered with the error
``"not authenticated: call authenticate(user, password) first"``; with it off, calls act as
``[lmq] anonymous_user`` until a connection authenticates as someone else. Each call then needs
the permission ``broker.lmq.access`` maps it to (an ``"access to ... refused"`` error). A login
with an OAuth 2 access token as the password lasts as long as the token: the connection is closed
when it expires, as AMQP's and MQTT's are.

Limits: one request (and so one pushed content) is at most ``max_message_size`` plus a little
framing, past which the connection is closed (a MessagePack stream cannot be resynchronised); a
connection has at most ``[lmq] max_pipelined`` requests in progress and at most
``max_bytes_in_flight`` bytes of them, and answers its client has not read count too: past
either the connection is simply not read until answers go out (TCP pushes back on the client),
so 100,000 pipelined requests cost a bounded amount of memory and never delay other clients.
Request bytes pass the broker's memory gate. A connection with nothing in progress that sends
nothing for ``[lmq] request_timeout`` seconds is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgpack

from broker import errors
from broker.auth.throttle import TooManyFailures
from broker.lmq.access import Access, Refused, anonymous
from broker.lmq.engine import COMPOUND_TYPE, LMQ, LMQError, Message, client_address, login
from broker.lmq.limits import Settings, admitted_bytes
from broker.lmq.props import PropsError, validate, validate_defaults

log = logging.getLogger(__name__)

REQUEST, RESPONSE, NOTIFY = 0, 1, 2
RPC_ALIASES = {"pack": "accum"}
FRAMING = 64 * 1024  # a request's bytes besides its content: method, name, msgid, ...


class RPCError(Exception):
    pass


def _content(msg: Message) -> Any:
    """The pushed value back: MessagePack contents decoded, anything else as bytes."""
    def one(content_type: str, body: bytes) -> Any:
        if content_type == COMPOUND_TYPE:
            try:
                return msgpack.unpackb(body, raw=False)
            except Exception:  # noqa: BLE001 - not MessagePack after all: hand the bytes over
                return body
        return body

    if msg.compound:
        return [one(md.get("content-type", ""), body) for md, body in msg.parts()]
    return one(msg.content_type, msg.body)


def _pulled(msg: Message | None) -> Any:
    if msg is None:
        return "empty"
    return {"queue": msg.queue, "id": msg.id, "type": "package" if msg.compound else "normal",
            "content": _content(msg)}


def _timeout(params: list[Any], i: int) -> float | None:
    if len(params) <= i or params[i] is None:
        return None
    t = params[i]
    if isinstance(t, bool) or not isinstance(t, int | float) or t < 0:
        raise RPCError("timeout must be a number of seconds >= 0")
    return float(t)


def _str(params: list[Any], i: int, what: str) -> str:
    if len(params) <= i or not isinstance(params[i], str) or not params[i]:
        raise RPCError(f"{what} must be a non-empty string")
    return str(params[i])


class Session:
    def __init__(self, lmq: LMQ, cfg: Settings, writer: asyncio.StreamWriter) -> None:
        self.lmq = lmq
        self.cfg = cfg
        self.writer = writer
        self.source = client_address(cfg.peers, writer.transport)
        self.who: Access | None = None  # logged in with authenticate()
        self.expiry: asyncio.TimerHandle | None = None  # when the login's access token expires
        self.tasks: set[asyncio.Task[None]] = set()
        self.in_flight = 0  # bytes of the requests in progress
        self.room = asyncio.Event()  # set while another request may be read
        self.room.set()

    def _close_at_expiry(self) -> None:
        """A login with an access token lasts as long as the token: the connection is closed when
        it expires, as AMQP's and MQTT's are (broker.auth.oauth)."""
        self.cancel_expiry()
        user = self.who.user if self.who is not None else None
        if user is not None and not isinstance(user, str) and user.expires_at is not None:
            self.expiry = asyncio.get_running_loop().call_later(max(0.0, user.expires_at - time.time()),
                                                                self._expired)

    def _expired(self) -> None:
        log.info("LMQ RPC client %s: access token expired: closing", self.source)
        self.writer.close()

    def cancel_expiry(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None

    def close(self) -> None:
        """End the connection now: its calls in progress are cancelled unanswered (an answer after
        this would speak for a vhost the node may no longer serve) and the socket is closed."""
        self.cancel_expiry()
        for task in list(self.tasks):
            task.cancel()
        self.writer.close()

    def alive(self) -> bool:
        return not self.writer.is_closing()

    async def call(self, method: str, params: list[Any]) -> Any:
        lmq = self.lmq
        if method == "authenticate":
            try:
                self.who = await login(self.cfg.users, _str(params, 0, "user"), _str(params, 1, "password"),
                                       self.source, lmq.vhost.name, "LMQ RPC")
            except TooManyFailures as exc:
                raise RPCError(str(exc)) from None
            self._close_at_expiry()
            return "ok"
        who = self.who
        if who is None and not self.cfg.auth:  # anonymous mode: the configured user, looked up now
            try:
                who = anonymous(self.cfg.users, self.cfg.anonymous_user, self.source, lmq.vhost.name)
            except Refused:
                who = None
        if who is None:
            raise RPCError("not authenticated: call authenticate(user, password) first")
        if method == "push":
            await lmq.put(_str(params, 0, "name"), self._packed(params, 1), COMPOUND_TYPE, who)
            return "ok"
        if method == "push_all":
            matcher = lmq.matcher(_str(params, 0, "regexp"), who)
            who.write()
            body = self._packed(params, 1)
            for q in await matcher.queues():
                await lmq.put(q.name, body, COMPOUND_TYPE, who)
            return "ok"
        if method == "pull":
            return _pulled(await lmq.take(_str(params, 0, "name"), _timeout(params, 1), who, self.alive))
        if method == "pull_any":
            regex = _str(params, 0, "regexp")
            return _pulled(await lmq.take_any(regex, _timeout(params, 1), who, self.alive))
        if method in ("done", "retain", "release"):
            kind = {"done": "ack", "retain": "ext", "release": "nack"}[method]
            lmq.settle(kind, _str(params, 0, "name"), _str(params, 1, "id"), who)
            return "ok"
        if method == "delete":
            lmq.delete(_str(params, 0, "name"), who)
            return "ok"
        if method == "update_props":
            name = _str(params, 0, "name")
            who.configure(name)
            props = validate(params[1] if len(params) > 1 and params[1] is not None else {}, RPC_ALIASES)
            lmq.ensure(name, who)
            lmq.props.update_queue(name, props, replace=True)
            return "ok"
        if method == "set_default_props":
            who.set_policy()
            lmq.props.set_defaults(validate_defaults(params[0] if params else None, RPC_ALIASES))
            return "ok"
        if method == "get_default_props":
            return [[regex, {("pack" if k == "accum" else k): v for k, v in props.items()}]
                    for regex, props in lmq.props.defaults]
        raise RPCError(f"unknown method '{method}'")

    @staticmethod
    def _packed(params: list[Any], i: int) -> bytes:
        if len(params) <= i:
            raise RPCError("content is missing")
        return bytes(msgpack.packb(params[i], use_bin_type=True))

    async def answer(self, msgid: Any, method: Any, params: Any, size: int) -> None:
        error: Any = None
        result: Any = None
        try:
            async with admitted_bytes(self.cfg.gate, size, self.cfg.request_timeout):
                if not isinstance(method, str) or not isinstance(params, list):
                    raise RPCError("a request is [0, msgid, method (string), params (array)]")
                result = await self.call(method, params)
        except (RPCError, PropsError) as exc:
            error = str(exc)
        except (LMQError, Refused) as exc:
            error = exc.reason
        except errors.AMQPError as exc:
            error = exc.reply_text
        except Exception:  # noqa: BLE001 - a bug: answer the client, keep the connection and the broker
            log.exception("LMQ RPC %r failed", method)
            error = "internal error (logged by the broker)"
        finally:
            self.in_flight -= size
        if msgid is not None and not self.writer.is_closing():
            self.writer.write(msgpack.packb([RESPONSE, msgid, error, result], use_bin_type=True))

    def dispatch(self, obj: Any, size: int) -> None:
        if not isinstance(obj, list) or not obj:
            raise RPCError("not a MessagePack-RPC message")
        if obj[0] == REQUEST and len(obj) == 4:
            coro = self.answer(obj[1], obj[2], obj[3], size)
        elif obj[0] == NOTIFY and len(obj) == 3:
            coro = self.answer(None, obj[1], obj[2], size)
        else:
            raise RPCError("not a MessagePack-RPC request or notification")
        self.in_flight += size
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        self._update_room()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._update_room()

    def _update_room(self) -> None:
        if len(self.tasks) < self.cfg.max_pipelined and self.in_flight < self.cfg.max_bytes_in_flight:
            self.room.set()
        else:
            self.room.clear()

    async def wait_for_room(self) -> None:
        """Until another request may be read: its client reads its answers (the transport's
        write buffer drains) and fewer than the caps are in progress."""
        await self.writer.drain()
        while not self.room.is_set():
            await self.room.wait()


async def serve_connection(lmq: LMQ, cfg: Settings, live: set[Session], reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
    """Serve one connection; its session is in ``live`` while it runs, so that the server's stop
    (the node shut down, or LMQ's vhost closed as a shard moved) ends it (``Session.close``)."""
    session = Session(lmq, cfg, writer)
    live.add(session)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=lmq.max_message_size + FRAMING)
    try:
        while True:
            await session.wait_for_room()
            try:
                async with asyncio.timeout(cfg.request_timeout):
                    data = await reader.read(65536)
            except TimeoutError:
                if session.tasks:  # a long pull is not idleness
                    continue
                log.info("LMQ RPC client %s idle for %ds: closing", session.source, cfg.request_timeout)
                break
            if not data:
                break
            unpacker.feed(data)
            start = unpacker.tell()
            for obj in unpacker:
                end = unpacker.tell()
                session.dispatch(obj, end - start)
                start = end
    except (RPCError, ValueError, msgpack.UnpackException) as exc:
        log.info("LMQ RPC client %s sent bad data (%s): closing", session.source, exc)
    except ConnectionError:
        pass
    finally:
        live.discard(session)
        session.close()
