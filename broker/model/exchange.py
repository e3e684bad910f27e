"""Exchanges and routing: direct, fanout, topic, headers, exchange-to-exchange.

Theory of operation
-------------------
An exchange maps a routing key (and, for headers exchanges, the message
headers) to a set of destinations: queues or other exchanges. Bindings are
kept in the shape each type routes with, so a publish costs one dict lookup
(direct), nothing (fanout), a cached trie walk (topic: the result per
routing key is memoised until the bindings change; see ``TopicTrie``) or a scan
of the header bindings (headers; the only type that decodes message properties,
and it does so lazily through ``headers_of``). Exchange-to-exchange bindings are followed
by the vhost, which owns loop detection.

The default exchange ("") binds every queue once, under the queue's own name and
without arguments (the vhost refuses any other binding to it). With 100k queues
the general bookkeeping (binding tuple, args dict, per-destination lists and
counts) would cost ~0.7 KB per queue, so it keeps only the routing dict
``_direct`` (name -> [queue]); ``bindings()`` is synthesised from it in the same
order and shape, and ``unbind_all`` finds a queue by its ``name`` attribute.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from broker import errors
from broker.model import exchange_features
from broker.patterns import Pattern, compile_pattern

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers", *exchange_features.EXTRA_TYPES)
_TOPIC_CACHE_MAX = 4096


def args_key(args: dict[str, Any] | None) -> str:
    """A hashable identity for binding arguments (bindings differ by args)."""
    if not args:
        return ""
    return repr(sorted((str(k), repr(v)) for k, v in args.items()))


class TopicLiteral:
    """A topic binding key without a wildcard word matches one routing key only: compared as a
    string, with no compiled pattern (10,000 MQTT sessions' literal keys compiled 10,000 RE2
    programs at every boot). ``pattern`` is the regex source ``topic_regex`` would compile."""

    __slots__ = ("pattern", "_dotted")

    def __init__(self, pattern: str, dotted: str) -> None:
        self.pattern = pattern
        self._dotted = dotted

    def fullmatch(self, text: str) -> bool:
        return text == self._dotted


def topic_source(pattern: str) -> tuple[str, bool]:
    """The regex source of an AMQP topic pattern, and whether it has a wildcard word."""
    out = []
    wild = False
    for w in pattern.split("."):
        if w == "#":
            out.append(r"(?:\.[^.]*)*")
            wild = True
        elif w == "*":
            out.append(r"\.[^.]*")
            wild = True
        else:
            out.append(r"\." + re.escape(w))
    return "(?s)" + "".join(out), wild


def topic_regex(pattern: str) -> Pattern | TopicLiteral:
    """Compile an AMQP topic pattern: ``*`` is one word, ``#`` zero or more.

    Matched (whole) against ``"." + routing_key`` so every word, the first included,
    carries a leading dot and ``#`` can swallow whole dotted words. A binding key is
    client input and runs on every publish: it is compiled for RE2 (``broker.patterns``),
    linear in the routing key (with Python's ``re``, ``#.#.#.#.#.x`` against a key of 60
    words took 1.5 s of the event loop per publish). A key without wildcards needs no regex.
    """
    source, wild = topic_source(pattern)
    return compile_pattern(source) if wild else TopicLiteral(source, "." + pattern)


def topic_match(pattern: str, key: str) -> bool:
    """Reference matcher (word lists); used to cross-check the regex in tests."""
    return _match_words(pattern.split("."), key.split("."))


def _match_words(p: list[str], k: list[str]) -> bool:
    if not p:
        return not k
    head = p[0]
    if head == "#":
        return any(_match_words(p[1:], k[i:]) for i in range(len(k) + 1))
    if not k:
        return False
    if head == "*" or head == k[0]:
        return _match_words(p[1:], k[1:])
    return False


_NO_WORDS: dict[str, _TrieNode] = {}  # shared, never written (a node copies before adding)
_NO_DESTS: list[tuple[int, object, str]] = []


class _TrieNode:
    """One word position of the topic trie: the literal words after it, the ``*`` and ``#``
    branches, and the bindings whose key ends here, as (binding number, destination, the
    binding arguments' identity ``args_key``)."""

    __slots__ = ("words", "star", "hash", "loops", "dests")

    def __init__(self, loops: bool = False) -> None:
        # a leaf (most nodes: the last word of a key) shares the empty ones until it needs its
        # own (``TopicTrie.add``): 10,000 sessions' keys, 10,000 leaves
        self.words: dict[str, _TrieNode] = _NO_WORDS
        self.star: _TrieNode | None = None
        self.hash: _TrieNode | None = None
        self.loops = loops  # reached by a '#': it may swallow any number of further words
        self.dests: list[tuple[int, object, str]] = _NO_DESTS

    def empty(self) -> bool:
        return not (self.dests or self.words or self.star is not None or self.hash is not None)


class TopicTrie:
    """A topic exchange's bindings as a trie of their words, so routing a routing key costs a
    walk over the words it can match, not a pattern match per binding (10,000 MQTT sessions'
    bindings made every first publish to a new topic 10,000 matches).

    Matching is a walk of an automaton over states (trie node, words consumed): a literal word
    and ``*`` consume one word, ``#`` enters its node consuming none and that node may consume
    any number more (its ``loops``). Each state is visited once, so the walk is linear in the
    states reachable: a miss costs about one dict lookup per word of the routing key, and the
    worst case (many ``#``) is bounded by trie size times key length, as the pattern scan it
    replaces was (no backtracking: a routing key is at most 255 bytes, 128 words). The words
    are AMQP's (``topic_match`` is the reference): a key is split on ``.``, so ``""`` is one
    empty word, ``#`` also matches none, ``*`` exactly one.

    The destinations come back in the order of their first matching binding, as the scan over
    the bindings in order gave them: a binding is numbered when added and the matches are
    sorted by that number. Removing a binding removes that one (its arguments' identity is
    kept with it): the pattern list removed the first of a destination's bindings with the key,
    whatever its arguments, which could move the destination in that order."""

    __slots__ = ("root", "_n")

    def __init__(self) -> None:
        self.root = _TrieNode()
        self._n = 0

    def add(self, pattern: str, dest: object, ident: str = "") -> None:
        node = self.root
        for w in pattern.split("."):
            if w == "#":
                nxt = node.hash
                if nxt is None:
                    nxt = node.hash = _TrieNode(loops=True)
            elif w == "*":
                nxt = node.star
                if nxt is None:
                    nxt = node.star = _TrieNode()
            else:
                nxt = node.words.get(w)
                if nxt is None:
                    if node.words is _NO_WORDS:
                        node.words = {}
                    nxt = node.words[w] = _TrieNode()
            node = nxt
        self._n += 1
        if node.dests is _NO_DESTS:
            node.dests = []
        node.dests.append((self._n, dest, ident))

    def remove(self, pattern: str, dest: object, ident: str = "") -> bool:
        """Forget the binding of ``dest`` with ``pattern`` and arguments ``ident``; nodes left
        empty go."""
        path: list[tuple[_TrieNode, str]] = []
        node = self.root
        for w in pattern.split("."):
            path.append((node, w))
            nxt = node.hash if w == "#" else node.star if w == "*" else node.words.get(w)
            if nxt is None:
                return False
            node = nxt
        for i, (_, d, a) in enumerate(node.dests):
            if d == dest and a == ident:
                del node.dests[i]
                break
        else:
            return False
        for parent, w in reversed(path):
            if not node.empty():
                break
            if w == "#":
                parent.hash = None
            elif w == "*":
                parent.star = None
            else:
                del parent.words[w]
            node = parent
        return True

    def match(self, routing_key: str) -> tuple[object, ...]:
        words = routing_key.split(".")
        n = len(words)
        found: list[tuple[int, object, str]] = []
        seen: set[tuple[int, int]] = set()
        todo = [(self.root, 0)]
        while todo:
            node, i = todo.pop()
            state = (id(node), i)
            if state in seen:
                continue
            seen.add(state)
            if node.hash is not None:
                todo.append((node.hash, i))  # '#' matching no word
            if i == n:
                found.extend(node.dests)
                continue
            nxt = node.words.get(words[i])
            if nxt is not None:
                todo.append((nxt, i + 1))
            if node.star is not None:
                todo.append((node.star, i + 1))
            if node.loops:
                todo.append((node, i + 1))  # its '#' takes one more word
        if not found:
            return ()
        found.sort(key=_first)
        out: list[object] = []
        for _, dest, _a in found:
            if dest not in out:
                out.append(dest)
        return tuple(out)


def _first(binding: tuple[int, object, str]) -> int:
    return binding[0]


def headers_match(binding_args: dict[str, Any], headers: dict[str, Any] | None) -> bool:
    """x-match all (default) / any, and the -with-x variants, as RabbitMQ does."""
    mode = binding_args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode()
    with_x = mode in ("all-with-x", "any-with-x")
    want_all = mode in ("all", "all-with-x")
    headers = headers or {}
    checked = 0
    for k, v in binding_args.items():
        if k == "x-match" or (k.startswith("x-") and not with_x):
            continue
        checked += 1
        present = k in headers
        # typed comparison, as RabbitMQ does: True must not match 1
        ok = present and (v is None or (headers[k] == v and type(headers[k]) is type(v)))
        if want_all and not ok:
            return False
        if not want_all and ok:
            return True
    return want_all


X_MATCH_MODES = ("all", "any", "all-with-x", "any-with-x")


def check_x_match(args: dict[str, Any]) -> None:
    """A headers binding's x-match must be one of RabbitMQ's four modes: 406 otherwise."""
    mode = args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode(errors="replace")
    if mode not in X_MATCH_MODES:
        raise errors.PreconditionFailed(
            f"Invalid x-match field value {mode!r}; expected all, any, all-with-x, or any-with-x")


class Exchange:
    """One exchange and its bindings. Destinations are opaque hashable objects."""

    __slots__ = (
        "name", "type", "durable", "auto_delete", "internal", "arguments",
        "_bindings", "_direct", "_all", "_trie", "_topic_cache", "_headers", "alternate",
        "_by_dest", "_refs", "kind", "special", "_default", "n_in", "n_out",
    )

    def __init__(
        self,
        name: str,
        type_: str,
        durable: bool = True,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        if type_ not in EXCHANGE_TYPES:
            raise errors.CommandInvalid(f"unknown exchange type '{type_}'", 40, 10)
        self.name = name
        # messages published to it, and routed out of it (one per queue reached): the API's
        # publish_in / publish_out, read at sample time
        self.n_in = 0
        self.n_out = 0
        self.type = type_
        # routing type (a delayed exchange routes as its x-delayed-type; 406 if missing)
        self.kind = exchange_features.routing_kind(type_, arguments or {})
        # delayed / consistent-hash / dedup: broker/model/exchange_features.py (None: plain)
        self.special: exchange_features.ExchangeSpecial | None = None
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = dict(arguments or {})
        alt = self.arguments.get("alternate-exchange")
        self.alternate: str | None = str(alt) if alt else None
        # (destination, routing key, args identity) -> args
        self._bindings: dict[tuple[object, str, str], dict[str, Any]] = {}
        self._direct: dict[str, list[object]] = {}
        self._all: tuple[object, ...] | None = ()  # fanout destinations; None: rebuild from _refs
        self._by_dest: dict[object, list[tuple[object, str, str]]] = {}
        self._refs: dict[object, int] = {}  # bindings per destination
        self._trie = TopicTrie()
        self._topic_cache: dict[str, tuple[object, ...]] = {}
        self._headers: list[tuple[dict[str, Any], object]] = []
        # The default exchange: only _direct is kept (see the module docstring).
        self._default = name == "" and type_ == "direct"

    # --------------------------------------------------------------- bindings
    def bind(self, dest: object, routing_key: str, args: dict[str, Any] | None = None) -> bool:
        """Add a binding in O(1) (O(n) only for topic/headers caches): 100k queues bind to
        the default exchange, so nothing here may rescan all bindings."""
        if self._default:
            if args:
                raise ValueError("the default exchange takes no binding arguments")
            if routing_key in self._direct:
                return False
            self._direct[routing_key] = [dest]
            return True
        key = (dest, routing_key, args_key(args))
        if key in self._bindings:
            return False
        args = dict(args or {})
        self._bindings[key] = args
        self._by_dest.setdefault(dest, []).append(key)
        lst = self._direct.get(routing_key)
        if lst is None:
            self._direct[routing_key] = [dest]
        elif dest not in lst:
            lst.append(dest)
        refs = self._refs.get(dest, 0)
        self._refs[dest] = refs + 1
        if not refs:
            self._all = None
        if self.kind == "topic":
            self._trie.add(routing_key, dest, key[2])
            self._topic_cache = {}
        elif self.kind == "headers":
            self._headers.append((args, dest))
        elif self.special is not None:
            self.special.bindings_changed()
        return True

    def is_bound(self, dest: object, routing_key: str, args: dict[str, Any] | None = None) -> bool:
        if self._default:
            lst = self._direct.get(routing_key)
            return not args and lst is not None and lst[0] is dest
        return (dest, routing_key, args_key(args)) in self._bindings

    def unbind(self, dest: object, routing_key: str, args: dict[str, Any] | None = None) -> bool:
        if self._default:
            lst = self._direct.get(routing_key)
            if args or lst is None or lst[0] != dest:
                return False
            del self._direct[routing_key]
            return True
        key = (dest, routing_key, args_key(args))
        bound_args = self._bindings.pop(key, None)
        if bound_args is None:
            return False
        keys = self._by_dest[dest]
        keys.remove(key)
        if not keys:
            del self._by_dest[dest]
        if not any(k[1] == routing_key for k in keys):
            lst = self._direct[routing_key]
            lst.remove(dest)
            if not lst:
                del self._direct[routing_key]
        refs = self._refs[dest] - 1
        if refs:
            self._refs[dest] = refs
        else:
            del self._refs[dest]
            self._all = None
        if self.special is not None:
            self.special.bindings_changed()
        if self.kind == "topic":
            self._trie.remove(routing_key, dest, key[2])
            self._topic_cache = {}
        elif self.kind == "headers":
            for i, (a, d) in enumerate(self._headers):
                if d == dest and a is bound_args:
                    del self._headers[i]
                    break
        return True

    def unbind_all(self, dest: object) -> int:
        if self._default:
            name = getattr(dest, "name", None)
            if isinstance(name, str):  # a queue: bound under its own name, O(1)
                return int(self.unbind(dest, name))
            # Any other destination: a scan (never for queues, so deleting 100k stays linear).
            names = [rk for rk, lst in self._direct.items() if lst[0] == dest]
            for rk in names:
                del self._direct[rk]
            return len(names)
        keys = list(self._by_dest.get(dest, ()))
        for d, rk, _ in keys:
            self.unbind(d, rk, self._bindings[(d, rk, _)])
        return len(keys)

    def bindings(self) -> list[tuple[object, str, dict[str, Any]]]:
        if self._default:
            return [(lst[0], rk, {}) for rk, lst in self._direct.items()]
        return [(d, rk, a) for (d, rk, _), a in self._bindings.items()]

    def bindings_of(self, dest: object) -> list[tuple[str, dict[str, Any]]]:
        """The routing keys and arguments ``dest`` is bound with, in O(its bindings)."""
        if self._default:
            name = getattr(dest, "name", None)
            return [(name, {})] if isinstance(name, str) and self.is_bound(dest, name) else []
        return [(rk, self._bindings[(d, rk, a)]) for d, rk, a in self._by_dest.get(dest, ())]

    def has_bindings(self) -> bool:
        return bool(self._direct) if self._default else bool(self._bindings)

    # ---------------------------------------------------------------- routing
    def route(
        self, routing_key: str, headers_of: Callable[[], dict[str, Any] | None]
    ) -> list[object] | tuple[object, ...]:
        t = self.kind
        if t == "direct":
            return self._direct.get(routing_key, ())
        if t == "fanout":
            dests = self._all
            if dests is None:
                dests = self._all = tuple(self._refs)
            return dests
        if t == "topic":
            hit = self._topic_cache.get(routing_key)
            if hit is None:
                hit = self._trie.match(routing_key)
                if len(self._topic_cache) >= _TOPIC_CACHE_MAX:
                    self._topic_cache.clear()
                self._topic_cache[routing_key] = hit
            return hit
        if t == "x-consistent-hash" and self.special is not None:
            return self.special.route_hash(routing_key, headers_of)
        if not self._headers:
            return ()
        headers = headers_of()
        out: list[object] = []
        for args, dest in self._headers:
            if dest not in out and headers_match(args, headers):
                out.append(dest)
        return out
