#!/usr/bin/env python3
"""Shovel throughput: Skred's shovel against RabbitMQ 3.10's shovel plugin doing the same move.

Boots its own brokers on loopback (free ports, private data dirs, stopped by PID): Skred ``A``
(a source), Skred ``B`` (the destination of every move) and a RabbitMQ node ``R`` with
``rabbitmq_shovel`` (tests/integration/conformance/_rabbit.py). For each move and ack mode, it
preloads the source queue with ``--messages`` persistent 1 KiB messages (confirmed, not timed),
defines the shovel, and times until B's destination queue holds them all (polled every 20 ms
with a passive queue.declare, so a run is never shorter than that):

- ``skred A->B``: Skred's shovel on B pulls from A over AMQP (``src-uri`` amqp://A).
- ``plugin A->B``: RabbitMQ's shovel plugin (on R) moves the same from A to B.
- ``skred A->B push``: Skred's shovel on A pushes to B (its remote AMQP destination).
- ``skred R->B`` / ``plugin R->B``: RabbitMQ's queue to Skred, by Skred's shovel on B and by the
  plugin on R.
- ``skred B->B local``: Skred's in-process shovel (host-less ``amqp://`` both ends), no socket.
- ``bare R->``: RabbitMQ's ceiling, the most R delivers to one consumer that does nothing with a
  message: the link layer's own consuming connection and coalesced acks (``broker/links/wire.py``,
  ``acks.py``), run in this process with the same prefetch, acking each delivery at once (no-ack:
  consuming without acks). Its ``B`` column is this process's CPU (the bare consumer's). A shovel
  out of RabbitMQ cannot move faster than this (the row's time has no shovel start and no 20 ms
  polling in it, so it favours the ceiling a little); ``skred R->B`` is printed as a share of it.

Each run is bounded by ``--timeout`` seconds. Besides the rate, each row has the CPU time per
message of each broker process (A, B, and RabbitMQ's Erlang VM R) during the move, read from
/proc: on a loaded machine the rates say little, the CPU cost per message much more. The load
average is printed with the results: compare rows of one run, not runs on different days.

    python benchmarks/shovel.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pika  # noqa: E402
from pamqp import commands  # noqa: E402

from broker.links.acks import Acker  # noqa: E402
from broker.links.wire import Wire, open_first  # noqa: E402
from tests.integration._shovel import publish, put_shovel  # noqa: E402  (needs the repo root)
from tests.integration._support import SkredProcess, wait_until  # noqa: E402
from tests.integration.conformance._rabbit import RabbitProcess, booted_beside, missing  # noqa: E402
from tests.integration.test_mgmt_api import Api  # noqa: E402

MODES = ("on-confirm", "no-ack")
PREFETCH = 1000  # both shovels: RabbitMQ's default src-prefetch-count


def uri(port: int) -> str:
    return f"amqp://guest:guest@127.0.0.1:{port}/%2F"


def _stat(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3, state


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its descendants (a Skred node's workers are
    child processes), from /proc/PID/stat; a child that exited meanwhile is not counted."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(entry.name)[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # exited while we looked
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = _stat(p)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        todo += children.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


@contextmanager
def three_brokers(prefix: str, name: str, plugins: tuple[str, ...]
                  ) -> Iterator[tuple[RabbitProcess, SkredProcess, SkredProcess]]:
    """RabbitMQ ``R`` (with ``plugins``) and Skred ``A`` and ``B``, booted side by side in a
    private directory, ready; all stopped by PID at the end."""
    why = missing()
    if why:
        sys.exit(f"{prefix}: {why}")
    root = Path(tempfile.mkdtemp(prefix=f"skred-{prefix}-bench-"))
    rabbit = RabbitProcess(root / "rabbitmq", name=name, plugins=plugins)
    with booted_beside(rabbit, root, 2, sys.exit) as (a, b):
        yield rabbit, a, b


def move_args(doc: str | None, messages: int, timeout: float) -> argparse.ArgumentParser:
    """The options of every move benchmark (``--messages``, ``--timeout``, ``--moves``,
    ``--json``); the caller adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=messages)
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per move at most")
    ap.add_argument("--moves", default="",
                    help="only the moves whose label contains one of these, comma-separated")
    ap.add_argument("--json", action="store_true")
    return ap


def chosen(moves: str, label: str) -> bool:
    """Whether ``--moves`` (comma-separated parts of labels; empty: all) picks ``label``."""
    wanted = [w for w in moves.split(",") if w]
    return not wanted or any(w in label for w in wanted)


def process_ids(rabbit: RabbitProcess, a: SkredProcess, b: SkredProcess) -> dict[str, int]:
    """The PIDs whose CPU time a move is charged: Skred A and B, RabbitMQ's Erlang VM R."""
    assert a.pid is not None and b.pid is not None
    return {"A": a.pid, "B": b.pid, "R": rabbit.beam_pid()}


def report(results: list[dict[str, Any]], meta: dict[str, Any], as_json: bool, title: str,
           columns: list[tuple[str, str, int]]) -> None:
    """The results on stdout: JSON (``meta`` and the load average with them), or a table under
    ``title`` with ``columns`` (key, heading, width) before the rate and the CPU per message."""
    load = os.getloadavg()
    if as_json:
        print(json.dumps({**meta, "load_average": load, "results": results}, indent=2))
        return
    print(f"{title}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(" ".join(f"{head:{w}}" for _, head, w in columns)
          + f" {'msg/s':>10} {'CPU us/msg A':>12} {'B':>6} {'R':>6} {'total':>6}")
    for r in results:
        c = r["cpu_us_per_msg"]
        print(" ".join(f"{r[key]:{w}}" for key, _, w in columns)
              + f" {r['msg_per_s']:10} {c['A']:12} {c['B']:6} {c['R']:6} {r['cpu_us_total']:6}")


def record(results: list[dict[str, Any]], row: dict[str, Any], line: str, rate: float,
           cpu: dict[str, float]) -> None:
    """Keep one move's result and say it at once on stderr (``line``: its label columns)."""
    results.append({**row, "msg_per_s": round(rate), "cpu_us_per_msg": {k: round(v) for k, v in cpu.items()},
                    "cpu_us_total": round(sum(cpu.values()))})
    print(f"{line} {rate:10.0f} msg/s  CPU us/msg " + " ".join(f"{k}={v:.0f}" for k, v in cpu.items()),
          file=sys.stderr, flush=True)


def one_move(label: str, runner: Api, dest: Api, dest_url: str, src_url: str, value: dict[str, Any], n: int,
             timeout: float, pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """Messages per second of one move, and the CPU microseconds per message each broker process
    spent meanwhile; the source is preloaded first (not timed)."""
    src_q, dst_q = value["src-queue"], value["dest-queue"]
    publish(src_url, src_q, "b", n, size=1024, declare={})
    name = f"bench-{label.replace(' ', '-').replace('>', '')}-{value['ack-mode']}"
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
    t0 = time.perf_counter()
    status, body = put_shovel(runner, "/", name, value)
    assert status in (201, 204), body
    with pika.BlockingConnection(pika.URLParameters(dest_url)) as conn:  # a passive declare costs the
        ch = conn.channel()  # broker far less than an API call: the polling does not skew its CPU time
        ch.queue_declare(dst_q, durable=True)  # there before either shovel looks for it
        wait_until(lambda: ch.queue_declare(dst_q, passive=True).method.message_count >= n, timeout,
                   f"{label}: {n} moved")
    elapsed = time.perf_counter() - t0
    cpu = {k: (cpu_seconds(pid) - cpu0[k]) * 1e6 / n for k, pid in pids.items()}
    runner.call("DELETE", f"/api/parameters/shovel/%2F/{urllib.parse.quote(name, safe='')}")
    dest.call("DELETE", f"/api/queues/%2F/{urllib.parse.quote(dst_q, safe='')}")
    return n / elapsed, cpu


async def _bare_consume(url: str, queue: str, n: int, prefetch: int, no_ack: bool) -> None:
    wire, lost = await open_first([url], {"connection_name": "bare consumer"}, Wire)
    try:
        await wire.call(1, commands.Channel.Open(), commands.Channel.OpenOk)
        await wire.call(1, commands.Basic.Qos(prefetch_count=prefetch), commands.Basic.QosOk)
        acker = None if no_ack else Acker(wire, prefetch)
        done = asyncio.get_running_loop().create_future()
        got = 0

        def on_message(msg: Any) -> None:
            nonlocal got
            got += 1
            if acker is not None:
                acker.settle(msg.tag, True)
            if got >= n and not done.done():
                done.set_result(None)
        wire.channel, wire.on_message, wire.consuming = 1, on_message, True
        await wire.call(1, commands.Basic.Consume(queue=queue, consumer_tag="bare", no_ack=no_ack),
                        commands.Basic.ConsumeOk)
        await asyncio.wait([done, lost], return_when=asyncio.FIRST_COMPLETED)
        assert done.done(), lost.result()
        if acker is not None:
            acker.close()
    finally:
        await wire.shutdown("done")


def bare_move(src_url: str, queue: str, n: int, mode: str, timeout: float,
              pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    """RabbitMQ's delivery ceiling: messages per second to a consumer that only acks, and the CPU
    microseconds per message (``B``: this process, the consumer)."""
    publish(src_url, queue, "b", n, size=1024, declare={})
    cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items() if k != "B"}
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    asyncio.run(asyncio.wait_for(_bare_consume(src_url, queue, n, PREFETCH, mode == "no-ack"), timeout))
    elapsed = time.perf_counter() - t0
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = {k: (cpu_seconds(pid) - cpu0[k]) * 1e6 / n for k, pid in pids.items() if k != "B"}
    cpu["B"] = (me1.ru_utime + me1.ru_stime - me0.ru_utime - me0.ru_stime) * 1e6 / n
    return n / elapsed, cpu


def main() -> None:
    ap = move_args(__doc__, 20000, 600.0)
    ap.add_argument("--modes", default=",".join(MODES), help="ack modes to run, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="run every move this many times, interleaved")
    ap.add_argument("--no-spin", action="store_true",
                    help="RabbitMQ's schedulers do not busy-wait (+sbwt none): its CPU time is its work "
                         "(on a loaded machine the spinning is charged as CPU time per message)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ``timeout``: brokers stopped on the way out
    if args.no_spin:
        os.environ["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = "+sbwt none +sbwtdcpu none +sbwtdio none"
    results: list[dict[str, Any]] = []
    with three_brokers("shovel", "skredshovelbench", ("rabbitmq_shovel", "rabbitmq_shovel_management")) as (
            rabbit, a, b):
        assert rabbit.mgmt_port is not None
        api_a, api_b, api_r = Api(a.mgmt_port), Api(b.mgmt_port), Api(rabbit.mgmt_port)
        r_url = uri(rabbit.port)
        pids = process_ids(rabbit, a, b)
        for mode in [m for _ in range(args.rounds) for m in args.modes.split(",")]:
            base = {"ack-mode": mode, "src-prefetch-count": PREFETCH, "reconnect-delay": 1}
            moves = [
                ("skred A->B", api_b, a.url, {"src-uri": uri(a.port), "dest-uri": "amqp://"}),
                ("plugin A->B", api_r, a.url, {"src-uri": uri(a.port), "dest-uri": uri(b.port)}),
                ("skred A->B push", api_a, a.url, {"src-uri": "amqp://", "dest-uri": uri(b.port)}),
                ("skred R->B", api_b, r_url, {"src-uri": r_url, "dest-uri": "amqp://"}),
                ("plugin R->B", api_r, r_url, {"src-uri": "amqp://", "dest-uri": uri(b.port)}),
                ("skred B->B local", api_b, b.url, {"src-uri": "amqp://", "dest-uri": "amqp://"}),
                ("bare R->", api_r, r_url, {}),
            ]
            for label, runner, src_url, ends in moves:
                if not chosen(args.moves, label):
                    continue
                tag = f"{label.split()[0]}-{mode}-{len(results)}"
                value = {**base, **ends, "src-queue": f"bench-src-{tag}", "dest-queue": f"bench-dst-{tag}"}
                if label.startswith("bare"):
                    rate, cpu = bare_move(src_url, value["src-queue"], args.messages, mode, args.timeout,
                                          pids)
                else:
                    rate, cpu = one_move(label, runner, api_b, b.url, src_url, value, args.messages,
                                         args.timeout, pids)
                record(results, {"move": label, "ack_mode": mode}, f"{label:18} {mode:10}", rate, cpu)
    report(results, {"messages": args.messages}, args.json, f"{args.messages} messages of 1 KiB per move",
           [("move", "move", 18), ("ack_mode", "ack mode", 10)])
    if not args.json:
        for line in ratios(results):
            print(line)


RATIOS = (("skred A->B", "plugin A->B"), ("skred A->B push", "plugin A->B"), ("skred R->B", "plugin R->B"),
          ("skred R->B", "bare R->"), ("plugin R->B", "bare R->"))


def ratios(results: list[dict[str, Any]]) -> list[str]:
    """Same-run ratios of the rates, per ack mode and round (rows of one mode in run order)."""
    out = []
    seen: dict[str, int] = {}
    rounds: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        key = (r["ack_mode"], r["move"])
        n = seen[str(key)] = seen.get(str(key), 0) + 1
        rounds.setdefault((r["ack_mode"], n), {})[r["move"]] = r["msg_per_s"]
    for (mode, n), rates in rounds.items():
        parts = [f"{a} / {b} = {rates[a] / rates[b]:.2f}" for a, b in RATIOS if a in rates and b in rates]
        if parts:
            out.append(f"{mode} round {n}: " + "; ".join(parts))
    return out


if __name__ == "__main__":
    main()
