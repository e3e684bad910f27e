"""LMQ's MessagePack-RPC interface (default port 18800).

Wire format (MessagePack-RPC): a request is ``[0, msgid, method, params]`` and is answered with
``[1, msgid, error, result]``; a notification ``[2, method, params]`` gets no answer. Requests on
one connection run concurrently (a long ``pull`` does not hold up a ``done``), answers carry
their msgid. Methods, as LMQ names them: ``push``, ``pull``, ``pull_any``, ``push_all``,
``done``, ``retain``, ``release``, ``delete``, ``update_props``, ``set_default_props``,
``get_default_props``. Contents are any MessagePack value (stored MessagePack-encoded, content
type ``application/x-msgpack``); LMQ's RPC keeps the older names ``pack`` for ``accum`` and
``package`` for a compound message. An error is a string naming the problem. With ``[lmq] auth``
on, the first call on a connection must be ``authenticate(user, password)``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgpack

from broker.auth.throttle import TooManyFailures
from broker.auth.users import UserStore
from broker.lmq.engine import COMPOUND_TYPE, LMQ, LMQError, Message, Peer, admitted, client_address
from broker.lmq.props import PropsError, validate, validate_defaults

log = logging.getLogger(__name__)

REQUEST, RESPONSE, NOTIFY = 0, 1, 2
RPC_ALIASES = {"pack": "accum"}
MAX_BUFFER = 128 * 1024 * 1024


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
    def __init__(self, lmq: LMQ, users: UserStore | None, writer: asyncio.StreamWriter,
                 peers: Mapping[Peer, Peer]) -> None:
        self.lmq = lmq
        self.users = users
        self.writer = writer
        self.peers = peers
        self.authenticated = users is None
        self.tasks: set[asyncio.Task[None]] = set()

    async def call(self, method: str, params: list[Any]) -> Any:
        lmq = self.lmq
        if not self.authenticated:
            if method != "authenticate":
                raise RPCError("not authenticated: call authenticate(user, password) first")
            assert self.users is not None
            source = client_address(self.peers, self.writer.transport)
            try:
                ok = await admitted(self.users, _str(params, 0, "user"), _str(params, 1, "password"), source,
                                    lmq.vhost.name, "LMQ RPC")
            except TooManyFailures as exc:
                raise RPCError(str(exc)) from None
            if not ok:
                raise RPCError("login failed")
            self.authenticated = True
            return "ok"
        if method == "authenticate":
            return "ok"
        if method == "push":
            await lmq.put(_str(params, 0, "name"), self._packed(params, 1), COMPOUND_TYPE)
            return "ok"
        if method == "push_all":
            body = self._packed(params, 1)
            for q in lmq.matching(_str(params, 0, "regexp")):
                await lmq.put(q.name, body, COMPOUND_TYPE)
            return "ok"
        if method == "pull":
            q = lmq.ensure(_str(params, 0, "name"))
            return _pulled(await lmq.take(lambda: [q], _timeout(params, 1)))
        if method == "pull_any":
            regex = _str(params, 0, "regexp")
            lmq.matching(regex)
            return _pulled(await lmq.take(lambda: lmq.matching(regex), _timeout(params, 1)))
        if method in ("done", "retain", "release"):
            name, msg_id = _str(params, 0, "name"), _str(params, 1, "id")
            {"done": lmq.ack, "retain": lmq.extend, "release": lmq.nack}[method](name, msg_id)
            return "ok"
        if method == "delete":
            lmq.delete(_str(params, 0, "name"))
            return "ok"
        if method == "update_props":
            name = _str(params, 0, "name")
            props = validate(params[1] if len(params) > 1 and params[1] is not None else {}, RPC_ALIASES)
            lmq.ensure(name)
            lmq.props.update_queue(name, props, replace=True)
            return "ok"
        if method == "set_default_props":
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

    async def answer(self, msgid: Any, method: Any, params: Any) -> None:
        error: Any = None
        result: Any = None
        try:
            if not isinstance(method, str) or not isinstance(params, list):
                raise RPCError("a request is [0, msgid, method (string), params (array)]")
            result = await self.call(method, params)
        except (RPCError, LMQError, PropsError) as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - answer the client, keep the connection and the broker
            log.exception("LMQ RPC %r failed", method)
            error = f"internal error: {exc}"
        if msgid is not None and not self.writer.is_closing():
            self.writer.write(msgpack.packb([RESPONSE, msgid, error, result], use_bin_type=True))

    def dispatch(self, obj: Any) -> None:
        if not isinstance(obj, list) or not obj:
            raise RPCError("not a MessagePack-RPC message")
        if obj[0] == REQUEST and len(obj) == 4:
            coro = self.answer(obj[1], obj[2], obj[3])
        elif obj[0] == NOTIFY and len(obj) == 3:
            coro = self.answer(None, obj[1], obj[2])
        else:
            raise RPCError("not a MessagePack-RPC request or notification")
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def serve_connection(lmq: LMQ, users: UserStore | None, peers: Mapping[Peer, Peer],
                           reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    session = Session(lmq, users, writer, peers)
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BUFFER)
    try:
        while data := await reader.read(65536):
            unpacker.feed(data)
            for obj in unpacker:
                session.dispatch(obj)
    except (RPCError, ValueError, msgpack.UnpackException) as exc:
        log.info("LMQ RPC client %s sent bad data (%s): closing", writer.get_extra_info("peername"), exc)
    except ConnectionError:
        pass
    finally:
        for task in list(session.tasks):
            task.cancel()
        writer.close()
