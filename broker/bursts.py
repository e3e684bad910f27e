"""A table of per-source bursts that end when the source goes quiet, bounded in size.

Theory of operation
-------------------
Guards against a noisy peer (the login throttle of ``broker.auth``, the
replication port's gate of ``broker.cluster``) keep one entry per source
address while that address is active, and forget it ``quiet`` seconds after
its last activity (the entry's ``last``), so an address that stops is served
as a stranger again and the table holds only the sources active lately.

An entry that has gone quiet is ended when its source next shows up
(``current``) or when the owner sweeps (``sweep``); either way ``ended`` runs
once for it, which is where an owner logs the summary of a burst. The table
holds at most ``max_sources`` entries: a new source first ends every quiet
entry, then, while the table is still full, the oldest one (insertion order),
so a flood of addresses costs bounded memory and still gets its summaries.

The clock is passed in; no IO here. Owners subclass the table and read or
write ``_entries`` directly where a step is theirs alone.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Stamped(Protocol):
    last: float  # the moment of the source's last activity


E = TypeVar("E", bound=Stamped)


class Bursts(Generic[E]):
    def __init__(self, *, quiet: float, max_sources: int) -> None:
        self.quiet = quiet
        self.max_sources = max_sources
        self._entries: dict[str, E] = {}

    def sources(self) -> int:
        return len(self._entries)

    def current(self, source: str, now: float) -> E | None:
        """``source``'s entry, or None when it has none; one that has gone quiet is ended first."""
        entry = self._entries.get(source)
        if entry is not None and now - entry.last > self.quiet:
            self._end(source, entry)
            return None
        return entry

    def start(self, source: str, entry: E, now: float) -> E:
        """Add ``entry`` for ``source`` (which has none), making room first when the table is full."""
        if len(self._entries) >= self.max_sources:
            self.sweep(now)
            while len(self._entries) >= self.max_sources:  # still full: the oldest entry goes
                oldest = next(iter(self._entries))
                self._end(oldest, self._entries[oldest])
        self._entries[source] = entry
        return entry

    def sweep(self, now: float) -> None:
        """End every entry that has gone quiet."""
        for source, entry in list(self._entries.items()):
            if now - entry.last > self.quiet:
                self._end(source, entry)

    def ended(self, source: str, entry: E) -> None:
        """Called once as ``source``'s entry is forgotten (quiet, or evicted): the owner's summary."""

    def _end(self, source: str, entry: E) -> None:
        del self._entries[source]
        self.ended(source, entry)
