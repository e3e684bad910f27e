"""The option table of the ``skred`` Spark format: Kafka's names and meanings, nothing ignored.

Theory of operation: Spark hands a data source every option as a case-insensitive string. Each
name the source or sink understands is listed below with its meaning; any other name is refused
with a ValueError naming it and the known names, so a misspelt or unsupported option fails the
query instead of silently reading everything (Kafka's source behaves the same for its own
table). Connection options (``uri``, ``vhost``, ``data_dir``) and the earlier Skred names
(``queue``, ``startingOffset``, ``endingOffset``, ``maxRecordsPerTrigger``, ``numPartitions``)
stay accepted.

A read covers a list of ``TopicPartition`` (stream, partition, queue): a plain stream queue is
partition 0 of itself; a super stream's partition ``i`` is the stream queue ``<name>-<i>``, so
super streams slot in by widening ``topic_partitions`` without touching the readers. Offsets in
JSON follow Kafka's shape, ``{"stream": {"0": 42}}`` with -2 = earliest and -1 = latest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from broker.patterns import compile_pattern

EARLIEST, LATEST = -2, -1

SOURCE_OPTIONS = {
    # connection
    "uri": "a running broker: http://user:pass@host:mgmt_port (raw records) or an AMQP URI",
    "vhost": "virtual host (default /)",
    "data_dir": "broker data directory (reads segment files)",
    "path": "same as data_dir (load(path))",
    "timeout": "seconds to wait for the broker over the network (30)",
    # what to read
    "subscribe": "comma-separated streams",
    "subscribepattern": "RE2 pattern over stream names (data_dir mode)",
    "assign": 'JSON {"stream": [partitions]}',
    "queue": "one stream (Skred's earlier name for subscribe)",
    # where to start and stop
    "startingoffsets": 'earliest, latest or JSON {"stream": {"0": offset}} (-2 earliest, -1 latest)',
    "startingoffset": "same as startingOffsets",
    "endingoffsets": "latest or JSON per partition (batch reads)",
    "endingoffset": "same as endingOffsets",
    "startingtimestamp": "epoch ms: start at the first message appended at or after it",
    "startingoffsetsbytimestamp": 'JSON {"stream": {"0": epoch_ms}}',
    "startingoffsetsbytimestampstrategy": "error (default) or latest, when no message is that new",
    "endingtimestamp": "epoch ms: stop before the first message appended at or after it",
    "endingoffsetsbytimestamp": 'JSON {"stream": {"0": epoch_ms}}',
    "failondataloss": "true (default): fail when requested offsets were removed by retention",
    # splitting
    "minpartitions": "at least this many Spark partitions (offset ranges are split)",
    "numpartitions": "same as minPartitions",
    "maxrecordsperpartition": "at most this many offsets per Spark partition",
    # streaming rate
    "maxoffsetspertrigger": "at most this many offsets per micro-batch (all partitions)",
    "maxrecordspertrigger": "same as maxOffsetsPerTrigger",
    "minoffsetspertrigger": "wait for this many new offsets before a micro-batch",
    "maxtriggerdelay": "... but no longer than this (15m; 500ms, 10s, 5m, 1h)",
    # rows
    "includeheaders": "add the headers column (false)",
    "pushdown": "filter pushdown: auto (default), true or false",
    "batchrows": "rows per Arrow batch (65536)",
    "batchbytes": "record bytes per Arrow batch (64 MiB)",
}

SINK_OPTIONS = {
    "uri": "AMQP URI of the broker to publish to (required)",
    "vhost": "virtual host (default: the URI's)",
    "topic": "target stream or exchange (else each row's topic column)",
    "exactlyonce": "true: deterministic ids; a target stream (or deduplicating exchange) drops repeats",
    "streamport": "the broker's stream protocol port, for exactlyOnce rows to a stream (5552)",
    "queryid": "batch writes with exactlyOnce: a stable id of this write (default: one per job)",
    "confirmtimeout": "seconds to wait for publisher confirms (30)",
    "confirmwindow": "rows a task keeps in flight awaiting confirms (1000; over the stream protocol 20000)",
    "path": "ignored by Spark writers (save(path)); refused when set",
    "checkpointlocation": "Structured Streaming's checkpoint (used by Spark)",
}


def checked(raw: dict[str, str], table: dict[str, str], what: str) -> dict[str, str]:
    """Options lower-cased; ValueError for a name not in ``table``."""
    opts = {k.lower(): v for k, v in raw.items()}
    unknown = sorted(k for k in opts if k not in table)
    if unknown:
        raise ValueError(f"skred {what}: unknown option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(table))}")
    return opts


def flag(opts: dict[str, str], name: str, default: bool) -> bool:
    value = opts.get(name)
    if value is None:
        return default
    v = value.strip().lower()
    if v not in ("true", "false"):
        raise ValueError(f"skred: option '{name}' must be true or false, not {value!r}")
    return v == "true"


def number(opts: dict[str, str], name: str, *, minimum: int = 0) -> int | None:
    value = opts.get(name)
    if value is None:
        return None
    try:
        n = int(value.strip())
    except ValueError:
        raise ValueError(f"skred: option '{name}' must be an integer, not {value!r}") from None
    if n < minimum:
        raise ValueError(f"skred: option '{name}' must be >= {minimum}")
    return n


_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def duration_ms(value: str) -> int:
    """``500ms``, ``10s``, ``5m``, ``1h``, ``2d`` or bare milliseconds."""
    v = value.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if v.endswith(unit) and v[: -len(unit)].strip().isdigit():
            return int(v[: -len(unit)]) * _UNITS[unit]
    if v.isdigit():
        return int(v)
    raise ValueError(f"skred: bad duration {value!r} (500ms, 10s, 5m, 1h)")


@dataclass(frozen=True, order=True)
class TopicPartition:
    """One log a Spark partition reads: ``topic`` (stream or super stream) and its partition."""

    topic: str
    partition: int
    queue: str  # the stream queue holding it

    @property
    def key(self) -> str:
        return f"{self.topic}/{self.partition}"


def _plain(topic: str) -> TopicPartition:
    return TopicPartition(topic, 0, topic)


def _json(opts: dict[str, str], name: str) -> Any:
    try:
        return json.loads(opts[name])
    except json.JSONDecodeError as exc:
        raise ValueError(f"skred: option '{name}' is not JSON: {exc}") from None


def topic_partitions(opts: dict[str, str], list_streams: Any) -> list[TopicPartition]:
    """The partitions named by exactly one of subscribe, subscribePattern, assign (or queue)."""
    given = [k for k in ("subscribe", "subscribepattern", "assign", "queue") if opts.get(k)]
    if len(given) != 1:
        raise ValueError("skred: set exactly one of the options subscribe, subscribePattern, "
                         f"assign (or queue); got {', '.join(given) or 'none'}")
    how = given[0]
    if how in ("subscribe", "queue"):
        names = [n.strip() for n in opts[how].split(",") if n.strip()]
        return sorted({_plain(n) for n in names})
    if how == "subscribepattern":
        pattern = compile_pattern(opts[how])
        return sorted(_plain(n) for n in list_streams() if pattern.fullmatch(n))
    spec = _json(opts, "assign")
    if not isinstance(spec, dict) or not all(isinstance(v, list) for v in spec.values()):
        raise ValueError('skred: option \'assign\' must be JSON like {"stream": [0]}')
    out: set[TopicPartition] = set()
    for topic, parts in spec.items():
        for p in parts:
            if p != 0 or isinstance(p, bool):
                raise ValueError(f"skred: stream '{topic}' has only partition 0, not {p!r}")
            out.add(_plain(str(topic)))
    return sorted(out)


def per_partition(opts: dict[str, str], name: str, parts: list[TopicPartition],
                  named: dict[str, int]) -> dict[TopicPartition, int] | None:
    """An offsets/timestamps option as a value per partition (None: option not set).

    ``named`` maps words (earliest, latest) to their sentinel; JSON gives a value per
    partition and must name only partitions being read.
    """
    value = opts.get(name)
    if value is None:
        return None
    word = value.strip().lower()
    if word in named:
        return {tp: named[word] for tp in parts}
    if word.lstrip("-").isdigit():
        return {tp: int(word) for tp in parts}
    spec = _json(opts, name)
    if not isinstance(spec, dict):
        raise ValueError(f"skred: option '{name}' must be a word or JSON per partition")
    by_key = {(tp.topic, str(tp.partition)): tp for tp in parts}
    out: dict[TopicPartition, int] = {}
    for topic, per in spec.items():
        if not isinstance(per, dict):
            raise ValueError(f"skred: option '{name}': {topic!r} must map partitions to values")
        for part, v in per.items():
            tp = by_key.get((str(topic), str(part)))
            if tp is None:
                raise ValueError(f"skred: option '{name}' names {topic}/{part}, which is not read")
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"skred: option '{name}': {topic}/{part} must be an integer")
            out[tp] = v
    return out
