"""LavinMQ's HTTP shovel destination: each message POSTed to ``dest-uri``, over aiohttp's client.

The body is the message body; ``Content-Type`` its content type; the routing key, exchange and
the other properties go as ``X-Routing-Key``-style headers and each AMQP header as
``X-<name>`` (only names and values that are valid in an HTTP header; a value with a line
break is left out). The URI's user and password, if any, are sent as basic auth.

What an answer means (LavinMQ drops a message on a 404; this destination never drops one):
- 2xx: delivered, the source message is acked.
- 408, 425, 429, 5xx, a timeout or a broken connection: ``RETRY``, the same message is posted
  again after a back-off, and the source holds it meanwhile (so the shovel slows, nothing moves
  on past it).
- any other status (400, 404, 413...): ``REFUSED``, the destination will not take it: the link
  dead-letters it at a source queue with a dead-letter exchange, and otherwise gives it back to
  the source after the back-off (docs/shovels.md).
Posts go one at a time, in order (``concurrency`` 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from broker.shovel.definition import ShovelDef
from broker.shovel.ends import EndLost, Message, Verdict, new_lost

REQUEST_TIMEOUT = 30.0  # seconds for one POST, connect to last byte of the answer
RETRYABLE = frozenset({408, 425, 429})
_PROPS = (("content_encoding", "X-Content-Encoding"), ("correlation_id", "X-Correlation-Id"),
          ("reply_to", "X-Reply-To"), ("expiration", "X-Expiration"), ("message_id", "X-Message-Id"),
          ("type", "X-Type"), ("user_id", "X-User-Id"), ("app_id", "X-App-Id"),
          ("priority", "X-Priority"), ("delivery_mode", "X-Delivery-Mode"), ("timestamp", "X-Timestamp"))


def _header_value(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = str(value)
    if any(c in text for c in "\r\n\0"):
        return None
    return text


def http_headers(msg: Message) -> dict[str, str]:
    p = msg.props
    out = {"Content-Type": p.content_type or "application/octet-stream",
           "X-Exchange": msg.exchange, "X-Routing-Key": msg.routing_key}
    for attr, name in _PROPS:
        value = getattr(p, attr, None)
        if value is not None:
            text = _header_value(value)
            if text is not None:
                out[name] = text
    for key, value in (p.headers or {}).items():
        text = _header_value(value)
        if text is not None and key and all(c.isalnum() or c in "-_." for c in key):
            out[f"X-{key}"] = text
    return out


class HttpDestination:
    concurrency = 1
    immediate = False

    def send_now(self, msg: Message, later: Callable[[Verdict], None]) -> Verdict | None:
        raise NotImplementedError  # not immediate: the link awaits send()

    def __init__(self, d: ShovelDef) -> None:
        self.uri = d.dest_uris[0]
        self.lost = new_lost()
        self.problem = ""  # why the last post did not settle, for the status
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT))

    async def send(self, msg: Message) -> Verdict:
        if self.session is None:
            raise EndLost("destination closed")
        try:
            async with self.session.post(self.uri.text, data=msg.body, headers=http_headers(msg)) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.problem = f"POST {self.uri.redacted()}: {type(exc).__name__}: {exc}"
            return Verdict.RETRY
        if 200 <= status < 300:
            return Verdict.OK
        self.problem = f"POST {self.uri.redacted()}: HTTP {status}"
        if status in RETRYABLE or status >= 500:
            return Verdict.RETRY
        return Verdict.REFUSED

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()
