"""Definitions export and import in RabbitMQ's JSON format.

Theory of operation
-------------------
Export walks the live state: users (with their limits), permissions and topic
permissions (from the user store, with their RabbitMQ-compatible password
hashes), global parameters, vhosts, policies and the topology (exchanges other
than the default and ``amq.*`` ones, non-exclusive queues of every type, durable
or not, and bindings between two exported ends). That is what RabbitMQ's own
export holds; a restart keeps the durable part. Vhost
metadata (description, tags, ``default_queue_type``) rides on the vhost entries;
vhost limits and operator policies go out as RabbitMQ writes them, as runtime
``parameters`` of the components ``vhost-limits`` and ``operator_policy``. Lists
are sorted, so export -> wipe -> import -> export gives the identical document.

Import runs in two passes so that a bad document changes nothing: ``validate``
checks every entry's shape and types, that every vhost an entry names exists
or is created by the same document, that every binding's ends exist or are
declared by it, and that no queue or exchange contradicts an existing one
(``durable``/``type``/...), and what a declare would refuse later (a bad queue
argument, a queue limit, a headers binding's ``x-match``) is refused here too;
only then does ``apply`` create vhosts, users, permissions, policies, exchanges,
queues and bindings, in that order. Entries that already exist identically are
left alone, so importing twice is a no-op.

All or nothing, across kill -9 and leader loss too: before ``apply`` touches
anything, the validated document (clear-text passwords already hashed) is
written down whole in ``definitions-import.json`` (``Mgmt.import_intent``, the
store's ``IntentFile``: tmp + fsync + rename, replicated); when every write of
the import is applied and the definitions logs are fsynced, the file is removed.
At start-up ``resume_import`` applies a document still written down again, in
full, before the node serves anything (importing is idempotent, so a prefix of
it already applied changes nothing). If a step of ``apply`` fails (a full disk),
what it did so far is undone, newest first, and the file removed: the client
is refused and nothing changed. Only if that undo fails too does the file stay,
and the restart completes the import instead of leaving a prefix. A restart that
cannot complete it (a full disk) stops with the error rather than serve a prefix.

A serving node never applies a big import in one turn of its event loop: a cluster leader
whose loop is busy for longer than its etcd lease cannot keep the lease alive and steps down
mid-import (2,000 queues took longer than the 10 s default on a leader whose disk the followers
share). ``import_definitions_async`` (the HTTP API) drives ``import_steps``, which yields every
``SLICE_S`` of applying, and lets the loop run there. The rules that keep that all or nothing:
imports run one at a time (``Mgmt.import_lock``); validation and the intent file come before
the first slice, as before; a request cancelled meanwhile does not stop the import (it is
finished, or undone, without yielding). Other clients' writes are not held back: an AMQP
declare may append to a definitions log the import is writing. Cutting that log back to the
import's mark would drop such a record, so across every yield the import compares where each
log it touches ends (and its appends since compaction, which a compaction resets); if another
writer moved it, an undo no longer cuts but takes the import's topology back with logged
deletes (skipping what another client already deleted), which needs disk space: if that fails
the intent file stays and the restart completes the import, the rule above. A boot-time import
(``load_definitions``, ``resume_import``) runs in one go, as nothing else runs yet.

A per-vhost document (``/api/definitions/{vhost}``) has no ``vhost`` fields; the
vhost comes from the URL and its ``users``/``vhosts``/``permissions`` are ignored.
As RabbitMQ does, unknown top-level keys are ignored; parameters of components
Skred has no plugin for (federation, shovel) are skipped with a warning in the
log rather than refusing the whole document.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import time
from collections.abc import Callable, Generator
from typing import Any

from broker import __version__, errors
from broker.auth.names import MAX_NAME_BYTES, name_problem
from broker.auth.passwords import ALGORITHMS, HASHING_ALGORITHM, hash_password
from broker.auth.users import topic_permissions_json
from broker.http import definitions_grants
from broker.http.policies import PolicyApi, validate_policy
from broker.http.render import jsonable
from broker.http.state import Mgmt
from broker.model import features, queue_types
from broker.model.exchange import EXCHANGE_TYPES, Exchange, check_x_match
from broker.model.limits import NAMES as LIMIT_NAMES
from broker.model.queue import Queue
from broker.model.vhost import DEFAULT_EXCHANGES, VHost
from broker.patterns import PatternError, compile_pattern

log = logging.getLogger(__name__)

LIMITS_COMPONENT, OPERATOR_POLICY_COMPONENT = "vhost-limits", "operator_policy"
IMPORT_INTENT_FILE = "definitions-import.json"  # an import being applied (module docstring)
DEFAULT_EXCHANGE_NAMES = frozenset(name for name, _ in DEFAULT_EXCHANGES)  # every new vhost has them
SLICE_S = 0.02  # a serving node's import lets the event loop run this often (module docstring)
# an import's file system work, off the event loop (its thread starts on first use)
_FILE_WORK = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="definitions-import")


class DefinitionsError(ValueError):
    """The document is unusable; nothing was changed."""


def _exported_exchange(name: str) -> bool:
    return name != "" and not name.startswith("amq.")


def vhost_meta_fields(body: dict[str, Any]) -> dict[str, Any]:
    """description / tags / default_queue_type of a vhost body or definitions entry (top level
    or under ``metadata``), ready for ``VHostMeta.update``; ValueError when malformed."""
    meta = body.get("metadata")
    merged = {**meta, **body} if isinstance(meta, dict) else body
    out: dict[str, Any] = {}
    if "description" in merged:
        if not isinstance(merged["description"], str):
            raise ValueError("'description' must be a string")
        out["description"] = merged["description"]
    tags = merged.get("tags")
    if isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    if tags is not None:
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ValueError("'tags' must be a list of strings or a comma-separated string")
        out["tags"] = tags
    qtype = merged.get("default_queue_type")
    if qtype is not None:
        if qtype not in queue_types.TYPES:
            raise ValueError(f"unknown default_queue_type {qtype!r} (known: {', '.join(queue_types.TYPES)})")
        out["default_queue_type"] = qtype
    tracing = merged.get("tracing")
    if tracing is not None:  # RabbitMQ's switch for the firehose (broker/model/trace.py)
        # RabbitMQ also takes the strings "true"/"false", which its rabbitmqadmin sends
        if isinstance(tracing, str):
            tracing = {"true": True, "false": False}.get(tracing, tracing)
        if not isinstance(tracing, bool):
            raise ValueError("'tracing' must be true or false")
        out["tracing"] = tracing
    return out


def _parameters(mgmt: Mgmt, vhost_names: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in vhost_names:
        limits = mgmt.broker.vhosts[name].limits.values
        if limits:
            out.append({"vhost": name, "component": LIMITS_COMPONENT, "name": "limits",
                        "value": dict(sorted(limits.items()))})
    for p in mgmt.operator_policies.list():
        if p["vhost"] in vhost_names:
            out.append({"vhost": p["vhost"], "component": OPERATOR_POLICY_COMPONENT, "name": p["name"],
                        "value": {k: p[k] for k in ("pattern", "definition", "priority", "apply-to")}})
    if mgmt.parameters is not None:  # shovels, federation upstreams
        out.extend(p for p in mgmt.parameters.list() if p["vhost"] in vhost_names)
    return out


def export(mgmt: Mgmt, vhost: str | None = None) -> dict[str, Any]:
    broker = mgmt.broker
    vhost_names = [vhost] if vhost is not None else sorted(broker.vhosts)
    queues: list[dict[str, Any]] = []
    exchanges: list[dict[str, Any]] = []
    bindings: list[dict[str, Any]] = []
    for name in vhost_names:
        vh = broker.vhosts[name]
        for q in vh.queues.values():
            if q.exclusive_owner is None:
                queues.append({"name": q.name, "vhost": name, "durable": q.durable,
                               "auto_delete": q.auto_delete, "arguments": jsonable(q.arguments)})
        for ex in vh.exchanges.values():
            if _exported_exchange(ex.name):
                exchanges.append({"name": ex.name, "vhost": name, "type": ex.type, "durable": ex.durable,
                                  "auto_delete": ex.auto_delete, "internal": ex.internal,
                                  "arguments": jsonable(ex.arguments)})
            if ex.name == "":
                continue
            for dest, rk, args in ex.bindings():
                if isinstance(dest, Queue):
                    if dest.exclusive_owner is not None:
                        continue
                    kind, dest_name = "queue", dest.name
                else:
                    kind, dest_name = "exchange", str(getattr(dest, "name", ""))
                bindings.append({"source": ex.name, "vhost": name, "destination": dest_name,
                                 "destination_type": kind, "routing_key": rk, "arguments": jsonable(args)})
    policies = [p for p in mgmt.policies.list() if p["vhost"] in vhost_names]
    parameters = _parameters(mgmt, vhost_names)
    queues.sort(key=lambda e: (e["vhost"], e["name"]))
    exchanges.sort(key=lambda e: (e["vhost"], e["name"]))
    bindings.sort(key=lambda e: (e["vhost"], e["source"], e["destination_type"], e["destination"],
                                 e["routing_key"], repr(e["arguments"])))
    if vhost is not None:
        for entry in (*queues, *exchanges, *bindings, *policies, *parameters):
            entry.pop("vhost", None)
        return {"rabbit_version": "3.10.0", "rabbitmq_version": "3.10.0", "product_name": "Skred",
                "product_version": __version__, "parameters": parameters, "policies": policies,
                "queues": queues, "exchanges": exchanges, "bindings": bindings}
    users = broker.users.list()
    return {
        "rabbit_version": "3.10.0",
        "rabbitmq_version": "3.10.0",
        "product_name": "Skred",
        "product_version": __version__,
        "users": [{"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": u.hashing_algorithm,
                   "tags": list(u.tags), "limits": dict(sorted(u.limits.items()))} for u in users],
        "vhosts": [{"name": n, **broker.vhosts[n].meta.to_json(), "metadata": broker.vhosts[n].meta.to_json(),
                    "limits": []} for n in vhost_names],
        "permissions": [{"user": u.name, "vhost": v, "configure": p.configure, "write": p.write,
                         "read": p.read} for u in users for v, p in sorted(u.permissions.items())],
        "topic_permissions": topic_permissions_json(users),
        "parameters": parameters,
        "global_parameters": mgmt.global_parameters.list(),
        "policies": policies,
        "queues": queues,
        "exchanges": exchanges,
        "bindings": bindings,
    }


# ---------------------------------------------------------------------- validate
def _fail(where: str, what: str) -> DefinitionsError:
    return DefinitionsError(f"{where}: {what}")


def _list(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise _fail(key, "must be a list of objects")
    return value


def _name(where: str, entry: dict[str, Any], key: str = "name", allow_empty: bool = False,
          kind: str | None = None) -> str:
    """``entry[key]`` as a name of ``kind`` (default: ``key``; "queue" and "exchange" names are
    as free as in RabbitMQ, see ``broker.auth.names``)."""
    value = entry.get(key)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise _fail(where, f"'{key}' must be a non-empty string")
    problem = name_problem(kind or key, value) if value else None
    if problem:
        raise _fail(where, f"'{key}': {problem}")
    return value


def _bool(where: str, entry: dict[str, Any], key: str, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise _fail(where, f"'{key}' must be a boolean")
    return value


def _args(where: str, entry: dict[str, Any]) -> dict[str, Any]:
    value = entry.get("arguments") or {}
    if not isinstance(value, dict):
        raise _fail(where, "'arguments' must be an object")
    return value


class Plan:
    """A validated document, ready to apply."""

    def __init__(self) -> None:
        self.vhosts: list[str] = []
        self.vhost_meta: dict[str, dict[str, Any]] = {}
        self.limits: list[tuple[str, str, int]] = []
        self.operator_policies: list[dict[str, Any]] = []
        self.users: list[tuple[str, dict[str, Any]]] = []
        self.permissions: list[tuple[str, str, str, str, str]] = []
        self.policies: list[dict[str, Any]] = []
        self.exchanges: list[tuple[str, str, str, bool, bool, bool, dict[str, Any]]] = []
        self.queues: list[tuple[str, str, bool, bool, dict[str, Any]]] = []
        self.bindings: list[tuple[str, str, str, str, str, dict[str, Any]]] = []
        self.grants = definitions_grants.Grants()  # topic permissions, user limits, global parameters
        self.runtime: list[tuple[str, str, str, Any]] = []  # component, vhost, name, value (shovels...)


def validate(mgmt: Mgmt, doc: Any, vhost: str | None = None) -> Plan:
    if not isinstance(doc, dict):
        raise DefinitionsError("definitions must be a JSON object")
    broker = mgmt.broker
    plan = Plan()
    if vhost is None:
        for i, e in enumerate(_list(doc, "vhosts")):
            name = _name(f"vhosts[{i}]", e)
            if name not in broker.vhosts and name not in plan.vhosts:
                plan.vhosts.append(name)
            try:
                plan.vhost_meta[name] = vhost_meta_fields(e)
            except ValueError as exc:
                raise _fail(f"vhosts[{i}]", str(exc)) from None
        for i, e in enumerate(_list(doc, "users")):
            where = f"users[{i}]"
            name = _name(where, e)
            for key in ("password_hash", "password"):
                if key in e and not isinstance(e[key], str):
                    raise _fail(where, f"'{key}' must be a string")
            if "password_hash" not in e and "password" not in e and broker.users.get(name) is None:
                raise _fail(where, "needs 'password_hash' or 'password'")
            algorithm = e.get("hashing_algorithm", HASHING_ALGORITHM)
            if algorithm not in ALGORITHMS:
                raise _fail(where, f"unknown hashing_algorithm {algorithm!r}")
            tags = e.get("tags", [])
            if isinstance(tags, str):
                tags = [t for t in tags.split(",") if t.strip()]
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise _fail(where, "'tags' must be a list of strings or a comma-separated string")
            entry = {**e, "tags": tags, "hashing_algorithm": algorithm}
            if "password" in entry:  # never written down in clear (the intent file)
                password = entry.pop("password")
                if "password_hash" not in entry:
                    entry.update(password_hash=hash_password(password), hashing_algorithm=HASHING_ALGORITHM)
            plan.users.append((name, entry))
    known_vhosts = set(broker.vhosts) | set(plan.vhosts)
    user_names = {u.name for u in broker.users.list()} | {n for n, _ in plan.users}

    def vhost_of(where: str, e: dict[str, Any]) -> str:
        if vhost is not None:
            return vhost
        name = _name(where, e, "vhost")
        if name not in known_vhosts:
            raise _fail(where, f"vhost '{name}' does not exist")
        return name

    def default_type(vh_name: str) -> str:
        meta = plan.vhost_meta.get(vh_name, {})
        if "default_queue_type" in meta:
            return str(meta["default_queue_type"])
        vh = broker.vhosts.get(vh_name)
        return vh.meta.default_queue_type if vh is not None else queue_types.CLASSIC

    if vhost is None:
        for i, e in enumerate(_list(doc, "permissions")):
            where = f"permissions[{i}]"
            user = _name(where, e, "user")
            if user not in user_names:
                raise _fail(where, f"user '{user}' does not exist")
            vh_name = vhost_of(where, e)
            regexes = []
            for key in ("configure", "write", "read"):
                value = e.get(key)
                if not isinstance(value, str):
                    raise _fail(where, f"'{key}' must be a string")
                regexes.append(value)
            try:
                for rx in regexes:
                    compile_pattern(rx)
            except PatternError as exc:
                raise _fail(where, f"invalid regex: {exc}") from None
            plan.permissions.append((user, vh_name, regexes[0], regexes[1], regexes[2]))
    for i, e in enumerate(_list(doc, "policies")):
        where = f"policies[{i}]"
        vh_name = vhost_of(where, e)
        body = {k: v for k, v in e.items() if k not in ("vhost", "name")}
        try:
            plan.policies.append(validate_policy(vh_name, _name(where, e), body))
        except ValueError as exc:
            raise _fail(where, str(exc)) from None
    if vhost is None:
        try:
            plan.grants = definitions_grants.validate(doc, user_names, known_vhosts)
        except definitions_grants.GrantsError as exc:
            raise _fail(exc.where, exc.what) from None
    for i, e in enumerate(_list(doc, "parameters")):
        _parameter(plan, f"parameters[{i}]", vhost_of(f"parameters[{i}]", e), e, mgmt)
    declared: dict[tuple[str, str, str], bool] = {}
    kinds: dict[tuple[str, str], str] = {}  # (vhost, exchange) -> type, for the document's own
    for i, e in enumerate(_list(doc, "exchanges")):
        where = f"exchanges[{i}]"
        vh_name = vhost_of(where, e)
        name = _name(where, e, kind="exchange")
        type_ = e.get("type")
        if type_ not in EXCHANGE_TYPES:
            raise _fail(where, f"unknown exchange type {type_!r}")
        durable = _bool(where, e, "durable", True)
        auto_delete = _bool(where, e, "auto_delete", False)
        internal = _bool(where, e, "internal", False)
        args = _args(where, e)
        current = broker.vhosts[vh_name].exchanges.get(name) if vh_name in broker.vhosts else None
        if current is not None:
            if (current.type, current.durable, current.auto_delete, current.internal) != (
                    type_, durable, auto_delete, internal):
                raise _fail(where, f"exchange '{name}' in vhost '{vh_name}' exists with other properties")
        elif name.startswith("amq."):
            raise _fail(where, f"exchange name '{name}' uses the reserved prefix 'amq.'")
        else:
            try:  # what the declare would refuse (a delayed exchange without its x-delayed-type)
                Exchange(name, str(type_), durable, auto_delete, internal, args)
            except errors.AMQPError as exc:
                raise _fail(where, exc.reply_text) from None
            plan.exchanges.append((vh_name, name, str(type_), durable, auto_delete, internal, args))
        declared[(vh_name, "exchange", name)] = True
        kinds[(vh_name, name)] = str(type_)
    for i, e in enumerate(_list(doc, "queues")):
        where = f"queues[{i}]"
        vh_name = vhost_of(where, e)
        name = _name(where, e, kind="queue")
        durable = _bool(where, e, "durable", True)
        auto_delete = _bool(where, e, "auto_delete", False)
        args = _queue_args(where, e, name, vh_name, durable, auto_delete, default_type(vh_name))
        current_q = broker.vhosts[vh_name].queues.get(name) if vh_name in broker.vhosts else None
        if current_q is not None:
            if (current_q.durable, current_q.auto_delete, queue_types.type_of(current_q.arguments)) != (
                    durable, auto_delete, queue_types.type_of(args)):
                raise _fail(where, f"queue '{name}' in vhost '{vh_name}' exists with other properties")
        elif name.startswith("amq."):
            raise _fail(where, f"queue name '{name}' uses the reserved prefix 'amq.'")
        else:
            try:  # a bad x-argument: the declare's 406, refused before anything is applied
                features.parse_arguments(args, name, vh_name)
            except errors.AMQPError as exc:
                raise _fail(where, exc.reply_text) from None
            plan.queues.append((vh_name, name, durable, auto_delete, args))
        declared[(vh_name, "queue", name)] = True
    for i, e in enumerate(_list(doc, "bindings")):
        where = f"bindings[{i}]"
        vh_name = vhost_of(where, e)
        source = _name(where, e, "source", allow_empty=True, kind="exchange")
        kind = e.get("destination_type")
        if kind not in ("queue", "exchange"):
            raise _fail(where, "'destination_type' must be 'queue' or 'exchange'")
        dest = _name(where, e, "destination", kind=str(kind))
        rk = e.get("routing_key", "")
        if not isinstance(rk, str) or len(rk.encode()) > MAX_NAME_BYTES:
            raise _fail(where, "'routing_key' must be a string of at most 255 bytes")
        if source == "":
            continue  # the default exchange's implicit bindings are never imported
        vh = broker.vhosts.get(vh_name)
        if (vh_name, "exchange", source) not in declared and source not in (
                vh.exchanges if vh is not None else DEFAULT_EXCHANGE_NAMES):
            raise _fail(where, f"source exchange '{source}' does not exist")
        pool = (vh.queues if kind == "queue" else vh.exchanges) if vh is not None else {}
        if (vh_name, str(kind), dest) not in declared and dest not in pool:
            raise _fail(where, f"destination {kind} '{dest}' does not exist")
        args = _args(where, e)
        source_type = kinds.get((vh_name, source)) or (
            vh.exchanges[source].type if vh is not None and source in vh.exchanges else None)
        if source_type == "headers" and args:
            try:
                check_x_match(args)
            except errors.AMQPError as exc:
                raise _fail(where, exc.reply_text) from None
        plan.bindings.append((vh_name, source, dest, str(kind), rk, args))
    _check_queue_limits(mgmt, plan)
    return plan


def _check_queue_limits(mgmt: Mgmt, plan: Plan) -> None:
    """A vhost's max-queues (as the document leaves it) must hold the queues it adds."""
    limits: dict[str, int | None] = {n: vh.limits.max_queues for n, vh in mgmt.broker.vhosts.items()}
    for vh_name, key, limit in plan.limits:
        if key == "max-queues":
            limits[vh_name] = limit if limit >= 0 else None
    added: dict[str, set[str]] = {}
    for vh_name, name, *_ in plan.queues:
        added.setdefault(vh_name, set()).add(name)
    for vh_name, names in added.items():
        cap = limits.get(vh_name)
        vh = mgmt.broker.vhosts.get(vh_name)
        now = len(vh.queues) if vh is not None else 0
        if cap is not None and now + len(names) > cap:
            raise _fail("queues", f"vhost '{vh_name}' allows {cap} queues: the document adds "
                        f"{len(names)} to {now}")


def _queue_args(where: str, e: dict[str, Any], name: str, vh_name: str, durable: bool,
                auto_delete: bool, default_type: str) -> dict[str, Any]:
    """The queue's arguments with its type settled as a declare would settle it."""
    args = _args(where, e)
    if "x-queue-type" not in args and isinstance(e.get("type"), str):
        args = {**args, "x-queue-type": e["type"]}
    args = queue_types.with_default(args, durable=durable, exclusive=False, default_type=default_type)
    try:
        return queue_types.resolve(args, durable=durable, exclusive=False, auto_delete=auto_delete,
                                   queue=name, vhost=vh_name)
    except errors.AMQPError as exc:
        raise _fail(where, exc.reply_text) from None


def _parameter(plan: Plan, where: str, vh_name: str, e: dict[str, Any], mgmt: Mgmt) -> None:
    component, value = e.get("component"), e.get("value")
    if component == LIMITS_COMPONENT:
        if not isinstance(value, dict):
            raise _fail(where, "'value' must be an object of limits")
        for key, limit in value.items():
            if key not in LIMIT_NAMES or isinstance(limit, bool) or not isinstance(limit, int):
                raise _fail(where, f"bad vhost limit {key!r}: {limit!r}")
            plan.limits.append((vh_name, key, limit))
    elif component == OPERATOR_POLICY_COMPONENT:
        try:
            plan.operator_policies.append(validate_policy(vh_name, _name(where, e), value))
        except ValueError as exc:
            raise _fail(where, str(exc)) from None
    elif mgmt.parameters is not None and isinstance(component, str) and mgmt.parameters.knows(component):
        name = _name(where, e)
        try:
            checked = mgmt.parameters.check(component, vh_name, name, value)
            plan.runtime.append((component, vh_name, name, checked))
        except ValueError as exc:
            raise _fail(where, str(exc)) from None
    else:
        log.warning("definitions: %s: no plugin provides component %r; skipped", where, component)


class _Undo:
    """What ``apply`` changed so far, as steps that take it back, run newest first.

    Topology steps (``topology``) run without delete records while ``cut`` holds: the caller
    then cuts the import's records off the definitions logs. When another writer's records
    landed among the import's (``cut`` cleared: module docstring), they run as logged deletes,
    and one whose object another client already removed is done already."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], object]] = []
        self.cut = True

    def add(self, step: Callable[[], object]) -> None:
        self.steps.append(step)

    def topology(self, vh: VHost, change: Callable[..., object], *args: Any, **kw: Any) -> None:
        if not self.cut:
            try:
                change(*args, **kw)
            except errors.NotFound:
                pass
            return
        with vh.unlogged():
            change(*args, **kw)

    def run(self) -> None:
        for step in reversed(self.steps):
            step()


def _new_queue_dirs(mgmt: Mgmt, plan: Plan) -> list[tuple[str, str, str]]:
    """(vhost, queue, directory) of each new classic durable queue the plan declares."""
    out = []
    for vh_name, name, durable, _auto_delete, args in plan.queues:
        vh = mgmt.broker.vhosts[vh_name]
        if durable and name not in vh.queues and queue_types.type_of(args) != queue_types.STREAM:
            out.append((vh_name, name, vh.queue_directory(name)))
    return out


def _make_queue_dirs(dirs: list[tuple[str, str, str]]) -> None:
    """Make each queue's directory and ``.queue`` name file, as its declare would (not fsynced
    there either: a boot makes a missing one again from the definitions log)."""
    for _vh, name, path in dirs:
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, ".queue")
        if not os.path.exists(marker):
            with open(marker, "wb") as f:
                f.write(name.encode("utf-8"))


def _drop_unused_dirs(mgmt: Mgmt, dirs: list[tuple[str, str, str]]) -> None:
    """Undo of ``_make_queue_dirs``: the directories no queue was declared on."""
    for vh_name, name, path in dirs:
        vh = mgmt.broker.vhosts.get(vh_name)
        if vh is None or name not in vh.queues:
            shutil.rmtree(path, ignore_errors=True)


def _put_policy(api: PolicyApi, doc: dict[str, Any], undo: _Undo) -> None:
    before = api.get(doc["vhost"], doc["name"])
    api.put(doc)
    undo.add(lambda: api.put(before) if before is not None else api.delete(doc["vhost"], doc["name"]))


def apply(mgmt: Mgmt, plan: Plan, undo: _Undo | None = None) -> None:
    _run_inline(apply_steps(mgmt, plan, undo if undo is not None else _Undo()))


Offload = Callable[[], None] | None  # what ``apply_steps`` yields: file system work, or nothing
Steps = Generator[Offload, None, None]


def apply_steps(mgmt: Mgmt, plan: Plan, undo: _Undo) -> Steps:
    """``apply``, yielding after each exchange, queue, binding and runtime parameter: where an
    import may let the event loop run (``import_steps``). It also yields, once, the new queues'
    directories and name files to make, for the caller to run (in a thread, or inline)."""
    broker = mgmt.broker
    users = broker.users
    for name in plan.vhosts:
        mgmt.create_vhost(name)
        undo.add(lambda name=name: mgmt.delete_vhost(name))  # type: ignore[misc]
    for name, meta in plan.vhost_meta.items():
        if meta:
            vmeta = broker.vhosts[name].meta
            before = vmeta.to_json()
            vmeta.update(**meta)
            undo.add(lambda vmeta=vmeta, before=before: vmeta.update(**before))  # type: ignore[misc]
    for vh_name, key, limit in plan.limits:
        limits = broker.vhosts[vh_name].limits
        old = limits.values.get(key, -1)
        limits.set(key, limit)
        undo.add(lambda limits=limits, key=key, old=old: limits.set(key, old))  # type: ignore[misc]
    users_before = users.list()
    undo.add(lambda: users.restore(users_before))
    for name, e in plan.users:
        existing = users.get(name)
        tags = e["tags"]
        if existing is None:
            users.add_user(name, None, tags, password_hash=e.get("password_hash", ""))
        else:
            users.set_tags(name, tags)
        if "password_hash" in e and (existing is not None or e["hashing_algorithm"] != HASHING_ALGORITHM):
            # No public setter for an imported hash yet; _replace is UserStore's single write path.
            users._replace(name, password_hash=e["password_hash"], hashing_algorithm=e["hashing_algorithm"])
    for user, vh_name, configure, write, read in plan.permissions:
        users.set_permissions(user, vh_name, configure, write, read)
    params = mgmt.global_parameters  # topic permissions and user limits live in users.json (above)
    for name, _ in plan.grants.global_parameters:
        old_value = params.get(name) if name in params else None
        undo.add(lambda name=name, old=old_value: params.put(name, old)  # type: ignore[misc]
                 if old is not None else params.delete(name))
    definitions_grants.apply(mgmt, plan.grants)
    for policy in plan.policies:
        _put_policy(mgmt.policies, policy, undo)
    for policy in plan.operator_policies:
        _put_policy(mgmt.operator_policies, policy, undo)
    # Topology is undone without delete records (``VHost.unlogged``): ``import_definitions``
    # cuts the records this import appended off each definitions log instead, which needs no
    # disk space (a full disk is the likely reason to undo).
    for vh_name, name, type_, durable, auto_delete, internal, args in plan.exchanges:
        vh = broker.vhosts[vh_name]
        if name not in vh.exchanges:
            vh.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete,
                                internal=internal, arguments=args)
            undo.add(lambda vh=vh, name=name: undo.topology(vh, vh.delete_exchange, name))  # type: ignore[misc]
        yield None
    dirs = _new_queue_dirs(mgmt, plan)
    if dirs:  # the file system's part of the declares, off the loop (module docstring)
        undo.add(lambda: _drop_unused_dirs(mgmt, dirs))
        yield lambda: _make_queue_dirs(dirs)
    for vh_name, name, durable, auto_delete, args in plan.queues:
        vh = broker.vhosts[vh_name]
        _q, created = vh.declare_queue(name, durable=durable, auto_delete=auto_delete, arguments=args,
                                       owner=None)
        if created:
            undo.add(lambda vh=vh, name=name: undo.topology(vh, vh.delete_queue, name, owner=None))  # type: ignore[misc]
        yield None
    for vh_name, source, dest, kind, rk, args in plan.bindings:
        vh = broker.vhosts[vh_name]
        target: object = vh.queues[dest] if kind == "queue" else vh.exchanges[dest]
        if vh.exchanges[source].is_bound(target, rk, args):
            continue
        if kind == "queue":
            vh.bind_queue(dest, source, rk, args, owner=None)
            undo.add(lambda vh=vh, d=dest, s=source, rk=rk, a=args:  # type: ignore[misc]
                     undo.topology(vh, vh.unbind_queue, d, s, rk, a, owner=None))
        else:
            vh.bind_exchange(dest, source, rk, args)
            undo.add(lambda vh=vh, d=dest, s=source, rk=rk, a=args:  # type: ignore[misc]
                     undo.topology(vh, vh.unbind_exchange, d, s, rk, a))
        yield None
    runtime = mgmt.parameters
    for component, vh_name, name, value in plan.runtime:  # last: a shovel starts on what exists
        assert runtime is not None
        old = runtime.get(component, vh_name, name)
        runtime.put(component, vh_name, name, value)
        undo.add(lambda c=component, v=vh_name, n=name, old=old:  # type: ignore[misc]
                 runtime.put(c, v, n, old) if old is not None else runtime.delete(c, v, n))
        yield None


def import_definitions(mgmt: Mgmt, doc: Any, vhost: str | None = None, *, resuming: bool = False) -> None:
    """Validate, write down, apply, make durable, forget: all or nothing, across a crash too
    (module docstring), in one go (boot: nothing else runs yet). Raises DefinitionsError
    (nothing changed) on a bad document. ``resuming``: completing an import written down before
    a crash; if that fails, the state holds a prefix from before the crash that no undo here
    can take back, so the import stays written down for the next start and the error goes up."""
    _run_inline(import_steps(mgmt, doc, vhost, resuming=resuming))


async def import_definitions_async(mgmt: Mgmt, doc: Any, vhost: str | None = None) -> None:
    """``import_definitions`` for a serving node: one import at a time, the event loop let run
    between slices (module docstring). Once applying, the import finishes or is undone even if
    the request is cancelled."""
    async with mgmt.import_lock:
        steps = import_steps(mgmt, doc, vhost)
        failed: BaseException | None = None
        while True:
            try:  # a failed offload is raised where it was yielded: the import undoes itself
                work = steps.send(None) if failed is None else steps.throw(failed)
            except StopIteration:
                return
            failed = None
            offloaded = None if work is None else _FILE_WORK.submit(work)
            try:
                await (asyncio.sleep(0) if offloaded is None  # shield: a cancel never stops it
                       else asyncio.shield(asyncio.wrap_future(offloaded)))
            except asyncio.CancelledError:
                if offloaded is not None:
                    concurrent.futures.wait([offloaded])  # it must not overlap what follows
                _run_inline(steps, offloaded)
                raise
            except Exception as exc:
                failed = exc


def _run_inline(steps: Steps, done: concurrent.futures.Future[None] | None = None) -> None:
    """Drive ``steps`` to their end, running each offload here; ``done``: the offload the last
    step yielded, already run (its error, if any, is raised into the steps)."""
    failed = done.exception() if done is not None else None
    while True:
        try:
            work = next(steps) if failed is None else steps.throw(failed)
        except StopIteration:
            return
        failed = None
        if work is not None:
            try:
                work()
            except Exception as exc:
                failed = exc


def import_steps(mgmt: Mgmt, doc: Any, vhost: str | None = None, *, resuming: bool = False,
                 slice_s: float = SLICE_S) -> Steps:
    """The import, yielding each time it has run ``slice_s`` seconds: a caller may let other
    work run there (``import_definitions_async``) or not (``import_definitions``)."""
    plan = validate(mgmt, doc, vhost)
    if plan.users:  # written down with the passwords validate hashed
        doc = {**doc, "users": [e for _, e in plan.users]}
    intent = mgmt.import_intent
    vhosts = mgmt.broker.vhosts
    touched = {e[0] for e in (*plan.exchanges, *plan.queues, *plan.bindings) if e[0] in vhosts}
    marks = {name: vhosts[name].definitions.size() for name in touched}  # where the import's records start
    if not resuming:
        intent.begin({"vhost": vhost, "definitions": doc})
    undo = _Undo()
    try:
        slice_end = time.monotonic() + slice_s
        for work in apply_steps(mgmt, plan, undo):
            if work is None and time.monotonic() < slice_end:
                continue
            ends = _log_ends(mgmt, touched)
            yield work
            if undo.cut and _log_ends(mgmt, touched) != ends:
                undo.cut = False  # another writer's records follow ours: no cut (module docstring)
            slice_end = time.monotonic() + slice_s
        for vh in vhosts.values():
            vh.definitions.sync()  # durable before the intent goes (JSON stores are fsynced)
    except BaseException:
        if resuming:
            raise
        try:
            undo.run()
            if undo.cut:
                for name, mark in marks.items():
                    if name in vhosts:
                        vhosts[name].definitions.cut(mark)
        except BaseException:
            log.exception("definitions import failed and could not be undone: it is completed "
                          "when the node restarts")
            raise
        intent.done()
        raise
    intent.done()


def _log_ends(mgmt: Mgmt, names: set[str]) -> list[tuple[int, int]]:
    """Where each touched vhost's definitions log ends, and its appends since compacting (a
    compaction rewrites it): unchanged across a yield means no other writer wrote there."""
    vhosts = mgmt.broker.vhosts
    return [(vhosts[n].definitions.size(), vhosts[n].definitions.appended_since_compact)
            if n in vhosts else (-1, -1) for n in sorted(names)]


def resume_import(mgmt: Mgmt) -> None:
    """Complete an import a crash cut off (module docstring); called before the node serves.
    If it cannot be completed (a full disk) the node does not start: it never serves a prefix."""
    pending = mgmt.import_intent.pending()
    if pending is None:
        return
    if not isinstance(pending, dict) or "definitions" not in pending:
        log.error("%s is not an import written down by this broker; ignored", IMPORT_INTENT_FILE)
        return
    log.warning("completing a definitions import that a crash cut off")
    try:
        import_definitions(mgmt, pending["definitions"], pending.get("vhost"), resuming=True)
    except DefinitionsError as exc:  # cannot happen to a document it accepted before; say so
        log.error("a definitions import cut off by a crash cannot be completed (%s); dropped", exc)
        mgmt.import_intent.done()
