"""A virtual host: exchanges, queues, bindings and their durable definitions.

Theory of operation
-------------------
Every durable declaration (exchange, non-exclusive queue, binding between two
durable ends) and every delete of one is appended to ``definitions.amqp`` as
the AMQP method frame that describes it (pamqp-encoded, channel 0; built
without pamqp's name grammar, ``model/methods.py``, so any name RabbitMQ takes
is stored). A declare that cannot be logged is taken back whole. On boot
the log is replayed in order; after many deletes it is compacted to the
current state (written aside, fsynced, renamed). Exclusive queues are never
written: like RabbitMQ, they die with their connection and with the broker.

Each queue owns a ``QueueStore`` directory: durable queues under the vhost
directory (replicated through the sink), transient ones under a scratch
directory that is wiped at startup. Error texts follow RabbitMQ's wording so
client code that matches on them keeps working.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame as PFrame

from broker import errors
from broker.model import (
    definition_records,
    exchange_features,
    features,
    methods,
    policy,
    queue_featured,
    queue_types,
    stream,
    trace,
)
from broker.model import publish as publishing
from broker.model.exchange import Exchange, check_x_match
from broker.model.fastpaths import FastPaths
from broker.model.limits import VHostLimits
from broker.model.queue import ClassicQueue, Queue
from broker.model.trace import TRACE_EXCHANGE
from broker.model.vhost_meta import VHostMeta
from broker.store.api import MessageStore
from broker.store.definitions import DefinitionsLog
from broker.store.paths import queue_dir, queue_path, vhost_dir, write_name
from broker.store.priority_store import PriorityStore, QuorumPriorityStore
from broker.store.queue_store import QueueStore
from broker.store.segment_log import SegmentFiles, bury, remove_tombstones_later
from broker.store.sink import NULL_SINK, ReplicationSink

log = logging.getLogger(__name__)

DEFAULT_EXCHANGES = (
    ("", "direct"),
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
    (TRACE_EXCHANGE, "topic"),  # internal: firehose tracing's copies (broker/model/trace.py)
)
_COMPACT_AFTER = 10_000  # deletes before the definitions log is rewritten


def _equivalent(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items()} == {k: v for k, v in b.items()}


_PAUSED = "x-paused"  # the argument of a pause record (a passive queue.declare in the log)


def _pause_record(queue: str, paused: bool) -> PFrame:
    return methods.QueueDeclare(queue=queue, durable=True, passive=True, arguments={_PAUSED: paused})


class VHost:
    def __init__(
        self,
        name: str,
        data_dir: Path,
        *,
        segment_size: int,
        sink: ReplicationSink,
        schedule: Callable[[Callable[[], None]], object],
        mark_dirty: Callable[[Any], None],
        transient_root: Path,
        call_later: features.CallLater | None = None,
        write_through: bool = False,
        files: SegmentFiles | None = None,
    ) -> None:
        self.name = name
        self.dir = vhost_dir(data_dir, name)
        self._dir_str = str(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # deleted queues and vhosts a crash left (off the loop)
        for parent in (self._dir_str, self.dir / "delayed", self.dir / "dedup", self.dir.parent):
            remove_tombstones_later(parent)
        self.transient_dir = transient_root / self.dir.name
        self.segment_size = segment_size
        self.sink = sink
        self.schedule = schedule
        self.mark_dirty = mark_dirty
        self.write_through = write_through  # synchronous settlements (ack_sync_interval = 0)
        # the node's disk and mapped-segment budget, shared by every store (None: per vhost)
        self.files = files if files is not None else SegmentFiles()
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.closed_queues: dict[str, str] = {}  # name -> why (corrupt store)
        self.queues_created = 0  # since boot (metrics); replayed queues are not counted
        self.queues_deleted = 0
        # messages confirmed to publishers, unroutable ones, and of those the ones returned
        # (counted by the protocol; the API's per-vhost message_stats)
        self.n_confirmed = self.n_unroutable = self.n_returned = 0
        write_name(self.dir / ".vhost", name, sink)
        for ename, etype in DEFAULT_EXCHANGES:
            self.exchanges[ename] = Exchange(ename, etype, durable=True, internal=ename == TRACE_EXCHANGE)
        self.definitions = DefinitionsLog(self.dir / "definitions.amqp", sink)
        self.call_later = call_later  # timers for TTL / x-expires (broker/model/features.py)
        self.policy_set = policy.PolicySet(self.dir / "policies.json", sink)
        self.limits = VHostLimits(self.dir / "limits.json", sink)  # max-connections, max-queues
        self.meta = VHostMeta(self.dir / "metadata.json", sink)  # description, default_queue_type
        self._replaying = False
        self._load_deleted: dict[str, Callable[[], bool]] | None = None  # see _load
        self.fast = FastPaths()  # publish/delivery runs and direct hand-over (tests switch off)
        # how its classic queues become featured ones unasked (an expiration, a consumer
        # priority): their features' dead letters go through this vhost's publish operation
        self._variants = queue_featured.Promotion(self, call_later)
        self._load()

    def remove_files(self) -> None:
        """A deleted vhost (after ``close``): its directories are renamed to tombstones on the
        loop, so a vhost of the same name created at once has them to itself, and removed on
        the segment worker (``store/segment_log``: bury); a crash's leftovers go at a boot."""
        bury(self._dir_str)
        bury(str(self.transient_dir))

    # ------------------------------------------------------------ definitions
    def _load(self) -> None:
        self._replaying = True
        # Queues and delayed exchanges' held messages a delete record removed: their files
        # stay until the whole log is read (they may be those of the same name declared again
        # later in the log), then those of a name still deleted go (a crash between the
        # delete's record and its rename left them). Directory -> "is it still deleted?".
        deleted: dict[str, Callable[[], bool]] = {}
        self._load_deleted = deleted
        try:
            for record in self.definitions.load():
                try:
                    fields = definition_records.plain(record)
                    if fields is not None:
                        self._replay_plain(fields)
                        continue
                    method = definition_records.decode(record)
                    if method is not None:
                        self._replay(method)
                except (errors.AMQPError, ValueError, KeyError) as exc:
                    log.warning("vhost %s: skipping definition record: %s", self.name, exc)
                except Exception as exc:  # a bad record must not stop the broker
                    log.warning("vhost %s: bad definition record: %r", self.name, exc)
        finally:
            self._replaying = False
            self._load_deleted = None
        for directory, still_deleted in deleted.items():
            if still_deleted():
                bury(directory)

    def _replay_plain(self, fields: definition_records.Plain) -> None:
        """``_replay`` for a queue.declare or queue.bind without arguments (most of a log: one
        per durable queue and binding), from the fields read off the record."""
        kind, queue, exchange, routing_key, bits = fields
        if kind == definition_records.QUEUE_BIND:
            self._replay_bind(queue, exchange, routing_key, {})
        else:
            self._replay_queue(queue, passive=bool(bits & 1), auto_delete=bool(bits & 8), arguments={})

    def _replay_queue(self, queue: str, *, passive: bool, auto_delete: bool,
                      arguments: dict[str, Any]) -> None:
        if passive:  # a paused/resumed record
            q = self.queues.get(queue)
            if q is not None:
                q.paused = bool(arguments.get(_PAUSED))
        else:
            self.declare_queue(queue, durable=True, auto_delete=auto_delete, arguments=arguments, owner=None)

    def _replay_bind(self, queue: str, exchange: str, routing_key: str, arguments: dict[str, Any]) -> None:
        # a default-exchange binding: implicit (compaction wrote them once; not an error)
        if queue in self.queues and exchange in self.exchanges and exchange:
            self.bind_queue(queue, exchange, routing_key, arguments, owner=None)

    def _replay(self, m: PFrame) -> None:
        if isinstance(m, commands.Exchange.Declare):
            self.declare_exchange(m.exchange, m.exchange_type, durable=True, auto_delete=m.auto_delete,
                                  internal=m.internal, arguments=m.arguments or {})
        elif isinstance(m, commands.Exchange.Delete):
            if m.exchange in self.exchanges:
                self.delete_exchange(m.exchange)
        elif isinstance(m, commands.Queue.Declare):
            self._replay_queue(m.queue, passive=m.passive, auto_delete=m.auto_delete,
                               arguments=m.arguments or {})
        elif isinstance(m, commands.Queue.Delete):
            if m.queue in self.queues:
                self.delete_queue(m.queue, owner=None)
        elif isinstance(m, commands.Queue.Bind):
            self._replay_bind(m.queue, m.exchange, m.routing_key, m.arguments or {})
        elif isinstance(m, commands.Queue.Unbind):
            if m.queue in self.queues and m.exchange in self.exchanges:
                self.unbind_queue(m.queue, m.exchange, m.routing_key, m.arguments or {}, owner=None)
        elif isinstance(m, commands.Exchange.Bind):
            if m.destination in self.exchanges and m.source in self.exchanges:
                self.bind_exchange(m.destination, m.source, m.routing_key, m.arguments or {})
        elif isinstance(m, commands.Exchange.Unbind):
            if m.destination in self.exchanges and m.source in self.exchanges:
                self.unbind_exchange(m.destination, m.source, m.routing_key, m.arguments or {})

    @contextmanager
    def unlogged(self) -> Iterator[None]:
        """Changes made inside are not written to the definitions log: for undoing changes whose
        records the caller cuts off the log itself (``DefinitionsLog.cut``), which needs no disk
        space where a delete record would."""
        was, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._replaying = was

    def _log(self, method: PFrame, is_delete: bool = False) -> None:
        """Append a durable change to the definitions log. DiskFull leaves the log as it was:
        declares call this after the change and undo it, deletes before it, so a client
        refused for want of disk space finds nothing changed."""
        if self._replaying:
            return
        self.definitions.append(pframe.marshal(method, 0))
        self.mark_dirty(self.definitions)
        if is_delete:
            self._compact_after_delete()

    def _compact_after_delete(self) -> None:
        if self._replaying or self.definitions.appended_since_compact <= _COMPACT_AFTER:
            return
        try:
            self.compact()
        except errors.DiskFull:
            log.warning("vhost '%s': disk full, definitions log not compacted", self.name)

    def compact(self) -> None:
        records: list[bytes] = []
        for ex in self.exchanges.values():
            if ex.durable and not ex.name.startswith("amq.") and ex.name:
                records.append(pframe.marshal(methods.ExchangeDeclare(
                    exchange=ex.name, exchange_type=ex.type, durable=True, auto_delete=ex.auto_delete,
                    internal=ex.internal, arguments=ex.arguments), 0))
        for q in self.queues.values():
            if q.durable and q.exclusive_owner is None:
                records.append(pframe.marshal(methods.QueueDeclare(
                    queue=q.name, durable=True, auto_delete=q.auto_delete, arguments=q.arguments), 0))
                if q.paused:
                    records.append(pframe.marshal(_pause_record(q.name, True), 0))
        for ex in self.exchanges.values():
            if not ex.durable or not ex.name:  # the default exchange's bindings are implicit
                continue
            for dest, rk, args in ex.bindings():
                if isinstance(dest, Queue) and dest.durable and dest.exclusive_owner is None:
                    records.append(pframe.marshal(methods.QueueBind(
                        queue=dest.name, exchange=ex.name, routing_key=rk, arguments=args), 0))
                elif isinstance(dest, Exchange) and dest.durable:
                    records.append(pframe.marshal(methods.ExchangeBind(
                        destination=dest.name, source=ex.name, routing_key=rk, arguments=args), 0))
        self.definitions.compact(records)

    def queue_directory(self, name: str) -> str:
        """Where a durable classic queue ``name`` keeps its files (and its ``.queue`` name)."""
        return queue_path(self._dir_str, name)

    # -------------------------------------------------------------- exchanges
    def get_exchange(self, name: str) -> Exchange:
        ex = self.exchanges.get(name)
        if ex is None:
            raise errors.NotFound(f"no exchange '{name}' in vhost '{self.name}'")
        return ex

    def declare_exchange(
        self, name: str, type_: str, *, passive: bool = False, durable: bool = False,
        auto_delete: bool = False, internal: bool = False, arguments: dict[str, Any] | None = None,
    ) -> Exchange:
        arguments = dict(arguments or {})
        ex = self.exchanges.get(name)
        if passive:
            if ex is None:
                raise errors.NotFound(f"no exchange '{name}' in vhost '{self.name}'")
            return ex
        if (name.startswith("amq.") or name == "") and not self._replaying:
            if ex is not None and ex.type == type_ and ex.durable == durable:
                return ex  # RabbitMQ allows an equivalent redeclare of amq.* exchanges
            raise errors.AccessRefused(
                f"exchange name '{name}' contains reserved prefix 'amq.'")
        if ex is not None:
            for what, cur, new in (("type", ex.type, type_), ("durable", ex.durable, durable),
                                   ("auto_delete", ex.auto_delete, auto_delete),
                                   ("internal", ex.internal, internal)):
                if cur != new:
                    raise errors.PreconditionFailed(
                        f"inequivalent arg '{what}' for exchange '{name}' in vhost '{self.name}': "
                        f"received '{new}' but current is '{cur}'")
            if not _equivalent(ex.arguments, arguments):
                raise errors.PreconditionFailed(
                    f"inequivalent arguments for exchange '{name}' in vhost '{self.name}'")
            return ex
        ex = Exchange(name, type_, durable, auto_delete, internal, arguments)
        if exchange_features.needs_special(ex):
            # delayed / consistent hash / dedup (406 on a bad argument)
            ex.special = exchange_features.ExchangeSpecial(self, ex)
        self.exchanges[name] = ex
        if self.policy_set.policies:
            policy.apply_to_exchange(self, ex)  # alternate-exchange by policy
        if durable:
            try:
                self._log(methods.ExchangeDeclare(exchange=name, exchange_type=type_, durable=True,
                                                  auto_delete=auto_delete, internal=internal,
                                                  arguments=arguments))
            except BaseException:  # DiskFull or any other failure: a refused declare leaves nothing
                del self.exchanges[name]
                if ex.special is not None:
                    ex.special.close(delete=True)
                raise
        return ex

    def delete_exchange(self, name: str, if_unused: bool = False) -> None:
        if name == "" or name.startswith("amq."):
            raise errors.AccessRefused("operation not permitted on the default exchange" if not name
                                       else f"deletion of system exchange '{name}' in vhost "
                                       f"'{self.name}' refused")
        ex = self.exchanges.get(name)
        if ex is None:
            return  # RabbitMQ: deleting a missing exchange is ok
        if if_unused and ex.has_bindings():
            raise errors.PreconditionFailed(f"exchange '{name}' in vhost '{self.name}' in use")
        if ex.durable:
            self._log(methods.ExchangeDelete(exchange=name))  # first: DiskFull changes nothing
        del self.exchanges[name]
        if ex.special is not None:
            kept = ex.special.directories()
            if self._load_deleted is not None and kept:
                # a boot's replay: the held messages' and the deduplication cache's files are
                # decided at its end (see _load)
                for directory in kept:
                    self._load_deleted[directory] = functools.partial(self._gone_from, name, directory)
                ex.special.close()
            else:
                ex.special.close(delete=True)  # drops held delayed messages with the exchange
        for other in self.exchanges.values():
            other.unbind_all(ex)
        if ex.durable:
            self._compact_after_delete()

    # ----------------------------------------------------------------- queues
    def get_queue(self, name: str, owner: object | None) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise errors.NotFound(f"no queue '{name}' in vhost '{self.name}'")
        if q.exclusive_owner is not None and q.exclusive_owner is not owner:
            raise errors.ResourceLocked(_locked(name, self.name))
        return q

    def declare_queue(
        self, name: str, *, passive: bool = False, durable: bool = False, exclusive: bool = False,
        auto_delete: bool = False, arguments: dict[str, Any] | None = None, owner: object | None,
    ) -> tuple[Queue, bool]:
        arguments = dict(arguments or {})
        if passive:
            return self.get_queue(name, owner), False
        max_queues = self.limits.max_queues
        if max_queues is not None and not self._replaying and name not in self.queues \
                and len(self.queues) >= max_queues:
            raise errors.PreconditionFailed(
                f"cannot declare queue '{name}': queue limit in vhost '{self.name}' ({max_queues}) "
                "is reached", 50, 10)
        if not name:
            name = "amq.gen-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        elif name.startswith("amq.") and not self._replaying:
            raise errors.AccessRefused(
                f"queue name '{name}' contains reserved prefix 'amq.*'")
        arguments = queue_types.with_default(arguments, durable=durable, exclusive=exclusive,
                                             default_type=self.meta.default_queue_type)
        q = self.queues.get(name)
        if q is not None:
            self.get_queue(name, owner)  # exclusivity check
            for what, cur, new in (("durable", q.durable, durable),
                                   ("exclusive", q.exclusive_owner is not None, exclusive),
                                   ("auto_delete", q.auto_delete, auto_delete)):
                if cur != new and what == "exclusive":  # RabbitMQ: 405, as for another's queue
                    raise errors.ResourceLocked(_locked(name, self.name))
                if cur != new:
                    raise errors.PreconditionFailed(
                        f"inequivalent arg '{what}' for queue '{name}' in vhost '{self.name}': "
                        f"received '{str(new).lower()}' but current is '{str(cur).lower()}'")
            if not _equivalent(q.arguments, arguments):
                raise errors.PreconditionFailed(
                    f"inequivalent arguments for queue '{name}' in vhost '{self.name}'")
            q.touch()  # a redeclare counts as use for x-expires
            return q, False
        if not self._replaying:  # a queue recovered from the log keeps the type it was created with
            arguments = queue_types.resolve(arguments, durable=durable, exclusive=exclusive,
                                            auto_delete=auto_delete, queue=name, vhost=self.name)
            features.check_queue_mode(arguments, name, self.name)
        if arguments.get("x-queue-type") == "stream":  # stream queues: broker/model/stream.py
            q = stream.new_stream_queue(
                self.name, self.dir, name, durable=durable, exclusive=exclusive, auto_delete=auto_delete,
                arguments=arguments, segment_size=self.segment_size, sink=self.sink, files=self.files,
                schedule=self.schedule, on_unused=self._queue_unused, on_dirty=self.mark_dirty,
                call_later=self.call_later)
            policy.apply_to_queue(self, q)  # retention: also runs it and arms the age timer
            self._admit_new_queue(q, arguments, log=True)
            return q, True
        args_cfg = features.parse_arguments(arguments, name, self.name)  # 406 on a bad x-arg
        persistent = durable and not exclusive
        if persistent:
            # Boot reads no queue's directory: a plain queue's store recovers on first use or
            # when the node's reader gets to it (queue_store.DeferredQueueStore). The directory
            # and its .queue were made by the declare that logged this record.
            qdir = queue_path(self._dir_str, name)
            store = QueueStore(qdir, segment_size=self.segment_size,
                               sink=self.sink, persistent_only=True, notify=self.mark_dirty,
                               write_through=self.write_through, files=self.files,
                               deferred=self._replaying and _plain_store(args_cfg, arguments))
            if not self._replaying:
                try:
                    write_name(Path(qdir, ".queue"), name, self.sink, replicate_existing=True)
                except BaseException:
                    store.delete()  # a refused declare leaves no directory behind either
                    raise
        else:
            tdir = queue_dir(self.transient_dir, name)
            if tdir.exists():
                shutil.rmtree(tdir, ignore_errors=True)
            store = QueueStore(tdir, segment_size=self.segment_size, sink=NULL_SINK, files=self.files)
        try:
            messages: MessageStore = store
            if args_cfg.max_priority:  # x-max-priority: one store per level
                messages = PriorityStore(store, args_cfg.max_priority)
            elif queue_types.type_of(arguments) == queue_types.QUORUM:  # RabbitMQ 4: two levels, always on
                messages = QuorumPriorityStore(store)
            q = ClassicQueue(self.name, name, durable=durable, exclusive_owner=owner if exclusive else None,
                             auto_delete=auto_delete, arguments=arguments, store=messages,
                             schedule=self.schedule, on_unused=self._queue_unused, on_dirty=self.mark_dirty,
                             fast=self.fast, variants=self._variants)
        except BaseException:
            store.delete()  # a refused declare leaves no directory behind
            raise
        # its type, from arguments and policies (plain: stays classic); a replayed record is not
        # logged again (nor its frame built: a boot replays every durable queue)
        self._admit_new_queue(q, arguments, log=persistent and not self._replaying, policies=True,
                              args_cfg=args_cfg)
        return q, True

    def _admit_new_queue(self, q: Queue, arguments: dict[str, Any], *, log: bool,
                         policies: bool = False, args_cfg: features.QueueConfig | None = None) -> None:
        """Make a new queue known: registered, bound to the default exchange, its policies
        applied, logged if durable. If any of that fails (a full disk, any error) the queue goes
        again, store and all, and the error is raised on: a refused declare leaves nothing."""
        self.queues[q.name] = q
        self.queues_created += not self._replaying
        self.exchanges[""].bind(q, q.name)
        try:
            if policies:
                policy.apply_to_queue(self, q, args_cfg)
            if log:
                self._log(methods.QueueDeclare(queue=q.name, durable=True, auto_delete=q.auto_delete,
                                               arguments=arguments))
        except BaseException:
            del self.queues[q.name]
            self.queues_created -= not self._replaying
            self.exchanges[""].unbind_all(q)
            q.delete()
            raise

    def _queue_unused(self, q: Queue) -> None:
        if self.queues.get(q.name) is q:
            try:
                self.delete_queue(q.name, owner=q.exclusive_owner)
            except errors.DiskFull:
                log.warning("vhost '%s': disk full, auto-delete queue '%s' kept", self.name, q.name)

    def delete_queue(self, name: str, *, if_unused: bool = False, if_empty: bool = False,
                     owner: object | None) -> int:
        q = self.queues.get(name)
        if q is None:
            return 0  # RabbitMQ: deleting a missing queue is ok
        self.get_queue(name, owner)
        if if_unused and q.consumers:
            raise errors.PreconditionFailed(f"queue '{name}' in vhost '{self.name}' in use")
        if if_empty and q.message_count:
            raise errors.PreconditionFailed(f"queue '{name}' in vhost '{self.name}' not empty")
        count = q.message_count
        persistent = q.durable and q.exclusive_owner is None
        if persistent:
            self._log(methods.QueueDelete(queue=name))  # first: DiskFull changes nothing
        del self.queues[name]
        self.queues_deleted += 1
        for ex in list(self.exchanges.values()):
            if ex.unbind_all(q) and ex.auto_delete and not ex.has_bindings():
                self._auto_delete_exchange(ex)
        if self._load_deleted is not None:  # a boot's replay: the files are decided at its end
            self._load_deleted[queue_path(self._dir_str, name)] = lambda: name not in self.queues
            q.close()
        else:
            q.delete()
        if persistent:
            self._compact_after_delete()
        return count

    def pause_queue(self, name: str, paused: bool) -> Queue:
        """Pause (or resume) a queue: publishes are still taken, nothing is delivered while
        paused. A durable queue's state is a record in the definitions log right after its
        declare (replicated with it, so it survives a restart and a failover): a passive
        queue.declare whose arguments say ``x-paused``. DiskFull changes nothing."""
        q = self.queues.get(name)
        if q is None:
            raise errors.NotFound(f"no queue '{name}' in vhost '{self.name}'")
        if q.paused == paused:
            return q
        if q.durable and q.exclusive_owner is None:
            self._log(_pause_record(name, paused))
        q.paused = paused
        if not paused:
            q.schedule_delivery()
        return q

    def restart_queue(self, name: str) -> Queue:
        """Close a durable queue's store and open it again from its files (LavinMQ's restart):
        the same queue, bindings and paused state, its store read afresh. Refused while it has
        consumers (their unacked deliveries are the old store's) and for a transient queue
        (its store lives only as long as it does)."""
        q = self.queues.get(name)
        if q is None:
            raise errors.NotFound(f"no queue '{name}' in vhost '{self.name}'")
        if not q.durable or q.exclusive_owner is not None:
            raise errors.PreconditionFailed(f"queue '{name}' in vhost '{self.name}' is not durable")
        if q.consumers:
            raise errors.PreconditionFailed(f"queue '{name}' in vhost '{self.name}' has consumers")
        bound = [(ex.name, rk, dict(args)) for ex in self.exchanges.values() if ex.name
                 for dest, rk, args in ex.bindings() if dest is q]
        del self.queues[name]
        for ex in self.exchanges.values():
            ex.unbind_all(q)
        q.deleted = True  # no pass runs on it again; its files stay
        q.close()
        with self.unlogged():  # as a boot replays it: nothing new in the log
            nq, _ = self.declare_queue(name, durable=True, auto_delete=q.auto_delete,
                                       arguments=q.arguments, owner=None)
            for ex_name, rk, args in bound:
                self.bind_queue(name, ex_name, rk, args, owner=None)
        nq.paused = q.paused
        return nq

    def _gone_from(self, name: str, directory: str) -> bool:
        """Whether exchange ``name`` no longer keeps state in ``directory`` (held delayed
        messages, a deduplication cache's log)."""
        ex = self.exchanges.get(name)
        return ex is None or ex.special is None or directory not in ex.special.directories()

    def _auto_delete_exchange(self, ex: Exchange) -> None:
        if self.exchanges.get(ex.name) is ex:
            try:
                self.delete_exchange(ex.name)
            except errors.DiskFull:
                log.warning("vhost '%s': disk full, auto-delete exchange '%s' kept", self.name, ex.name)

    def delete_exclusive(self, owner: object) -> None:
        for q in [q for q in self.queues.values() if q.exclusive_owner is owner]:
            self.delete_queue(q.name, owner=owner)

    # --------------------------------------------------------------- bindings
    def bind_queue(self, queue: str, exchange: str, routing_key: str, arguments: dict[str, Any],
                   owner: object | None) -> None:
        q = self.get_queue(queue, owner)
        ex = self.get_exchange(exchange)
        if exchange == "":
            raise errors.AccessRefused("operation not permitted on the default exchange")
        if ex.kind == "headers" and arguments and not self._replaying:  # not on recovery: a
            check_x_match(arguments)  # binding stored before this check must not stop a start
        if ex.bind(q, routing_key, arguments) and ex.durable and q.durable and q.exclusive_owner is None \
                and not self._replaying:  # a replayed record is not logged again (nor its frame built)
            try:
                self._log(methods.QueueBind(queue=queue, exchange=exchange, routing_key=routing_key,
                                              arguments=arguments))
            except BaseException:  # a refused bind leaves nothing behind
                ex.unbind(q, routing_key, arguments)
                raise

    def unbind_queue(self, queue: str, exchange: str, routing_key: str, arguments: dict[str, Any],
                     owner: object | None) -> None:
        if exchange == "":
            raise errors.AccessRefused("operation not permitted on the default exchange")
        if queue not in self.queues or exchange not in self.exchanges:
            return  # RabbitMQ: unbinding from a queue or exchange that is gone is ok
        if not self.exchanges[exchange].is_bound(self.queues[queue], routing_key, arguments):
            return  # ... and so is a binding that does not exist, before any exclusivity check
        q = self.get_queue(queue, owner)
        ex = self.get_exchange(exchange)
        logged = (ex.durable and q.durable and q.exclusive_owner is None
                  and ex.is_bound(q, routing_key, arguments))
        if logged:  # first: DiskFull changes nothing
            self._log(methods.QueueUnbind(queue=queue, exchange=exchange, routing_key=routing_key,
                                            arguments=arguments))
        if ex.unbind(q, routing_key, arguments):
            if logged:
                self._compact_after_delete()
            if ex.auto_delete and not ex.has_bindings():
                self._auto_delete_exchange(ex)

    def bind_exchange(self, destination: str, source: str, routing_key: str,
                      arguments: dict[str, Any]) -> None:
        dst = self.get_exchange(destination)
        src = self.get_exchange(source)
        if source == "" or destination == "":
            raise errors.AccessRefused("operation not permitted on the default exchange")
        if src.kind == "headers" and arguments and not self._replaying:
            check_x_match(arguments)
        if src.bind(dst, routing_key, arguments) and src.durable and dst.durable:
            try:
                self._log(methods.ExchangeBind(destination=destination, source=source,
                                                 routing_key=routing_key, arguments=arguments))
            except BaseException:  # a refused bind leaves nothing behind
                src.unbind(dst, routing_key, arguments)
                raise

    def unbind_exchange(self, destination: str, source: str, routing_key: str,
                        arguments: dict[str, Any]) -> None:
        if destination not in self.exchanges or source not in self.exchanges:
            return  # as for queues: unbinding from an exchange that is gone is ok
        dst = self.get_exchange(destination)
        src = self.get_exchange(source)
        logged = src.durable and dst.durable and src.is_bound(dst, routing_key, arguments)
        if logged:  # first: DiskFull changes nothing
            self._log(methods.ExchangeUnbind(destination=destination, source=source,
                                               routing_key=routing_key, arguments=arguments))
        if src.unbind(dst, routing_key, arguments):
            if logged:
                self._compact_after_delete()
            if src.auto_delete and not src.has_bindings():
                self._auto_delete_exchange(src)

    # ---------------------------------------------------------------- publish
    def publish(self, req: publishing.PublishRequest) -> publishing.PublishOutcome:
        """THE publish operation: route, apply every exchange's and queue's behaviour,
        append; the outcome says what happened (broker/model/publish.py). A client's publish
        (one naming its ``origin``) is copied to the firehose when tracing is on (trace.py)."""
        out = publishing.publish(self, req)
        if self.meta.tracing and req.origin is not None:
            trace.published(self, req, req.origin, out)
        return out

    def publish_from_hold(self, req: publishing.PublishRequest) -> publishing.PublishOutcome:
        """``publish`` for a message coming out of its exchange's own hold (a delayed message
        now due, broker/model/exchange_features.py): that exchange's delay is not applied again."""
        return publishing.publish(self, req, first_hop=False)

    def publish_run(self, exchange: str, routing_key: str, names: publishing.EncodedNames, props: list[bytes],
                    bodies: list[bytes], same: bool, ts: int, flags: int | None = None
                    ) -> publishing.PublishOutcome | None:
        """Several messages to one exchange and routing key at once, or None when they must be
        published one by one (broker/model/publish.py)."""
        return publishing.publish_run(self, exchange, routing_key, names, props, bodies, same, ts, flags)

    def publish_batch(self, exchange: str, keys: Sequence[publishing.KeyedNames], props: list[bytes],
                      bodies: list[bytes], ts: int, first: int = 0) -> publishing.BatchOutcome:
        """Messages to one exchange with routing keys of their own, at once as far as that
        goes (broker/model/publish.py)."""
        return publishing.publish_batch(self, exchange, keys, props, bodies, ts, first)

    # --------------------------------------------------------------- policies
    def set_policy(self, name: str, pattern: str, definition: dict[str, Any], priority: int = 0,
                   apply_to: str = "all", operator: bool = False) -> None:
        """Create or replace a policy (ValueError if invalid), persist it, apply it live."""
        policy.set_policy(self, name, pattern, definition, priority, apply_to, operator)

    def delete_policy(self, name: str, operator: bool = False) -> bool:
        return policy.delete_policy(self, name, operator)

    def policies(self, operator: bool = False) -> list[dict[str, Any]]:
        ps = self.policy_set.operator if operator else self.policy_set.policies
        return [dict(p.to_json(), vhost=self.name) for _, p in sorted(ps.items())]

    def merge_acks(self, directory: Path, num: int, positions: list[int]) -> int | None:
        """Acks another copy of one of this vhost's queue stores has on disk (a follower's
        ack file for segment ``num`` of the store in ``directory``; ``QueueStore.merge_acks``):
        how many were acked here, or None if no queue store of this vhost lives there. Each
        level of a priority queue (quorum queues' two included) is a store of its own."""
        for q in self.queues.values():
            store = q.store
            if isinstance(store, PriorityStore):
                target = store.level_in(directory)
            elif isinstance(store, QueueStore) and store.directory == directory:
                target = store
            else:
                continue
            if target is not None:
                n = target.merge_acks(num, positions)
                q.n_acked += n
                return n
        return None

    def close(self) -> None:
        for ex in self.exchanges.values():
            if ex.special is not None:
                ex.special.close()
        for q in self.queues.values():
            try:
                q.close()
            except Exception:  # keep closing the rest
                log.exception("closing queue %s", q.name)
        self.definitions.close()


def _plain_store(args_cfg: features.QueueConfig, arguments: dict[str, Any]) -> bool:
    """A queue kept in one ``QueueStore`` (not a priority or quorum queue's levels)."""
    return not args_cfg.max_priority and queue_types.type_of(arguments) != queue_types.QUORUM


def _locked(queue: str, vhost: str) -> str:
    return (f"cannot obtain exclusive access to locked queue '{queue}' in vhost '{vhost}'. It could "
            "be originally declared on another connection or the exclusive property value does not "
            "match that of the original declaration.")
