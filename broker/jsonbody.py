"""JSON documents that clients send (management API bodies, definitions, LMQ properties),
parsed with a bound on nesting.

Python's parser recurses once per level: a body of ten thousand ``[`` raises RecursionError
(not the ValueError a bad body raises), which a handler does not expect, and a document nested
a few hundred levels deep parses but can make any later recursive walk (rendering, storing,
encoding as an AMQP table) fail the same way. So every client document is parsed here: too
deep for the parser, or deeper than ``MAX_DEPTH`` once parsed (counted without recursion), is a
``JSONBodyError``, a ValueError the front ends answer 400. No real document comes close: a
definitions export nests about six levels.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64


class JSONBodyError(ValueError):
    """A body that is not JSON, or nests deeper than ``MAX_DEPTH``."""


def loads(raw: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``raw``; JSONBodyError when it is not JSON or is nested too deeply."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise JSONBodyError(f"body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JSONBodyError(f"body is not valid JSON: {exc}") from None
    level: list[Any] = [doc]
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise JSONBodyError(f"body nests deeper than {max_depth} levels")
        nxt: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                nxt.extend(v for v in item.values() if isinstance(v, dict | list))
            elif isinstance(item, list):
                nxt.extend(v for v in item if isinstance(v, dict | list))
        level = nxt
    return doc
