"""Admission to the replication port: unfinished handshakes bounded per source, refusals
logged once per burst.

Theory of operation
-------------------
Anyone who can reach the replication port can open connections to it; only
a member knows the cluster secret. Before a connection has proved it knows
the secret (TLS handshake plus hello, ``HANDSHAKE_TIMEOUT`` in all) it is
*unfinished*. ``enter(source)`` admits one more unfinished connection from
that address, or refuses it when the address already has its limit of them;
``leave(source)`` is called once the connection authenticated or was refused.
So a stranger who opens connections and says nothing holds at most
``per_source`` descriptors, each for at most the handshake timeout, and its
TLS handshakes cost no CPU beyond that (the check runs before TLS starts).

Members get a much larger limit. After a failover every client of a
follower reconnects at once, and each becomes a tunnel from that follower's
address: hundreds of handshakes in flight from one source, each done in a
round trip or two. A follower's tunnels only start once its own link was
welcomed (the tunnel targets come from the ``Welcome``), so its address is
already known by then: addresses that presented the secret (``known``: the
link of a follower or a tunnel) have ``per_member``. That limit exists only
so a member's address cannot exhaust the leader's descriptors either.

Logging: a refusal (wrong secret, wrong version, garbage, silence, over the
limit) is logged on its own the first time an address is refused; later
refusals from it are counted, and once it has been quiet for ``quiet``
seconds one line sums the burst up (``sweep``, run by the leader's
watchdog, or the address's next refusal). The table of addresses in a
burst is a ``broker.bursts.Bursts``, bounded (``max_sources``; the oldest
burst is summed up first). No IO here; the clock is passed in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.bursts import Bursts

log = logging.getLogger("broker.cluster.leader")

PER_SOURCE = 16  # unfinished connections from an address that never presented the secret
PER_MEMBER = 1024  # ... from a member's address (its proxy's tunnels after a failover)
QUIET = 30.0  # seconds without a refusal that end an address's burst


@dataclass
class _Burst:
    first: float
    last: float
    count: int = 1  # refusals in this burst, the logged first one included
    why: str = ""  # the last reason


class HandshakeGate(Bursts[_Burst]):
    def __init__(self, *, per_source: int = PER_SOURCE, per_member: int = PER_MEMBER,
                 quiet: float = QUIET, max_sources: int = 10_000) -> None:
        super().__init__(quiet=quiet, max_sources=max_sources)
        self.per_source = per_source
        self.per_member = per_member
        self.known: set[str] = set()  # addresses that presented the secret
        self.pending: dict[str, int] = {}
        self.turned_away = 0  # connections closed for being over the limit

    def enter(self, source: str) -> bool:
        n = self.pending.get(source, 0)
        if n >= (self.per_member if source in self.known else self.per_source):
            self.turned_away += 1
            return False
        self.pending[source] = n + 1
        return True

    def leave(self, source: str) -> None:
        n = self.pending.get(source, 0) - 1
        if n > 0:
            self.pending[source] = n
        else:
            self.pending.pop(source, None)

    def authenticated(self, source: str) -> None:
        self.known.add(source)

    def refused(self, source: str, why: str, now: float) -> bool:
        """Count a refusal; True when it is the first of a burst and should be logged."""
        burst = self.current(source, now)
        if burst is None:
            self.start(source, _Burst(now, now, why=why), now)
            return True
        burst.count += 1
        burst.last = now
        burst.why = why
        return False

    def ended(self, source: str, burst: _Burst) -> None:
        if burst.count > 1:
            log.warning("refused %d connections to the replication port from %s in %.1fs (last: %s)",
                        burst.count, source, burst.last - burst.first, burst.why)
