"""Regular expressions that clients send, run in linear time with RE2.

Theory of operation
-------------------
Python's ``re`` backtracks: ``^(a+)+$`` against ``aaaaaaaaaaaaaaaaaaaaaaaa!`` takes seconds, and on
the event loop those seconds stall every connection of the node. Every pattern a client or an
operator sends over the network goes through here instead: LMQ's ``qre`` and its default-property
rules, user permissions (configure/write/read) and topic permissions, and policy and operator
policy patterns. RE2 (Google's ``re2``, the ``google-re2`` binding) matches in time linear in the
input and never backtracks, so a match against a queue name (at most 255 bytes) is bounded
whatever the pattern. Its syntax is Python's for everything these patterns use (classes,
anchors, alternation, repetition, non-greedy, named groups); what it refuses are backreferences
and lookaround, which need backtracking: such a pattern is refused as invalid (an HTTP 400, an
RPC error), never accepted and then run slowly.

Bounds: a pattern is at most ``MAX_PATTERN`` characters, and RE2 compiles it within
``MAX_MEMORY`` bytes (a pattern such as ``a{1000}{1000}`` that would need more is refused), so
neither compiling nor matching is unbounded. A pattern is compiled once where it is stored (a
permission, a policy, a property rule) and once per request for ``qre``.

``.*``, the pattern of nearly every permission (guest's included), matches any text at its
start, so ``search`` answers it without calling RE2: the binding's call (text encoding, offset
conversion) was half the broker's work for a connection's first publish, which the 1,000-queue
cold workload pays once per producer (issue 31).
"""

from __future__ import annotations

from typing import Any

import re2

MAX_PATTERN = 4096  # characters: far beyond any real queue-name pattern
MAX_MEMORY = 8 << 20  # bytes RE2 may use for one compiled pattern

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a bad pattern is the client's error, answered; not a line on stderr
_OPTIONS.max_mem = MAX_MEMORY


# Patterns that match the empty string at the start of any text, so ``search`` always succeeds.
_MATCHES_AT_START = frozenset((".*", "^.*"))


class PatternError(ValueError):
    """A pattern RE2 cannot run: bad syntax, a backreference or lookaround, or too big."""


class Pattern:
    """One compiled pattern: ``search`` (anywhere in the text) and ``fullmatch`` (the whole text)."""

    __slots__ = ("pattern", "_re", "_anything")

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN:
            raise PatternError(f"pattern longer than {MAX_PATTERN} characters")
        try:
            self._re: Any = re2.compile(pattern, _OPTIONS)
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode(errors="replace")
            raise PatternError(f"invalid pattern {pattern!r}: {reason}") from None
        self.pattern = pattern
        self._anything = pattern in _MATCHES_AT_START

    def search(self, text: str) -> bool:
        return self._anything or self._re.search(text) is not None

    def fullmatch(self, text: str) -> bool:
        return self._re.fullmatch(text) is not None

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r})"


def compile_pattern(pattern: str) -> Pattern:
    """``pattern`` compiled for RE2; raises PatternError (a ValueError) when it cannot run."""
    return Pattern(pattern)
