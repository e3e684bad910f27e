"""Run one scenario against the reference (RabbitMQ) and Skred, and diff what the client saw.

Theory of operation: a ``Target`` names a broker's host and ports. ``run`` executes a scenario
against one target and returns its ``Run`` (transcript, close texts); an exception inside the
scenario (a read that timed out, a socket error) is recorded as the transcript's last entry, so
it is diffed like any other observation. ``compare_modes`` runs the targets at once on threads
(the brokers are independent; a scenario's own steps stay sequential) and returns a ``Result``
whose ``diff`` is a unified diff of the pretty-printed transcripts, or ``""`` when equal.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ._wire import Record, Run
from .allowlist import FIELDS, HTTP_KEYS

Scenario = Any  # Callable[[Run], None]; HTTP scenarios take the same Run
HTTP_KEY_PATTERNS = [re.compile(p) for p in HTTP_KEYS]
TALLY: Counter[str] = Counter()  # scenario outcomes of this session: equal / allowlisted / different
HIDDEN: Counter[str] = Counter()  # HTTP_KEYS pattern -> RabbitMQ keys it hid that Skred lacks


@dataclass(frozen=True)
class Target:
    name: str
    host: str
    port: int
    mgmt_port: int
    mqtt_port: int = 0  # the MQTT conformance harness (test_mqtt_conformance.py)
    mqtt_ws_url: str = ""  # and its MQTT over WebSocket scenarios


@dataclass
class Result:
    reference: Run
    skred: Run
    diff: str

    @property
    def reference_error(self) -> str | None:
        last = self.reference.transcript[-1] if self.reference.transcript else ()
        return str(last) if last and last[0] == "error" else None

    def report(self) -> str:
        texts = "\n".join(f"  rabbitmq: {t}" for t in self.reference.texts)
        texts += "\n" + "\n".join(f"  skred:    {t}" for t in self.skred.texts)
        return f"{self.diff}\nclose texts:\n{texts}"


def run(scn: Scenario, target: Target) -> Run:
    r = Run(target.name, target.host, target.port, target.mgmt_port)
    try:
        scn(r)
    except Exception as exc:  # noqa: BLE001 - the failure is the observation, diffed like others
        r.transcript.append(("error", type(exc).__name__, r.norm(str(exc))[:300]))
    finally:
        r.close()
    return r


def allowlisted(rec: Record) -> Record:
    """The record with the fields ``allowlist.FIELDS`` names for its method replaced."""
    if len(rec) == 4 and isinstance(rec[3], dict):
        hidden = {f for (m, f) in FIELDS if m == rec[2]}
        if hidden:
            return (*rec[:3], {k: ("<allowlisted>" if k in hidden else v) for k, v in rec[3].items()})
    return rec


def render(r: Run) -> list[str]:
    return [repr(allowlisted(rec)) for rec in r.transcript]


def reconcile(a: Run, b: Run) -> None:
    """HTTP key sets compare one way: RabbitMQ's keys less those ``allowlist.HTTP_KEYS`` names,
    and Skred's set cut to them, so only a key RabbitMQ has and Skred lacks shows in the diff.
    Where either side sent no key set (an empty list, no JSON body) only the status is compared."""
    for i, (ra, rb) in enumerate(zip(a.transcript, b.transcript, strict=False)):
        if not ra[0] == rb[0] == "http":
            continue
        if not (isinstance(ra[4], list) and isinstance(rb[4], list)):
            a.transcript[i], b.transcript[i] = (*ra[:4], None), (*rb[:4], None)
            continue
        wanted = []
        for k in ra[4]:
            hiding = next((p for p in HTTP_KEY_PATTERNS if p.fullmatch(k)), None)
            if hiding is None:
                wanted.append(k)
            elif k not in rb[4]:
                HIDDEN[hiding.pattern] += 1
        a.transcript[i] = (*ra[:4], wanted)
        b.transcript[i] = (*rb[:4], [k for k in rb[4] if k in set(wanted)])


def compare_modes(scn: Scenario, reference: Target, skreds: dict[str, Target],
                  groups: tuple[tuple[str, ...], ...]) -> dict[str, Result]:
    """Run ``scn`` once against the reference and against every Skred target, each group of
    targets on a thread of its own (the targets of a group one after the other: a cluster's
    leader and follower share its state), and diff each Skred run against the same reference run."""
    def in_turn(modes: tuple[str, ...]) -> list[Run]:
        return [run(scn, skreds[m]) for m in modes]

    with ThreadPoolExecutor(1 + len(groups)) as pool:
        ref = pool.submit(run, scn, reference)
        done = [pool.submit(in_turn, g) for g in groups]
        a = ref.result()
        runs = {m: r for g, f in zip(groups, done, strict=True) for m, r in zip(g, f.result(), strict=True)}
    out = {}
    for mode, b in runs.items():
        mine = copy.copy(a)  # reconcile rewrites the reference's transcript for each comparison
        mine.transcript = list(a.transcript)
        reconcile(mine, b)
        ra, rb = render(mine), render(b)
        diff = "" if ra == rb else "\n".join(
            difflib.unified_diff(ra, rb, reference.name, skreds[mode].name, lineterm="", n=3))
        out[mode] = Result(mine, b, diff)
    return out
