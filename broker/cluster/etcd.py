"""etcd coordination: lease, election, secret and ISR keys.

Theory of operation
-------------------
Every node holds one lease of ``lease_ttl`` seconds, refreshed every
``refresh_every`` (TTL/3, at most a second) and, after a failed refresh, again
every ``RETRY`` seconds: an etcd outage shorter than the TTL must cost nobody
their lease, so the first refresh after etcd answers again has to come at once,
not a whole interval later. The keep-alive survives reconnects (it uses
whichever client is current). ``lease_alive()`` is judged locally: if no
refresh succeeded for a whole TTL the lease must be presumed expired (etcd may
already have handed leadership to someone else), so a leader stops confirming
without waiting for etcd to say so. The TTL is counted from when a successful
refresh was *sent*: etcd restarted its clock somewhere between sending and the
reply, so counting from the reply could let us believe in a lease etcd has
already expired.

A lease we gave up is revoked; if etcd cannot be reached then, its id is kept
in ``_to_revoke`` and revoked as soon as etcd answers again
(``revoke_pending``). Otherwise a restarted etcd, which renews every lease it
finds for a full TTL, would keep our old leader key alive for one more TTL with
nobody behind it.

Election: ``campaign`` is a transaction "create ``<prefix>/leader`` if it does
not exist, bound to my lease, value = my advertised URI". The key vanishes when
the lease expires or is revoked. The create revision of the won key is the
fencing token: ISR writes are transactions guarded by "the leader key still has
the create revision I got when I won", which holds exactly while my lease
lives. The ISR key itself has no lease (it must survive the leader's death: it
names who may take over).

Secret: ``<prefix>/clustering_secret`` is created put-if-absent with 32 random
bytes, then read back, so every node ends up with the first one written.

Members: each node puts ``<prefix>/members/<node id>`` (JSON: URI, role, and
on the leader its followers' lag) bound to its lease, so the key set is the
set of live nodes; ``skred --cluster-status`` reads it. ``watch`` streams the
changes of one key (the followers' view of the leader key).

Every call has a deadline (aetcd has none by default); a call that fails or
times out raises ``EtcdError``. The loops that retry on it report it through
``Outage``: the first failure is a warning, then while etcd keeps failing one
line every ``WARN_EVERY`` seconds counts the failures since (the loops retry
every 0.2 s: a line each time buried everything else), and the first call that
succeeds again says how long it lasted.

Cancels: a task cancelled while it waits on etcd is cancelled, whatever etcd answers. The
deadline is ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11, when the answer and
the cancel land in the same turn of the event loop, ``wait_for`` returns the answer and drops
the cancel. The per-shard election's loop is stopped by a cancel at SIGTERM and the drain waits
for it; with the cancel dropped the loop ran on, the drain never started, and the node's shards
stayed with it until its lease was revoked (issue 27; ``tests/test_cancel_kept.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import aetcd

log = logging.getLogger(__name__)

T = TypeVar("T")
CALL_TIMEOUT = 2.0
RETRY = 0.25  # seconds between keep-alive attempts after a failed one
# gRPC reconnects with exponential backoff (up to 2 minutes by default): cap it, so a restarted
# etcd is used within a second or so.
CHANNEL_OPTIONS = {"grpc.initial_reconnect_backoff_ms": 100, "grpc.min_reconnect_backoff_ms": 100,
                   "grpc.max_reconnect_backoff_ms": 1000}


WARN_EVERY = 30.0  # seconds between reminders while etcd keeps failing
SHARDS = "shards/"  # per-shard leader keys: <prefix>/shards/<quoted vhost>/leader (broker/shards/leaders.py)
_SHARD_LEADER = "/leader"
_SHARD_ISR = "/isr"  # beside it, the shard's ISR: written with the cluster's (``write_isr``)
# beside it too: the term of the holder the shard's last server handed it to (``release_shard``)
_SHARD_RELEASED = "/released"


def shard_key(vhost: str) -> str:
    """The key (under the prefix) of a vhost's shard leader; quoted, as a name may hold ``/``."""
    return SHARDS + quote(vhost, safe="") + _SHARD_LEADER


def shard_of_key(key: str) -> str | None:
    """The vhost of a shard leader key (named as ``shard_key`` names it), else None."""
    if not key.startswith(SHARDS) or not key.endswith(_SHARD_LEADER):
        return None
    return unquote(key[len(SHARDS):-len(_SHARD_LEADER)])


def shard_isr_key(vhost: str) -> str:
    """The key (under the prefix) of a vhost's shard ISR, beside its leader key."""
    return SHARDS + quote(vhost, safe="") + _SHARD_ISR


def shard_released_key(vhost: str) -> str:
    """The key (under the prefix) naming the term a vhost's shard was last handed over to."""
    return SHARDS + quote(vhost, safe="") + _SHARD_RELEASED


def shard_released(keys: Mapping[str, tuple[bytes, int]], vhost: str) -> int | None:
    """The term ``vhost``'s shard was last released to, from keys as ``get_prefix(SHARDS)``
    returns them (None: never, or unreadable)."""
    found = keys.get(shard_released_key(vhost))
    try:
        return int(found[0]) if found is not None else None
    except ValueError:
        return None


def shard_isr_values(keys: Mapping[str, tuple[bytes, int]]) -> dict[str, bytes]:
    """vhost -> the raw value of its shard ISR key, from keys as ``get_prefix(SHARDS)`` returns them."""
    return {unquote(key[len(SHARDS):-len(_SHARD_ISR)]): raw for key, (raw, _rev) in keys.items()
            if key.startswith(SHARDS) and key.endswith(_SHARD_ISR)}


def shard_isrs(keys: Mapping[str, tuple[bytes, int]]) -> dict[str, list[str]]:
    """vhost -> its shard's ISR, from keys as ``get_prefix(SHARDS)`` returns them (an unreadable
    value is left out: the shard then counts as having none yet)."""
    out: dict[str, list[str]] = {}
    for vhost, raw in shard_isr_values(keys).items():
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, list):
            out[vhost] = [str(v) for v in value]
    return out


def shard_holder(raw: bytes) -> str:
    """The node id a shard leader key's value names ("?" when unreadable: someone holds it)."""
    try:
        record = json.loads(raw)
        return str(record["node_id"])
    except (ValueError, KeyError, TypeError):
        return "?"


def shard_server(raw: bytes) -> str | None:
    """The replication URI of a shard leader that serves its shard (its key's value says
    ``"serves": true``: the per-shard data path, docs/architecture.md), else None."""
    try:
        record = json.loads(raw)
        if record.get("serves") is True:
            return str(record["uri"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


class EtcdError(Exception):
    pass


class Outage:
    """Rate-limited warnings of one etcd outage (see the module's theory of operation)."""

    def __init__(self, every: float = WARN_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.since: float | None = None  # the first failure of the current outage
        self.warned = 0.0
        self.unreported = 0  # failures since the last line

    def failed(self, exc: Exception) -> None:
        now = self.clock()
        if self.since is None:
            self.since = self.warned = now
            log.warning("etcd: %s", exc)
            return
        self.unreported += 1
        if now - self.warned >= self.every:
            log.warning("etcd still failing after %.0fs (%d more failures, the last: %s)",
                        now - self.since, self.unreported, exc)
            self.warned, self.unreported = now, 0

    def answered(self) -> None:
        if self.since is not None:
            log.warning("etcd answers again after %.1fs", self.clock() - self.since)
            self.since, self.unreported = None, 0


class Etcd:
    def __init__(self, endpoints: str, prefix: str, lease_ttl: int) -> None:
        self.endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        self.prefix = prefix.rstrip("/")
        self.ttl = lease_ttl
        self.client: Any = None
        self.lease_id: int | None = None
        self.last_refresh = 0.0
        self.leader_revision = 0
        self._keepalive: asyncio.Task[None] | None = None
        self._to_revoke: set[int] = set()
        self._endpoint = 0
        self.outage = Outage()

    @property
    def refresh_every(self) -> float:
        return min(self.ttl / 3, 1.0)

    def key(self, name: str) -> bytes:
        return f"{self.prefix}/{name}".encode()

    async def _call(self, aw: Awaitable[T], timeout: float = CALL_TIMEOUT, *, answer: bool = True) -> T:
        """``aw`` within ``timeout``, its failure an EtcdError; ``answer``: its success means
        etcd answered (not so a channel's set-up, which never talks to it)."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see "Cancels" above
                result = await aw
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise EtcdError(f"{type(exc).__name__}: {exc}") from exc
        if answer:
            self.outage.answered()
        return result

    async def connect(self) -> None:
        """Connect to the first endpoint that answers (rotating through the list)."""
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            host, _, port = self.endpoints[self._endpoint].rpartition(":")
            self._endpoint = (self._endpoint + 1) % len(self.endpoints)
            client = aetcd.Client(host=host or "127.0.0.1", port=int(port or 2379), timeout=int(CALL_TIMEOUT),
                                  options=CHANNEL_OPTIONS)
            try:
                await self._call(client.connect(), answer=False)
                await self._call(client.status())
            except EtcdError as exc:
                last = exc
                await _quiet_close(client)
                continue
            await self.close()
            self.client = client
            await self.revoke_pending()
            return
        raise EtcdError(f"no etcd endpoint reachable ({last})")

    async def close(self) -> None:
        """Drop the connection (the lease and its keep-alive stay: a reconnect carries on)."""
        if self.client is not None:
            client, self.client = self.client, None
            await _quiet_close(client)

    # ---------------------------------------------------------------- lease
    async def grant_lease(self) -> None:
        sent = time.monotonic()
        lease = await self._call(self.client.lease(self.ttl))
        self.lease_id = int(lease.id)
        self.last_refresh = sent
        if self._keepalive is not None:
            self._keepalive.cancel()
        self._keepalive = asyncio.ensure_future(self._keep_alive(self.lease_id))

    async def _keep_alive(self, lease_id: int) -> None:
        failed = False
        while self.lease_id == lease_id:
            await asyncio.sleep(RETRY if failed else self.refresh_every)
            sent = time.monotonic()
            try:
                if self.client is None:
                    raise EtcdError("not connected")
                reply = await self._call(self.client.refresh_lease(lease_id),
                                         min(CALL_TIMEOUT, self.ttl / 3))
            except EtcdError as exc:
                if not failed:
                    log.warning("lease keepalive failed (retrying every %.2fs): %s", RETRY, exc)
                failed = True
                continue
            if failed:
                log.info("lease keepalive works again")
            failed = False
            if reply is None or int(reply.TTL) <= 0:
                log.error("etcd says our lease %x expired", lease_id)
                if self.lease_id == lease_id:
                    self.lease_id = None
                return
            self.last_refresh = max(self.last_refresh, sent)

    def lease_alive(self) -> bool:
        return self.lease_id is not None and time.monotonic() < self.lease_deadline()

    def lease_deadline(self) -> float:
        """Monotonic time at which our lease must be presumed expired, failing a refresh."""
        return self.last_refresh + self.ttl

    async def revoke(self) -> None:
        """Give up our lease: revoked now if etcd answers, else as soon as it does."""
        lease_id, self.lease_id = self.lease_id, None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if lease_id is not None:
            self._to_revoke.add(lease_id)
        await self.revoke_pending()

    def forget_lease(self, lease_id: int) -> None:
        """Revoke a lease that is not ours to keep (a predecessor's, read from a key)."""
        if lease_id and lease_id != self.lease_id:
            self._to_revoke.add(lease_id)

    async def revoke_pending(self) -> None:
        for lease_id in sorted(self._to_revoke):
            if self.client is None:
                return
            try:
                await self._call(self.client.revoke_lease(lease_id))
            except EtcdError as exc:
                if "not found" not in str(exc):  # already expired: nothing left to revoke
                    log.warning("could not revoke lease %x (will retry): %s", lease_id, exc)
                    return
            self._to_revoke.discard(lease_id)
            log.info("revoked lease %x", lease_id)

    # ---------------------------------------------------------------- keys
    async def get_leader(self) -> tuple[bytes, int] | None:
        """The leader key's value and create revision (its term), or None."""
        got = await self._call(self.client.get(self.key("leader")))
        return None if got is None else (bytes(got.value), int(got.create_revision))

    async def get(self, name: str) -> bytes | None:
        got = await self._call(self.client.get(self.key(name)))
        return None if got is None else bytes(got.value)

    async def secret(self) -> bytes:
        key = self.key("clustering_secret")
        tx = self.client.transactions
        await self._call(self.client.transaction(
            compare=[tx.version(key) == 0],
            success=[tx.put(key, secrets.token_bytes(32))],
            failure=[],
        ))
        value = await self.get("clustering_secret")
        if not value:
            raise EtcdError("clustering secret missing after put-if-absent")
        return value

    async def campaign(self, value: str, isr_raw: bytes | None) -> bool:
        """Create the leader key bound to our lease if nobody holds it; True if we won.

        ``isr_raw`` is the ISR value that told us we may lead (None: no ISR yet); the
        transaction requires it unchanged, so an ISR update racing the campaign wins.
        """
        if self.lease_id is None:
            return False
        key = self.key("leader")
        tx = self.client.transactions
        isr_key = self.key("isr")
        isr_same = tx.version(isr_key) == 0 if isr_raw is None else tx.value(isr_key) == isr_raw
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.version(key) == 0, isr_same],
            success=[tx.put(key, value.encode(), lease=self.lease_id)],
            failure=[],
        ))
        if not ok:
            return False
        got = await self._call(self.client.get(key))
        if got is None or bytes(got.value) != value.encode() or int(got.lease) != self.lease_id:
            return False
        self.leader_revision = int(got.create_revision)
        return True

    async def resign(self) -> None:
        """Delete the leader key if it is still ours (graceful hand-over)."""
        key = self.key("leader")
        tx = self.client.transactions
        try:
            await self._call(self.client.transaction(
                compare=[tx.create(key) == self.leader_revision], success=[tx.delete(key)], failure=[]))
        except EtcdError as exc:
            log.warning("could not resign: %s", exc)

    async def read_isr(self) -> tuple[list[str] | None, bytes | None]:
        """(ISR members or None if unset/unreadable, the raw value for ``campaign``)."""
        raw = await self.get("isr")
        if raw is None:
            return None, None
        try:
            value = json.loads(raw)
        except ValueError:
            return None, raw
        return ([str(v) for v in value] if isinstance(value, list) else None), raw

    async def write_isr(self, members: list[str],
                        shards: Mapping[str, list[str]] | None = None) -> bool | None:
        """Write the ISR, fenced on our leadership (the leader key's create revision); with
        ``shards`` (per-shard leaders: vhost -> its ISR, for the vhosts whose data we
        replicate), each one's shard ISR key too, in the same transaction, so no reader sees a
        shard ISR naming a node the cluster's has dropped (confirms stop waiting for a node only
        after this write).

        True: written. False: we are not the leader any more. None: etcd did not answer
        (the write may or may not have happened): try again.
        """
        return await self._write_fenced({"isr": members,
                                         **{shard_isr_key(v): m for v, m in (shards or {}).items()}})

    async def write_shard_isr(self, vhost: str, members: list[str]) -> bool | None:
        """Write one shard's ISR alone (a member fell behind on it, or holds it again), fenced
        on our leadership; True/False/None as ``write_isr``."""
        return await self._write_fenced({shard_isr_key(vhost): members})

    async def _write_fenced(self, values: Mapping[str, list[str]], fence: str = "leader",
                            revision: int | None = None) -> bool | None:
        """Put each key (under the prefix) its JSON value in one transaction fenced on our
        leadership (the key ``fence`` still the one created at ``revision``; by default the
        cluster's leader key and our term of it); True/False/None as ``write_isr``."""
        if not self.lease_alive():
            return False
        if self.client is None:
            return None
        tx = self.client.transactions
        term = self.leader_revision if revision is None else revision
        try:
            ok, _ = await self._call(self.client.transaction(
                compare=[tx.create(self.key(fence)) == term],
                success=[tx.put(self.key(name), json.dumps(value).encode())
                         for name, value in values.items()],
                failure=[],
            ))
        except EtcdError as exc:
            log.warning("ISR write failed: %s", exc)
            return None
        return bool(ok)

    async def mend_shard_isrs(self, stale: Mapping[str, tuple[bytes | None, bytes]], gone: Sequence[str],
                              isr_raw: bytes) -> bool:
        """Give the ``stale`` shards (vhost -> (the value read, None if absent; the value it
        should hold: the cluster's ISR less the members behind on the shard)) their value and
        delete the keys of ``gone`` ones (deleted vhosts: a vhost created again must not find
        an old ISR), fenced on our leadership, on the cluster's ISR still being ``isr_raw`` and
        on each stale key still holding what was read (a removal racing this wins)."""
        if not (stale or gone) or not self.lease_alive() or self.client is None:
            return False
        tx = self.client.transactions
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.create(self.key("leader")) == self.leader_revision,
                     tx.value(self.key("isr")) == isr_raw,
                     *(tx.version(self.key(shard_isr_key(v))) == 0 if old is None
                       else tx.value(self.key(shard_isr_key(v))) == old for v, (old, _new) in stale.items())],
            success=[*(tx.put(self.key(shard_isr_key(v)), new) for v, (_old, new) in stale.items()),
                     *(tx.delete(self.key(shard_isr_key(v))) for v in gone)],
            failure=[]))
        return bool(ok)

    async def drop_stale_leader(self, value: str) -> None:
        """Our own URI on a leader key we do not hold: a previous run of this node died leading.

        Revoke that lease now instead of waiting a TTL for it (this data dir is locked by us,
        so nobody can be leading with it).
        """
        got = await self._call(self.client.get(self.key("leader")))
        if got is not None and bytes(got.value) == value.encode() and int(got.lease) != self.lease_id:
            log.info("leader key is a previous run's: revoking its lease %x", int(got.lease))
            self.forget_lease(int(got.lease))
            await self.revoke_pending()

    async def put_member(self, node_id: str, record: dict[str, Any]) -> None:
        """Publish our member record bound to our lease (it vanishes with us)."""
        if self.lease_id is None:
            return
        await self._call(self.client.put(self.key(f"members/{node_id}"), json.dumps(record).encode(),
                                         lease=self.lease_id))

    async def members(self) -> dict[str, dict[str, Any]]:
        """Every live member's record, by node id."""
        prefix = self.key("members/")
        got = await self._call(self.client.get_prefix(prefix))
        out: dict[str, dict[str, Any]] = {}
        for kv in got:
            try:
                record = json.loads(bytes(kv.value))
            except ValueError:
                continue
            if isinstance(record, dict):
                out[bytes(kv.key)[len(prefix):].decode(errors="replace")] = record
        return out

    async def watch(self, name: str, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` for every change of ``<prefix>/<name>`` until cancelled.

        Raises EtcdError if the watch cannot be set up; returns if etcd ends the stream.
        """
        watch = await self._call(self.client.watch(self.key(name)))
        try:
            async for _event in watch:
                on_change()
        finally:
            try:
                async with asyncio.timeout(CALL_TIMEOUT):
                    await watch.cancel()
            except Exception:
                pass  # connection already gone: nothing left to cancel

    # ------------------------------------------------ keys of one shard (broker/shards/leaders.py)
    async def get_prefix(self, name: str) -> dict[str, tuple[bytes, int]]:
        """Every key under ``<prefix>/<name>``, named as ``key`` names it (without ``<prefix>/``)
        -> (value, create revision)."""
        skip = len(self.key(""))
        got = await self._call(self.client.get_prefix(self.key(name)))
        return {bytes(kv.key)[skip:].decode(errors="replace"): (bytes(kv.value), int(kv.create_revision))
                for kv in got}

    async def create_bound(self, name: str, value: bytes) -> int | None:
        """Create ``<prefix>/<name>`` bound to our lease unless it exists (a campaign); its create
        revision (the term, the fencing token of what it guards) if we created it, else None."""
        if self.lease_id is None or self.client is None:
            return None
        key = self.key(name)
        tx = self.client.transactions
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.version(key) == 0], success=[tx.put(key, value, lease=self.lease_id)], failure=[]))
        if not ok:
            return None
        got = await self._call(self.client.get(key))
        if got is None or int(got.lease) != self.lease_id:
            return None
        return int(got.create_revision)

    async def delete_if(self, name: str, create_revision: int) -> bool:
        """Delete ``<prefix>/<name>`` if it is still the one created at ``create_revision`` (a
        resignation that cannot remove a successor's key)."""
        key = self.key(name)
        tx = self.client.transactions
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.create(key) == create_revision], success=[tx.delete(key)], failure=[]))
        return bool(ok)

    async def put_if(self, name: str, create_revision: int, value: bytes) -> bool:
        """Rewrite ``<prefix>/<name>`` (kept on our lease) if it is still the one created at
        ``create_revision``: a shard leader saying it serves its shard (``"serves": true``)
        cannot mark a successor's key."""
        if self.lease_id is None or self.client is None or not self.lease_alive():
            return False
        key = self.key(name)
        tx = self.client.transactions
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.create(key) == create_revision], success=[tx.put(key, value, lease=self.lease_id)],
            failure=[]))
        return bool(ok)

    async def release_shard(self, vhost: str, holder_term: int) -> bool:
        """Hand ``vhost``'s shard over (the hand-over, docs/architecture.md): called by its server
        once it closed the shard and the holder of its leader key holds the shard's last action;
        names the holder's term, and only while the key is still the one created then (a release
        never reaches a later holder, which must be handed the shard by its own release)."""
        if self.client is None:
            return False
        tx = self.client.transactions
        ok, _ = await self._call(self.client.transaction(
            compare=[tx.create(self.key(shard_key(vhost))) == holder_term],
            success=[tx.put(self.key(shard_released_key(vhost)), str(holder_term).encode())],
            failure=[]))
        return bool(ok)

    async def write_served_isr(self, vhost: str, term: int, members: list[str]) -> bool | None:
        """The ISR of a shard we serve, fenced on our leadership of that shard (its leader key
        still the one created at ``term``), not on the cluster's: the node serving a shard
        replicates it, so it alone writes its key. True/False/None as ``write_isr``."""
        return await self._write_fenced({shard_isr_key(vhost): members}, shard_key(vhost), term)

    async def still_leader(self) -> bool:
        # Never wait past the lease deadline: by then the answer no longer matters.
        timeout = max(0.05, min(CALL_TIMEOUT, self.lease_deadline() - time.monotonic()))
        got = await self._call(self.client.get(self.key("leader")), timeout)
        return got is not None and int(got.create_revision) == self.leader_revision


async def _quiet_close(client: Any) -> None:
    try:
        async with asyncio.timeout(CALL_TIMEOUT):
            await client.close()
    except Exception:
        pass
