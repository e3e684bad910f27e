"""The cluster leader's management API for a vhost another node serves (``[clustering]
shard_servers``): the request is answered by that node.

Theory of operation
-------------------
A request about one vhost (its route names ``{vhost}``) that another node serves goes to that
node's shard broker: ``open_to`` (``broker/cluster/elsewhere.py``) gives a connection to that
node's management listener, carried on a tunnel to its replication port that names the client's
own address (so a loopback-only user stays loopback-only there). The request is passed on as it
came (method, path and query, body, and the client's own ``Authorization``, ``Content-Type`` and
``Accept``) as HTTP/1.1 with ``Connection: close``; that node authenticates and authorizes it as if
the client had asked it directly, so forwarding grants nothing, and its answer (status, body,
and the headers ``http.common.PASSED_BACK`` names, the list the workers' fan-out passes back too,
Retry-After among them) is the client's. The shared state (users,
permissions, the vhost list, global and runtime parameters: ``SHARED``) is the cluster
leader's, so those paths are answered here whatever vhost they name. A whole answer
(``WHOLE``: the node-wide lists, ``LISTS``, ``/api/overview``, ``/metrics`` and its forms, the
whole definitions) is this node's answer (which also checks the user may have it) put together
with every other serving node's part (``open_nodes``, asked with the client's own
``Authorization``; ``broker.http.aggregate``): lists concatenated (each shard broker lists only
the vhosts it serves, so nothing comes twice), and a list to be arranged (a page, a sort,
columns) asked whole of every node and then filtered, sorted and cut once joined; the overview's
counts added; metrics samples of one name and labels added, a node's own process series the
answering node's; definitions merged. The cluster leader's metrics port (no login) asks each
serving node's metrics port instead (``codec.METRICS_PORT``). A part missing (a node that does
not answer, a vhost moving) is said, never under-counted: 503 naming it, and the overview, which
the UI shows whatever happens, answers with ``partial`` naming it; its ``listeners`` are every
serving member's client ports (each member's own list). ``GET /api/nodes`` is one entry per
member, each that member's own answer (``open_members``: every live member, not only those
serving; and those heard from before, by the name they gave), sorted and paged once joined; a
member that does not answer in ``NODES_TIMEOUT`` (down; or serving no shard, so with no
management API of its own) is listed ``running: false``, as RabbitMQ lists a stopped node;
``/api/nodes/{node}`` and below are that member's answer. A whole import
(``POST /api/definitions``) naming vhosts another node serves goes whole to that node when it is
one node and the document holds only their topology (queues, exchanges, bindings, policies,
parameters): its import is the all-or-nothing one. One whose vhosts span nodes, or that also
holds shared state (users, permissions, vhosts: the cluster leader's to write), is refused
(501) before anything happens, since an import is all or nothing on one node only; per vhost
(``/api/definitions/{vhost}``) it goes to the node serving it.

Bounds: the answer is at most ``MAX_ANSWER`` bytes and the whole exchange ``FORWARD_TIMEOUT``
seconds. A vhost moving (closed here, its next server not known yet), a node that cannot be
reached, or an answer that does not parse: 503, as for a worker that restarts, when the
request had not been passed on yet (or only asked for something: GET, HEAD), so that it did not
happen. A change passed on whose answer then failed may have happened there: 504, which says its
outcome is not known, never an error that would claim it did not happen.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from broker import errors
from broker.http.aggregate import add_counts, merge_exports, merge_metrics, named_vhosts, partial
from broker.http.common import MGMT_KEY, PASSED_ON, error_response, paginate, passed_back, require_monitor

log = logging.getLogger(__name__)

FORWARD_TIMEOUT: Final = 30.0
MAX_ANSWER: Final = 64 * 1024 * 1024  # bytes of a forwarded answer (a long queue list fits)
# the requests about the cluster's shared state, answered where they land
# (a vhost's definitions, ``/api/definitions/{vhost}``, are its queues, exchanges, bindings and
# policies: that node's)
SHARED: Final = ("/api/users", "/api/permissions", "/api/topic-permissions", "/api/vhosts",
                 "/api/global-parameters", "/api/user-limits", "/api/parameters")
CLIENTS: Final = ("/connections", "/channels")  # /api/vhosts/{vhost}/...: that node's clients

# the node-wide lists: this node's part and every other serving node's
LISTS: Final = frozenset({"/api/queues", "/api/exchanges", "/api/bindings", "/api/connections",
                          "/api/channels", "/api/consumers"})
OVERVIEW: Final = "/api/overview"
NODES: Final = "/api/nodes"  # and /api/nodes/{node}: every member's own, asked of it
NODES_TIMEOUT: Final = 5.0  # seconds a member has to say how it is, else it is listed not running
DEFINITIONS: Final = "/api/definitions"
METRICS: Final = frozenset({"/metrics", "/metrics/detailed", "/metrics/per-object"})
WHOLE: Final = LISTS | METRICS | {OVERVIEW, DEFINITIONS}  # answered for every shard of the cluster
PAGED: Final = frozenset({"page", "page_size", "columns"})  # cut from the joined list, not the parts
ARRANGED: Final = PAGED | {"sort", "sort_reverse"}  # a list arranged once joined
# a definitions document's keys about the shared state (the cluster leader's files)
SHARED_KEYS: Final = ("users", "vhosts", "permissions", "topic_permissions", "global_parameters")

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# a connection to the management API of the node serving ``vhost`` for the client at ``peer``;
# None: served here; raises ``errors.NotAllowed`` while it moves
OpenTo = Callable[[str, tuple[str, int]], Awaitable[Streams | None]]
# a connection to the management API of each other node serving a vhost, for the client
# and the vhosts moving (their part nobody can give now)
OpenNodes = Callable[[tuple[str, int]], Awaitable[tuple[list[tuple[str, Streams]], list[str]]]]
# a connection to the management API of every other live member, for the client, by node id
OpenMembers = Callable[[tuple[str, int]], Awaitable[list[tuple[str, Streams]]]]


def unavailable(reason: str) -> web.Response:
    return error_response(503, "service_unavailable", reason)


def outcome_unknown(reason: str) -> web.Response:
    return error_response(504, "gateway_timeout",
                          f"{reason}; the request was passed on and may have been applied")


def request_bytes(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
    """An HTTP/1.1 request closing its connection after the answer."""
    head = [f"{method} {target} HTTP/1.1", "Host: skred", "Connection: close",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Read:
    """What ``http.client.HTTPResponse`` reads an answer from: the bytes already read."""

    def __init__(self, data: bytes) -> None:
        self._file = io.BytesIO(data)

    def makefile(self, *_args: Any, **_kw: Any) -> io.BytesIO:
        return self._file


def parse_answer(data: bytes) -> web.Response:
    """A whole HTTP/1.1 answer (read to its connection's end) as the client's answer."""
    got = http.client.HTTPResponse(_Read(data))  # type: ignore[arg-type]
    got.begin()
    body = got.read()
    return web.Response(body=body, status=got.status, headers=passed_back(got.getheaders()))


def _client(request: web.Request) -> tuple[str, int]:
    """The client's address (a follower's tunnel or a PROXY header: the one they named)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else (request.remote or "", 0)


class VhostForward:
    """The cluster leader's middleware for the vhosts other nodes serve (see the module's comment)."""

    def __init__(self, open_to: OpenTo, open_nodes: OpenNodes | None = None,
                 elsewhere: Callable[[str], str | None] | None = None,
                 open_members: OpenMembers | None = None) -> None:
        self.open_to = open_to
        self.open_nodes = open_nodes
        self.elsewhere = elsewhere
        self.open_members = open_members
        self.names: dict[str, str] = {}  # each member's node name by node id, as it last said

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        vhost = request.match_info.get("vhost")
        if request.path.startswith(NODES) and request.method == "GET" and self.open_members is not None:
            return await self.nodes(request, handler, self.open_members)
        if vhost is None and request.path in WHOLE and request.method == "GET" \
                and self.open_nodes is not None:
            return await self.whole(request, handler, self.open_nodes)
        if vhost is None and request.path == DEFINITIONS and request.method == "POST" \
                and self.elsewhere is not None:
            elsewhere = await self.import_elsewhere(request, self.elsewhere)
            if elsewhere is not None:
                return elsewhere
        if vhost is None or request.path.startswith(SHARED) and not request.path.endswith(CLIENTS):
            answer: web.StreamResponse = await handler(request)
            return answer
        there = await self.to_server(request, vhost)
        if there is not None:
            return there
        here: web.StreamResponse = await handler(request)  # served here
        return here

    async def to_server(self, request: web.Request, vhost: str) -> web.Response | None:
        """The answer of the node serving ``vhost`` to ``request``; None when it is served here."""
        failed = unavailable
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                streams = await self.open_to(vhost, _client(request))
                if streams is None:
                    return None
                if request.method not in ("GET", "HEAD"):
                    failed = outcome_unknown  # from here on it may reach that node
                return await self._exchange(request, streams)
        except errors.NotAllowed as exc:
            return unavailable(exc.reply_text)
        except TimeoutError:
            return failed(f"the node serving vhost '{vhost}' did not answer")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return failed(f"the node serving vhost '{vhost}': {exc or type(exc).__name__}")

    async def whole(self, request: web.Request, handler: Any, open_nodes: OpenNodes) -> web.StreamResponse:
        """``WHOLE``: this node's answer (which also checks the user may have it) and each other
        serving node's part, put together (``broker.http.aggregate``). A list to be arranged
        (``ARRANGED``: a page, a sort, columns) is asked whole of every node and arranged once
        joined. A part missing (a node that does not answer, a vhost moving) makes the answer
        503 naming it, except the overview's, which says so in ``partial``."""
        arranged = request.path in LISTS and bool(ARRANGED & set(request.query))
        asked = request.clone(rel_url=request.rel_url.with_query(
            {k: v for k, v in request.query.items() if k not in PAGED})) if arranged else request
        mine: web.StreamResponse = await handler(asked)
        if not isinstance(mine, web.Response) or mine.status != 200 or not isinstance(mine.body, bytes):
            return mine
        parts, missing = await self.parts(asked, open_nodes)
        if request.path in METRICS:
            if missing:
                return partial(missing)
            text = merge_metrics([mine.body.decode(), *(p.decode() for p in parts)], nodes=True)
            return web.Response(body=text.encode(), headers={"Content-Type": mine.headers["Content-Type"]})
        doc = json.loads(mine.body)
        others = [json.loads(p) for p in parts]
        if request.path == OVERVIEW:
            for other in others:
                if isinstance(other, dict):
                    add_counts(doc, other)
                    listed = other.get("listeners")  # that member's client ports
                    doc["listeners"].extend(listed if isinstance(listed, list) else [])
            if missing:
                doc["partial"] = missing
            return web.json_response(doc)
        if missing:
            return partial(missing)
        if request.path == DEFINITIONS:
            kept = {k: v for k, v in mine.headers.items() if k == "Content-Disposition"}
            return web.json_response(merge_exports(doc, [o for o in others if isinstance(o, dict)]),
                                     dumps=lambda d: json.dumps(d, indent=2), headers=kept)
        items: list[Any] = doc if isinstance(doc, list) else []
        for other in others:
            items.extend(other if isinstance(other, list) else [])
        return paginate(request, items) if arranged else web.json_response(items)

    async def nodes(self, request: web.Request, handler: Any, open_members: OpenMembers
                    ) -> web.StreamResponse:
        """``GET /api/nodes`` (every member, each as it says it is: its ``/api/nodes``, then
        sorted and paged once joined) and ``/api/nodes/{node}`` and below (that member's
        answer). A member that does not answer within ``NODES_TIMEOUT`` (down, its lease not
        expired yet; or gone since it was last heard from) is listed ``running: false``, as
        RabbitMQ lists a stopped node of its cluster; a member serving no shard has no
        management API of its own (its proxies tunnel to this node's) and is listed so too."""
        require_monitor(request)  # before any member is asked (each checks it again)
        name = request.match_info.get("node")
        if name is not None and name == request.app[MGMT_KEY].listed_name:
            mine: web.StreamResponse = await handler(request)  # this node's
            return mine
        asked = request.clone(rel_url=request.rel_url.with_query(
            {k: v for k, v in request.query.items() if k not in ARRANGED})) if name is None else request
        if name is None:
            mine = await handler(asked)  # also checks the user may list nodes
            if not isinstance(mine, web.Response) or mine.status != 200 or not isinstance(mine.body, bytes):
                return mine
        answers = await self._members(asked, open_members)
        if name is not None:
            for answer in answers.values():
                if answer is not None and answer.status == 200:
                    return answer
            if request.path == f"{NODES}/{name}" and name in self.names.values():
                return web.json_response(_down(name))
            missed: web.StreamResponse = await handler(request)  # 404 (or 401/403 first)
            return missed
        assert isinstance(mine, web.Response) and isinstance(mine.body, bytes)
        items: list[Any] = json.loads(mine.body)
        for node_id in sorted(answers.keys() | self.names.keys()):
            answer = answers.get(node_id)
            doc = json.loads(answer.body) if answer is not None and isinstance(answer.body, bytes) else None
            if isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict):
                self.names[node_id] = str(doc[0].get("name", node_id))
                items.extend(doc)
            else:
                items.append(_down(self.names.get(node_id, node_id)))
        return paginate(request, items)

    async def _members(self, request: web.Request, open_members: OpenMembers
                       ) -> dict[str, web.Response | None]:
        """Every other live member's answer to ``request`` (None: none within ``NODES_TIMEOUT``)."""
        async def answer(streams: Streams) -> web.Response | None:
            try:
                async with asyncio.timeout(NODES_TIMEOUT):
                    got = await self._exchange(request, streams)
            except (OSError, TimeoutError, http.client.HTTPException, ValueError):
                return None
            return got if got.status < 500 else None

        try:
            async with asyncio.timeout(NODES_TIMEOUT):
                members = await open_members(_client(request))
        except (OSError, TimeoutError) as exc:
            log.warning("%s: the members cannot be asked: %s", request.path, exc)
            return {}
        found = await asyncio.gather(*(answer(s) for _, s in members))
        return {node_id: got for (node_id, _), got in zip(members, found, strict=True)}

    async def parts(self, request: web.Request, open_nodes: OpenNodes) -> tuple[list[bytes], list[str]]:
        """Every other serving node's answer to ``request`` (a 200's body), each in
        ``FORWARD_TIMEOUT``; and what is missing, said for a client."""
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                nodes, moving = await open_nodes(_client(request))
        except (OSError, TimeoutError) as exc:
            return [], [f"the other serving nodes' parts: {exc or type(exc).__name__}"]

        async def part(streams: Streams) -> web.Response:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                return await self._exchange(request, streams)

        answers = await asyncio.gather(*(part(s) for _, s in nodes), return_exceptions=True)
        got: list[bytes] = []
        missing = [f"vhost {v!r}: moving to another node" for v in moving]
        for (name, _), answer in zip(nodes, answers, strict=True):
            if isinstance(answer, web.Response) and answer.status == 200 and isinstance(answer.body, bytes):
                got.append(answer.body)
                continue
            why = f"status {answer.status}" if isinstance(answer, web.Response) else \
                str(answer) or type(answer).__name__
            missing.append(f"the node serving vhost {name}: {why}")
            log.warning("%s: a serving node's part is missing: %s", request.path, missing[-1])
        return got, missing

    async def import_elsewhere(self, request: web.Request, server_of: Callable[[str], str | None]
                               ) -> web.Response | None:
        """A whole import naming vhosts other nodes serve: the answer of that node when it is one
        node and the document holds only those vhosts' topology (its own import is the all or
        nothing one; the shared state, users, permissions and the vhost list, is this node's to
        write), else refused (501) before anything happens; None to import it here."""
        try:
            doc = json.loads(await request.read())
        except ValueError:
            return None  # the handler answers it (400)
        servers: dict[str, list[str]] = {}
        for name in sorted(named_vhosts(doc)):
            try:
                servers.setdefault(server_of(name) or "", []).append(name)
            except errors.NotAllowed as exc:
                return unavailable(exc.reply_text)
        away = {k: v for k, v in servers.items() if k}
        if not away:
            return None
        shared = sorted(k for k in SHARED_KEYS if isinstance(doc, dict) and doc.get(k))
        if len(servers) == 1 and not shared:
            (vhosts,) = away.values()
            return await self.to_server(request, vhosts[0])
        names = ", ".join(repr(v) for vs in away.values() for v in vs)
        why = "its vhosts are served by several nodes" if len(servers) > 1 else \
            f"it also holds {', '.join(shared)}, this node's to write"
        return error_response(501, "not_implemented", (
            f"the document names vhosts other nodes serve ({names}) and {why}; an import is all or "
            "nothing on one node only: import them per vhost (/api/definitions/{vhost}), which goes to "
            "the node serving it"))

    async def _exchange(self, request: web.Request, streams: Streams) -> web.Response:
        reader, writer = streams
        try:
            headers = {h: request.headers[h] for h in PASSED_ON if h in request.headers}
            writer.write(request_bytes(request.method, str(request.rel_url), headers, await request.read()))
            await writer.drain()
            data = bytearray()
            while chunk := await reader.read(64 * 1024):
                data += chunk
                if len(data) > MAX_ANSWER:
                    raise ValueError(f"an answer larger than {MAX_ANSWER} bytes")
            return parse_answer(bytes(data))
        finally:
            writer.close()


def _down(name: str) -> dict[str, Any]:
    """A member that does not answer, as RabbitMQ lists a stopped node of its cluster."""
    return {"name": name, "type": "disc", "running": False, "being_drained": False}
