"""LMQ queue properties: ``accum``, ``retry``, ``timeout``, with LMQ's precedence.

A queue's effective properties are, key by key: the properties set on that queue, else those of
the first default rule (``[[regex, props], ...]``) whose regex matches the queue name, else the
system defaults (accum 0 s, retry 2, timeout 30 s). The rules' regexes are client input: they
run on RE2 (``broker.patterns``), compiled once when the rules are set. A message takes the
effective properties at the moment it is put (they are stored in its headers), so a change
applies to messages put after it. Both lists live in ``lmq.json`` in the data directory; the
composition root hands in the document and a ``save`` that writes it whole and replicates it
like every JSON store (this layer does not touch files).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from broker.patterns import Pattern, PatternError, compile_pattern

log = logging.getLogger(__name__)

SYSTEM_DEFAULTS: dict[str, Any] = {"accum": 0.0, "retry": 2, "timeout": 30.0}
FILE_NAME = "lmq.json"


class PropsError(ValueError):
    """Properties a client sent that are not valid (answered 400 / an RPC error)."""


def validate(props: Any, aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """A clean copy of ``props`` (a JSON object of known keys with sane values) or PropsError."""
    if not isinstance(props, dict):
        raise PropsError("properties must be an object")
    out: dict[str, Any] = {}
    for key, value in props.items():
        key = (aliases or {}).get(key, key)
        if key not in SYSTEM_DEFAULTS:
            raise PropsError(f"unknown property '{key}' (known: accum, retry, timeout)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PropsError(f"property '{key}' must be a number")
        if key == "retry":
            if value != int(value) or value < 0:
                raise PropsError("property 'retry' must be a whole number >= 0")
            out[key] = int(value)
        elif key == "timeout":
            if not 0 < value <= 86400:
                raise PropsError("property 'timeout' must be > 0 and at most 86400 seconds")
            out[key] = float(value)
        else:
            if not 0 <= value <= 86400:
                raise PropsError("property 'accum' must be >= 0 and at most 86400 seconds")
            out[key] = float(value)
    return out


def validate_defaults(rules: Any, aliases: dict[str, str] | None = None) -> list[list[Any]]:
    if not isinstance(rules, list):
        raise PropsError("default properties must be a list of [regex, properties] pairs")
    out: list[list[Any]] = []
    for rule in rules:
        if not isinstance(rule, list | tuple) or len(rule) != 2 or not isinstance(rule[0], str):
            raise PropsError("each default rule must be a [regex, properties] pair")
        try:
            compile_pattern(rule[0])
        except PatternError as exc:
            raise PropsError(str(exc)) from None
        out.append([rule[0], validate(rule[1], aliases)])
    return out


class PropsStore:
    def __init__(self, doc: dict[str, Any], save: Callable[[dict[str, Any]], None]) -> None:
        self.save = save
        self.defaults: list[list[Any]] = []
        self._compiled: list[Pattern] = []
        rules = []
        for rule in doc.get("defaults", []):  # a rule that no longer compiles (RE2) is dropped, logged
            try:
                rules.extend(validate_defaults([rule]))
            except PropsError as exc:
                log.error("LMQ default property rule %r dropped from %s: %s", rule, FILE_NAME, exc)
        self._set_defaults(rules)
        self.queues: dict[str, dict[str, Any]] = {
            name: validate(p) for name, p in dict(doc.get("queues", {})).items()}

    def _save(self) -> None:
        self.save({"defaults": self.defaults, "queues": self.queues})

    def resolve(self, name: str) -> dict[str, Any]:
        out = dict(SYSTEM_DEFAULTS)
        for pattern, (_regex, props) in zip(self._compiled, self.defaults, strict=True):
            if pattern.search(name):
                out.update(props)
                break
        out.update(self.queues.get(name, {}))
        return out

    def _set_defaults(self, rules: list[list[Any]]) -> None:
        self._compiled = [compile_pattern(regex) for regex, _props in rules]
        self.defaults = rules

    def set_defaults(self, rules: list[list[Any]]) -> None:
        self._set_defaults(rules)
        self._save()

    def update_queue(self, name: str, props: dict[str, Any], replace: bool = False) -> None:
        self.queues[name] = dict(props) if replace else {**self.queues.get(name, {}), **props}
        self._save()

    def reset_queue(self, name: str) -> None:
        if self.queues.pop(name, None) is not None:
            self._save()
