"""The log exchange (RabbitMQ's ``amq.rabbitmq.log``): the broker's log lines as messages.

Theory of operation
-------------------
Opt-in (``[main] log_exchange``). ``install`` declares the topic exchange ``amq.rabbitmq.log``
(durable, internal) in the default vhost and adds a ``logging.Handler`` to the root logger. A
log line becomes a message published there with the lower-case level as its routing key
(``debug``, ``info``, ``warning``, ``error``, ``critical``; RabbitMQ's keys), the formatted line
as its body and ``node`` and ``logger`` headers, through the model's one publish operation.

Never blocking the logger: ``emit`` only appends the line to a bounded queue (``LIMIT`` lines)
and asks the event loop, thread-safely, for one drain; a full queue drops the line and counts
it (``dropped``), and the next message that gets through carries the count so far in a
``dropped`` header. A line logged by any thread (the group commit's worker, say) waits for the
loop like the rest.

Never recursive: lines logged while the drain publishes (a full disk refusing the copy, a
warning from a queue it reached) are not queued again (``suppressed`` counts them), and so are
the handler's own failures, which it reports on stderr through ``logging``'s ``handleError``
path at most; a publish error drops the line. Nothing here runs per AMQP message.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from broker import properties
from broker.model.publish import PublishRequest
from broker.model.vhost import VHost

LOG_EXCHANGE: Final = "amq.rabbitmq.log"
LIMIT: Final = 10_000  # lines waiting for the loop at most (a burst of warnings; then drops)
MAX_LINE: Final = 64 * 1024  # a longer line (a huge traceback) is cut: a bound on each message


class LogExchangeHandler(logging.Handler):
    """Queues log lines for the loop to publish (see the module doc)."""

    def __init__(self, vhost: VHost, node_name: str,
                 call_soon_threadsafe: Callable[[Callable[[], None]], object], limit: int = LIMIT) -> None:
        super().__init__()
        self.limit = limit
        self.vhost = vhost
        self.node_name = node_name
        self._call_soon = call_soon_threadsafe
        self._lines: deque[tuple[str, str, bytes, int]] = deque()
        self._guard = threading.Lock()
        self._scheduled = False
        self._draining = 0  # the thread draining (its ident), else 0
        self.dropped = 0  # lines a full queue turned away
        self.suppressed = 0  # lines logged while publishing one (never queued: no loop)
        self.published = 0
        self._reported_drops = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self._draining == threading.get_ident():
            self.suppressed += 1  # logged by the publish of a log line: no loop
            return
        try:
            line = self.format(record).encode("utf-8", errors="replace")[:MAX_LINE]
        except Exception:
            self.handleError(record)
            return
        ts = int(record.created * 1000)
        with self._guard:
            if len(self._lines) >= self.limit:
                self.dropped += 1
                return
            self._lines.append((record.levelname.lower(), record.name, line, ts))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._call_soon(self._drain)
        except RuntimeError:  # the loop is closed (shutdown): nothing will publish it
            with self._guard:
                self._scheduled = False

    def _drain(self) -> None:
        with self._guard:
            lines = list(self._lines)
            self._lines.clear()
            self._scheduled = False
        self._draining = threading.get_ident()
        try:
            for level, logger, line, ts in lines:
                headers: dict[str, Any] = {"node": self.node_name, "logger": logger}
                if self.dropped != self._reported_drops:
                    headers["dropped"] = self._reported_drops = self.dropped
                props = properties.encode(commands.Basic.Properties(headers=headers))
                try:
                    self.vhost.publish(PublishRequest(LOG_EXCHANGE, level, props, line, ts, persistent=False))
                except Exception:  # noqa: BLE001 - a full disk, a deleted vhost: the line is lost
                    self.dropped += 1
                    continue
                self.published += 1
        finally:
            self._draining = 0


def install(vhosts: dict[str, VHost], node_name: str,
            call_soon_threadsafe: Callable[[Callable[[], None]], object],
            level: int = logging.NOTSET, limit: int = LIMIT) -> LogExchangeHandler | None:
    """Declare ``amq.rabbitmq.log`` in the default vhost and start copying log lines to it;
    None when there is no default vhost."""
    vh = vhosts.get("/")
    if vh is None:
        return None
    with vh.unlogged():  # declared at every start while enabled (and amq.* is the broker's own)
        vh.declare_exchange(LOG_EXCHANGE, "topic", durable=True, internal=True)
    handler = LogExchangeHandler(vh, node_name, call_soon_threadsafe, limit)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def uninstall(handler: LogExchangeHandler) -> None:
    logging.getLogger().removeHandler(handler)
