"""Failed-login throttling per source address and user: a delay that grows, never a lockout.

Theory of operation
-------------------
Every login attempt (AMQP ``connection.start-ok``, a management or LMQ HTTP
basic-auth request, an LMQ RPC ``authenticate``; the last three through
``check_login``) first asks ``admit(key, now)`` and gets back how long to wait before its
credentials may be checked; ``failed`` or ``succeeded`` reports the outcome.

The key is the source address AND the user name the attempt logs in as (``login_key``), so a
client hammering wrong passwords slows down only its own guesses: a good client on the same
address (a shared NAT, a sidecar, the same host) logging in as another user is served at once.
All names that are not users share one key per source, so a guesser cannot earn fresh free
attempts by inventing names. (Guesses at the very user a good client logs in as, from its own
address, do slow that client: its password cannot be told right without checking it, and
checking is what is rationed.)

Per key we count attempts that did not succeed (failures, plus
attempts still in flight: a client that opens many connections at once is
counted for each of them). The first ``free`` cost nothing; after that each
attempt reserves the next slot, ``interval`` after the previous one, with the
interval doubling from ``base`` up to ``max_interval``. So however many
connections a guesser opens, its passwords are checked at most once per
interval, and a burst of wrong passwords slows down to a bounded rate instead
of the 320 attempts/s a loop achieves without it.

It is never a lockout: the state is per source, so a stranger elsewhere cannot
slow a real user down; an attempt that would have to wait longer than
``max_wait`` (a source that keeps piling up parallel attempts) is refused
without checking its credentials, so at most ``max_wait`` after a guesser
stops its address is served normally again, and everything is forgotten
``quiet`` seconds after its last attempt. Successful logins undo their own
count, so a client that authenticates every request is never slowed.

Logging: a source's failures are logged one by one up to ``free``; crossing it
logs one line ("slowing down"), and the end of the burst logs one summary. No
password ever reaches this module. The table of sources is a
``broker.bursts.Bursts``: bounded (``max_sources``; quiet entries, then the
oldest, go first). The clock is passed in: no IO here, except in
``check_login``, which sleeps out the wait. The limits are options
(``[main] login_throttle_*``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.bursts import Bursts

if TYPE_CHECKING:
    from broker.auth.users import User, UserStore

log = logging.getLogger(__name__)


class TooManyFailures(Exception):
    """The source has piled up more waiting attempts than the throttle takes: refused unchecked."""


def login_key(source: str, name: str, known: bool) -> str:
    """The throttle's key of a login as ``name`` (``known``: a user of the store) from ``source``."""
    return f"{source} as {name!r}" if known else f"{source} as an unknown user"


async def check_login(users: UserStore, name: str, password: str, source: str, what: str, *,
                      bearer: bool = False) -> User | None:
    """The user ``name`` if ``password`` is right and the user may log in from ``source``, else
    None, after waiting out the turn of ``source`` and ``name``; raises TooManyFailures. ``what``
    names the front end in the log line of a refusal (logged while the key is not mid-burst).
    ``bearer``: ``password`` is an access token and ``name`` is ignored (``UserStore.login``)."""
    key = await admitted(users, source, name)
    keys = users.pending(password)  # a token signed by a key not fetched yet (broker.auth.oauth)
    if keys is not None:
        await keys
    user = users.login(name, password, source, bearer=bearer)[0]
    return reported(users, key, user, f"{what} login refused for user {name!r} from {source}")


async def admitted(users: UserStore, source: str, name: str) -> str:
    """Wait out the turn of ``source`` logging in as ``name``; its throttle key, for ``reported``.
    TooManyFailures when the source has piled up more attempts than the throttle takes."""
    key = users.throttle_key(source, name)
    wait = users.throttle.admit(key, time.monotonic())
    if wait is None:
        raise TooManyFailures(f"too many failed logins from {key}; retry later")
    if wait:
        await asyncio.sleep(wait)
    return key


def reported(users: UserStore, key: str, user: User | None, refusal: str) -> User | None:
    """Tell the throttle how the attempt ``admitted`` let through went; ``user`` back. A refusal is
    logged (``refusal``) while the key is not mid-burst."""
    if user is None:
        if users.throttle.failed(key, time.monotonic()):
            log.warning("%s", refusal)
        return None
    users.throttle.succeeded(key)
    return user


@dataclass
class _Source:
    attempts: int = 0  # failures + attempts admitted but not yet reported
    failures: int = 0  # failures in this burst (for the log lines)
    next_at: float = 0.0  # the earliest moment the next attempt may be checked
    first_failure: float = 0.0
    last_failure: float = 0.0
    last: float = 0.0  # the last attempt or failure: the source is forgotten ``quiet`` after it
    announced: bool = False


class LoginThrottle(Bursts[_Source]):
    def __init__(self, *, free: int = 5, base: float = 0.05, max_interval: float = 2.0,
                 max_wait: float = 8.0, quiet: float = 60.0, max_sources: int = 10_000) -> None:
        super().__init__(quiet=quiet, max_sources=max_sources)
        self.free = free
        self.base = base
        self.max_interval = max_interval
        self.max_wait = max_wait  # below the AMQP handshake timeout, so a waiting client is served
        # accounting, for tests and metrics: attempts delayed, total delay handed out, refusals
        self.delayed = 0
        self.delay_seconds = 0.0
        self.refused = 0

    def interval(self, attempts: int) -> float:
        over = attempts - self.free
        if over <= 0:
            return 0.0
        return min(self.max_interval, self.base * 2.0 ** min(over - 1, 60))

    def admit(self, source: str, now: float) -> float | None:
        """Seconds to wait before checking this attempt's credentials; None: refuse it unchecked."""
        entry = self.current(source, now)
        if entry is None:
            entry = self.start(source, _Source(), now)
        slot = max(now, entry.next_at)
        wait = slot - now
        if wait > self.max_wait:
            self.refused += 1
            return None
        entry.attempts += 1
        entry.last = now
        entry.next_at = slot + self.interval(entry.attempts)
        if wait > 0:
            self.delayed += 1
            self.delay_seconds += wait
        return wait

    def failed(self, source: str, now: float) -> bool:
        """Record a failed login; True when it should be logged on its own (not mid-burst)."""
        entry = self._entries.get(source)
        if entry is None:  # admitted before an eviction: count it afresh
            entry = self._entries[source] = _Source(attempts=1)
        if not entry.failures:
            entry.first_failure = now
        entry.failures += 1
        entry.last_failure = entry.last = now
        if entry.failures <= self.free:
            return True
        if not entry.announced:
            entry.announced = True
            log.warning("%d failed logins from %s in %.1fs: slowing down further attempts from it "
                        "(one check per %.2fs and growing, up to %.1fs)", entry.failures, source,
                        now - entry.first_failure, self.interval(entry.attempts + 1), self.max_interval)
        return False

    def succeeded(self, source: str) -> None:
        entry = self._entries.get(source)
        if entry is None:
            return
        entry.attempts = max(0, entry.attempts - 1)
        if not entry.attempts and not entry.failures:
            del self._entries[source]

    def ended(self, source: str, entry: _Source) -> None:
        if entry.announced:
            log.warning("burst of failed logins from %s ended: %d failed logins in %.1fs", source,
                        entry.failures, entry.last_failure - entry.first_failure)
