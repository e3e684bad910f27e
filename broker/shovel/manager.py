"""The node's shovels: one ``Link`` per ``shovel`` parameter, started, stopped and restarted as
the parameters change.

Theory of operation
-------------------
The node builds ``Shovels`` where it builds the broker, so shovels run wherever the broker
runs: on a single node, and in a cluster on the leader only (a follower runs no broker; its
management port is proxied to the leader, so its API shows the leader's shovels). The
parameters live in ``parameters.json`` (``broker/auth/parameters.py``), replicated like every
other file, so a follower that takes over starts the same shovels from their last settled
position: a queue source redelivers what was not acked, and a stream source resumes from the
offset stored for the shovel's consumer tag (``src-consumer-args`` ``x-stream-offset`` applies to
a shovel's first run only; the ``resumed`` flag beside the parameter remembers that one ran).

Pause (LavinMQ's ``PUT /api/shovels/{vhost}/{name}/pause`` and ``.../resume``) stops the link and
keeps ``paused`` beside the parameter, so a paused shovel stays paused across a restart and a
failover; restart (RabbitMQ's ``DELETE /api/shovels/vhost/{vhost}/{name}/restart``) stops the
link and starts it again at once, skipping any reconnect wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from broker.auth.parameters import RuntimeParameters
from broker.shovel import definition
from broker.shovel.amqp_dest import AmqpDestination
from broker.shovel.amqp_source import AmqpSource
from broker.shovel.definition import ShovelDef
from broker.shovel.ends import Destination, Source
from broker.shovel.link import Link
from broker.shovel.local import Local, LocalDestination, LocalSource

log = logging.getLogger(__name__)

COMPONENT = "shovel"
STREAM_OFFSET = "x-stream-offset"


def consumer_tag(d: ShovelDef) -> str:
    """Stable across runs, restarts and failovers: a stream keeps the shovel's offset under it."""
    return f"shovel/{d.vhost}/{d.name}"[:255]


class Shovels:
    def __init__(self, parameters: RuntimeParameters, local: Local, node_name: Callable[[], str]) -> None:
        self.parameters = parameters
        self.local = local
        self.node_name = node_name
        self.links: dict[tuple[str, str], Link] = {}
        self.running = False
        parameters.register(COMPONENT, definition.validate)
        parameters.watch(self._changed)

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start every shovel not paused (once the broker serves)."""
        self.running = True
        for p in self.parameters.list(COMPONENT):
            self._start(p["vhost"], p["name"])

    async def stop(self) -> None:
        self.running = False
        links, self.links = list(self.links.values()), {}
        await asyncio.gather(*(link.stop() for link in links))

    def _changed(self, component: str, vhost: str, name: str, value: Any) -> None:
        if component != COMPONENT or not self.running:
            return
        old = self.links.pop((vhost, name), None)  # a new value starts afresh (not resumed)
        asyncio.get_running_loop().create_task(self._replace(old, vhost, name if value is not None else None))

    async def _replace(self, old: Link | None, vhost: str, name: str | None) -> None:
        if old is not None:
            await old.stop()
        if name is not None and self.running:
            self._start(vhost, name)

    def _start(self, vhost: str, name: str) -> Link | None:
        value = self.parameters.get(COMPONENT, vhost, name)
        if value is None:
            return None
        state = self.parameters.state(COMPONENT, vhost, name)
        try:
            d = definition.parse(vhost, name, value)
        except ValueError as exc:  # stored by an older version, or edited by hand: never stop a boot
            log.error("shovel '%s' in vhost '%s' not started: %s", name, vhost, exc)
            return None
        def started() -> None:
            self.parameters.set_state(COMPONENT, vhost, name, resumed=True)

        link = Link(d, self._ends, resumed=bool(state.get("resumed")), on_started=started,
                    on_done=lambda: self._done(vhost, name))
        self.links[(vhost, name)] = link
        if state.get("paused"):
            link.state = "paused"
        else:
            link.start()
        return link

    def _done(self, vhost: str, name: str) -> None:
        """src-delete-after reached: the shovel deletes itself (RabbitMQ does the same)."""
        log.info("shovel '%s' in vhost '%s' moved what src-delete-after asked: deleting it", name, vhost)
        asyncio.get_running_loop().call_soon(self.parameters.delete, COMPONENT, vhost, name)

    def _ends(self, d: ShovelDef, resumed: bool) -> tuple[Source, Destination]:
        owner = self.parameters.owner(COMPONENT, d.vhost, d.name)
        args = dict(d.consumer_args)
        if resumed:
            args.pop(STREAM_OFFSET, None)  # resume from the offset the stream keeps for the tag
        tag = consumer_tag(d)
        src: Source = LocalSource(d, self.local, owner, tag, args) if d.src_uris[0].local \
            else AmqpSource(d, tag, args)
        dest = d.dest_uris[0]
        if dest.http:  # aiohttp's client, imported when first needed (its import costs a boot)
            from broker.shovel.http_dest import HttpDestination
            return src, HttpDestination(d)
        dst: Destination = \
            LocalDestination(d, self.local, owner) if dest.local else AmqpDestination(d)
        return src, dst

    # ------------------------------------------------------- what the API asks
    def status(self, vhost: str | None = None) -> list[dict[str, Any]]:
        out = []
        for (v, _name), link in sorted(self.links.items()):
            if vhost in (None, v):
                out.append({"node": self.node_name(), **link.status()})
        return out

    def restart(self, vhost: str, name: str) -> bool:
        if (vhost, name) not in self.links:
            return False
        old = self.links.pop((vhost, name))
        asyncio.get_running_loop().create_task(self._replace(old, vhost, name))
        return True

    def pause(self, vhost: str, name: str) -> bool:
        return self._pause(vhost, name, True)

    def resume(self, vhost: str, name: str) -> bool:
        return self._pause(vhost, name, False)

    def _pause(self, vhost: str, name: str, paused: bool) -> bool:
        if not self.parameters.set_state(COMPONENT, vhost, name, paused=paused):
            return False
        return self.restart(vhost, name) if self.running else True
