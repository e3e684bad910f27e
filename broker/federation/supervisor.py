"""The links this broker should run, kept equal to what its parameters and policies say.

Theory of operation
-------------------
``Federation`` owns every link of the node. ``reconcile`` computes the wanted set, for each vhost
that has a policy with ``federation-upstream`` or ``federation-upstream-set`` in it: every
exchange (other than the default and ``amq.*`` ones) and every queue (other than exclusive
ones) whose effective policy names an upstream or a set gets one link per upstream. It then stops
the links nobody wants any more (a policy or parameter removed, an exchange or queue deleted)
and starts the new ones; a link whose upstream's parameters changed is restarted with them.

It runs when the parameters change (``RuntimeParameters.watch``) and every
``RECONCILE_INTERVAL`` seconds, which is what notices policy changes and new or deleted
exchanges and queues: the policy machinery has no change event for other front ends. A vhost
without a federation policy costs one look at its policies per interval; one with a federation
policy has its names matched again only when its policies or its numbers of exchanges and queues
changed, and at least every ``FULL_SCAN_INTERVAL`` seconds (a link whose exchange or queue was
deleted notices it itself). A policy that
names an upstream or set that does not exist shows as a link in status ``error`` with the
reason, without a task.

Only a serving node runs this (a cluster's leader: followers run no broker), so after a failover
the new leader starts every link again from the replicated parameters and policies; with
``on-confirm`` what was in flight comes again from the upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from broker.auth.parameters import RuntimeParameters
from broker.federation.upstream import (
    UPSTREAM,
    UPSTREAM_SET,
    Upstream,
    check_upstream,
    check_upstream_set,
    resolve,
)
from broker.model.vhost import VHost

if TYPE_CHECKING:
    from broker.federation.link import AfterSync, Link

log = logging.getLogger(__name__)

RECONCILE_INTERVAL = 0.5  # seconds: how soon a policy change or a new exchange gets its link
FULL_SCAN_INTERVAL = 5.0  # seconds between full matches of a vhost's names when nothing counted changed

Key = tuple[str, str, str, str]  # kind, vhost, resource, upstream


def register(params: RuntimeParameters) -> None:
    """Make the two federation components known to the parameters store."""
    params.register(UPSTREAM, lambda _vhost, _name, value: check_upstream(value))
    params.register(UPSTREAM_SET, lambda _vhost, _name, value: check_upstream_set(value))


def _federated(definition: dict[str, Any] | None) -> bool:
    return bool(definition) and (UPSTREAM in definition or UPSTREAM_SET in definition)  # type: ignore[operator]



def _link_type(kind: str) -> type[Link]:
    """The link class for ``kind``, imported when the first link starts: the links bring the link
    layer and pamqp's commands, time off every broker's start, and most brokers federate nothing."""
    from broker.federation.exchange_link import ExchangeLink
    from broker.federation.queue_link import QueueLink
    return ExchangeLink if kind == "exchange" else QueueLink

class Federation:
    def __init__(self, vhosts: Mapping[str, VHost], params: RuntimeParameters, after_sync: AfterSync,
                 cluster_name: Callable[[], str], node_name: Callable[[], str]) -> None:
        self.vhosts = vhosts
        self.params = params
        self.after_sync = after_sync
        self.cluster_name = cluster_name
        self.node_name = node_name
        self.links: dict[Key, Link] = {}
        self.broken: dict[tuple[str, str, str], dict[str, Any]] = {}  # policy names a missing upstream
        self._scans: dict[str, tuple[Any, float, list[tuple[str, str, dict[str, Any]]]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        params.watch(self._changed)

    def _changed(self, component: str, vhost: str, name: str, value: Any) -> None:
        self._wake.set()  # any parameter: the next pass reconciles

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="federation")

    async def stop(self) -> None:
        self.params.unwatch(self._changed)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        links, self.links = self.links, {}
        await asyncio.gather(*(link.stop() for link in links.values()))

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end federation for good
                log.exception("federation: reconcile failed")
            try:
                async with asyncio.timeout(RECONCILE_INTERVAL):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    def wanted(self) -> dict[Key, tuple[VHost, Upstream]]:
        out: dict[Key, tuple[VHost, Upstream]] = {}
        self.broken = {}
        for vname, vh in list(self.vhosts.items()):
            pols = vh.policy_set.policies
            if not any(_federated(p.definition) for p in pols.values()):
                continue
            upstreams = {e["name"]: e["value"] for e in self.params.list(UPSTREAM, vname)}
            sets = {e["name"]: e["value"] for e in self.params.list(UPSTREAM_SET, vname)}
            for kind, name, definition in self._targets(vh):
                found, reason = resolve(definition, upstreams, sets)
                for up in found:
                    out[(kind, vname, name, up.name)] = (vh, up)
                if reason is not None:
                    self.broken[(kind, vname, name)] = {
                        "node": self.node_name(), "vhost": vname, "type": kind, kind: name,
                        "upstream": definition.get(UPSTREAM) or definition.get(UPSTREAM_SET),
                        "status": "error", "error": reason,
                        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S")}
        return out

    def _targets(self, vh: VHost) -> list[tuple[str, str, dict[str, Any]]]:
        """The exchanges and queues of ``vh`` whose policy federates them, with that policy's
        definition. Matching every name against the policies is the costly part (a vhost of
        50,000 queues), so it is redone only when the policies or the number of exchanges or
        queues changed, or ``FULL_SCAN_INTERVAL`` passed (a queue deleted and another declared)."""
        key = (tuple(id(p) for p in vh.policy_set.policies.values()), len(vh.exchanges), len(vh.queues))
        cached = self._scans.get(vh.name)
        now = time.monotonic()
        if cached is not None and cached[0] == key and now - cached[1] < FULL_SCAN_INTERVAL:
            return cached[2]
        out: list[tuple[str, str, dict[str, Any]]] = []
        for ex in list(vh.exchanges.values()):
            if ex.name and not ex.name.startswith("amq."):
                pol = vh.policy_set.for_exchange(ex.name)
                if pol is not None and _federated(pol.definition):
                    out.append(("exchange", ex.name, pol.definition))
        for q in list(vh.queues.values()):
            if q.exclusive_owner is None and not q.deleted:
                qpol, _ = vh.policy_set.for_queue(q.name)
                if qpol is not None and _federated(qpol.definition):
                    out.append(("queue", q.name, qpol.definition))
        self._scans[vh.name] = (key, now, out)
        return out

    async def reconcile(self) -> None:
        want = self.wanted()
        stale = [k for k, link in self.links.items()
                 if k not in want or link.upstream != want[k][1] or link.vhost is not want[k][0]]
        for key in stale:
            link = self.links.pop(key)
            log.info("federation: stopping link %s", key)
            await link.stop()
        for key, (vh, up) in want.items():
            if key in self.links:
                continue
            kind, _, resource, _ = key
            link = _link_type(kind)(vh, resource, up, self.after_sync, self.cluster_name(), self.node_name(),
                                    self.vhosts)
            self.links[key] = link
            log.info("federation: starting link %s", key)
            link.start()

    def status(self, vhost: str | None = None) -> list[dict[str, Any]]:
        """``GET /api/federation-links`` entries, RabbitMQ's shape."""
        out = [link.to_json() for key, link in sorted(self.links.items()) if vhost in (None, key[1])]
        out += [e for key, e in sorted(self.broken.items()) if vhost in (None, key[1])]
        return out
