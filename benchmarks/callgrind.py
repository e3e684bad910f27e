"""Instructions per message on the hot path, counted by valgrind's callgrind.

CPU time on a shared machine moves by tens of per cent from run to run; an instruction count
does not. One child process runs every scenario under ``valgrind --tool=callgrind``, each on a
broker of its own (a real ``Node`` and its vhost, real segment files in a temp dir, sessions fed
pre-encoded frames as in ``benchmarks/hotpath.py``). Around each measured loop the parent zeroes
callgrind's counters and dumps them (``callgrind_control``), so start-up, imports and set-up
are not counted; the count over ``n`` is the cost of one message. The child waits for the
parent by polling a file (valgrind answers ``callgrind_control`` only while its client runs),
which adds a few hundred instructions to a measurement of millions.

Scenarios: ``publish`` (identical messages to a queue without consumers: runs),
``publish-varied`` (every message different, 200 B-2 KiB with headers), ``deliver-autoack``,
``direct-autoack`` (publish while an autoack consumer waits: the direct hand-over),
``deliver-ack`` (prefetch 1000, acked in multiples), ``topic`` (through ``amq.topic`` to two
queues) and ``topic-50`` (issue 31's topic workload: 50 queues bound to ``amq.topic`` with
``*.r<j % 10>.k<j // 10>``, every message a random one of their 50 keys, so one delivery each,
an autoack consumer on every queue), ``ack-each`` (issue 31's manual ack: varied messages
published while a consumer with prefetch 100 waits, 50 at a time, each acked with a Basic.Ack of
its own), ``queues-1000`` (issue 31's 1,000 queues: varied messages published to 1,000 queues in
turn, each on a producer channel of its own and with an autoack consumer on a channel of its
own) and ``cold`` (issue 31's cold queues: ``n`` new queues, each with an autoack consumer on a
connection of its own and a producer connection of its own that has not published yet; one
message from each producer: what a first message costs).

Usage: ``python benchmarks/callgrind.py [-n 2000] [scenario ...]`` (needs valgrind). Which Python
functions a scenario's instructions go to: run it under cProfile instead (``--profile``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pamqp import commands
from pamqp import frame as pframe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hotpath import handshake, publish_frames  # noqa: E402

SCENARIOS = ("publish", "publish-varied", "deliver-autoack", "direct-autoack", "deliver-ack", "topic",
             "topic-50", "ack-each", "queues-1000", "cold")
_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)


def _wait(flag: Path) -> None:
    while not flag.exists():
        time.sleep(0.005)
    flag.unlink()


def _feed(session: object, data: bytes, out: bytearray | None = None) -> None:
    chunk = 65536
    for i in range(0, len(data), chunk):
        session.receive_data(data[i : i + chunk])  # type: ignore[attr-defined]
        session.after_batch()  # type: ignore[attr-defined]
        if out is not None:
            out.clear()


async def _scenario(scenario: str, n: int, sync: Path) -> None:
    """Set up a broker for ``scenario``, then put ``n`` messages through it between the
    parent's zeroing and dumping of the counters."""
    from broker.amqp.session import Session
    from broker.config import load_config
    from broker.node import Node

    tmp = Path(tempfile.mkdtemp(prefix="skred-callgrind-"))
    try:
        cfg = load_config(["--data-dir", str(tmp), "--no-sync", "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        pub = Session(broker, ("127.0.0.1", 1), lambda: None)
        handshake(pub)
        pub.receive_data(pframe.marshal(commands.Queue.Declare(queue="hp"), 1))
        frames = publish_frames(n, 16, "hp", scenario == "publish-varied")
        if scenario == "topic":
            for q in ("t1", "t2"):
                pub.receive_data(pframe.marshal(commands.Queue.Declare(queue=q), 1))
                pub.receive_data(pframe.marshal(commands.Queue.Bind(queue=q, exchange="amq.topic",
                                                                     routing_key="a.*"), 1))
            frames = publish_frames(n, 16, "a.b").replace(
                pframe.marshal(commands.Basic.Publish(exchange="", routing_key="a.b"), 1),
                pframe.marshal(commands.Basic.Publish(exchange="amq.topic", routing_key="a.b"), 1))
        pub.out.clear()
        q = broker.vhosts["/"].queues["hp"]
        cons = Session(broker, ("127.0.0.1", 2), lambda: None)
        handshake(cons)
        producers: list[tuple[object, bytes]] = []
        if scenario == "cold":
            producers = _cold(broker, n)
        if scenario == "topic-50":
            warm, frames = _topic_50(pub, cons, n)
            _feed(pub, warm, cons.out)  # every key routed once, every queue's first segment made
        if scenario in ("deliver-autoack", "deliver-ack"):
            _feed(pub, frames)
        plan: list[tuple[bytes, bytes]] = []
        if scenario == "ack-each":
            plan = _ack_each_plan(publish_frames(n, 16, "hp", True), n)
            cons.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=100), 1))
            cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c"), 1))
        if scenario == "queues-1000":
            frames = _queues(pub, cons, n, 1000)
        if scenario in ("deliver-autoack", "direct-autoack"):
            cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c",
                                                                    no_ack=True), 1))
        elif scenario == "deliver-ack":
            cons.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=1000), 1))
            cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c"), 1))
        cons.out.clear()
        print("ready", flush=True)
        _wait(sync)  # counters zeroed
        if scenario in ("deliver-autoack", "deliver-ack"):
            while q.message_count:
                q._deliver()
                cons.out.clear()
                if scenario == "deliver-ack":
                    tag = cons.chs[1].next_tag - 1
                    cons.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
        elif plan:  # ack-each: a batch of publishes, then the acks of what they delivered
            for batch, acks in plan:
                _feed(pub, batch)
                _feed(cons, acks, cons.out)
        elif producers:
            for p, frame in producers:
                _feed(p, frame)
        else:
            _feed(pub, frames, cons.out)
        print("done", flush=True)
        _wait(sync)  # counters dumped
        for vh in broker.vhosts.values():
            vh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cold(broker: object, n: int) -> list[tuple[object, bytes]]:
    """``n`` queues, each consumed (autoack) by a connection of its own; a producer connection
    per queue, opened, and the one message it will send."""
    from broker.amqp.session import Session

    out = []
    for i in range(n):
        c = Session(broker, ("127.0.0.1", 10_000 + i), lambda: None)  # type: ignore[arg-type]
        handshake(c)
        c.receive_data(pframe.marshal(commands.Queue.Declare(queue=f"cold{i}"), 1))
        c.receive_data(pframe.marshal(commands.Basic.Consume(queue=f"cold{i}", no_ack=True), 1))
        c.after_batch()
        p = Session(broker, ("127.0.0.1", 30_000 + i), lambda: None)  # type: ignore[arg-type]
        handshake(p)
        p.after_batch()
        out.append((p, publish_frames(1, 64, f"cold{i}")))
    return out


def _ack_each_plan(frames: bytes, n: int) -> list[tuple[bytes, bytes]]:
    """``frames`` cut into batches of 50 messages, each with the acks that follow it: a Basic.Ack
    of its own for every delivery (tags 1..n in order: the consumer gets every message)."""
    marker = pframe.marshal(commands.Basic.Publish(exchange="", routing_key="hp"), 1)
    starts, at = [], frames.find(marker)
    while at >= 0:
        starts.append(at)
        at = frames.find(marker, at + len(marker))
    starts.append(len(frames))
    def acks(lo: int, hi: int) -> bytes:
        return b"".join(pframe.marshal(commands.Basic.Ack(delivery_tag=t + 1), 1) for t in range(lo, hi))

    return [(frames[starts[b] : starts[min(b + 50, n)]], acks(b, min(b + 50, n))) for b in range(0, n, 50)]


def _queues(pub: object, cons: object, n: int, queues: int) -> bytes:
    """``queues`` queues, each consumed (autoack) on a channel of its own of ``cons`` and
    published to on a channel of its own of ``pub``; ``n`` varied messages to them in turn."""
    names = [f"mq{i}" for i in range(queues)]
    for i, name in enumerate(names):
        ch = i + 2
        pub.receive_data(pframe.marshal(commands.Channel.Open(), ch))  # type: ignore[attr-defined]
        pub.receive_data(pframe.marshal(commands.Queue.Declare(queue=name), ch))  # type: ignore[attr-defined]
        cons.receive_data(pframe.marshal(commands.Channel.Open(), ch))  # type: ignore[attr-defined]
        cons.receive_data(pframe.marshal(commands.Basic.Consume(  # type: ignore[attr-defined]
            queue=name, consumer_tag=f"c{i}", no_ack=True), ch))
    frames = publish_frames(n, 16, "", True, names, True)
    _feed(pub, publish_frames(queues, 16, "", True, names, True), cons.out)  # every queue warm once
    return frames


def _topic_50(pub: object, cons: object, n: int) -> tuple[bytes, bytes]:
    """Declare and bind the 50 queues, consume each (autoack); a warm-up publish to each key,
    then ``n`` publishes to random keys."""
    rnd = random.Random(50)
    for j in range(50):
        bind = commands.Queue.Bind(queue=f"t{j}", exchange="amq.topic", routing_key=f"*.r{j % 10}.k{j // 10}")
        for m in (commands.Queue.Declare(queue=f"t{j}"), bind):
            pub.receive_data(pframe.marshal(m, 1))  # type: ignore[attr-defined]
        cons.receive_data(pframe.marshal(commands.Basic.Consume(  # type: ignore[attr-defined]
            queue=f"t{j}", consumer_tag=f"c{j}", no_ack=True), 1))
    one = publish_frames(1, 16, "")
    plain = pframe.marshal(commands.Basic.Publish(exchange="", routing_key=""), 1)
    keys = [f"orders.r{j % 10}.k{j // 10}" for j in range(50)]

    def to(key: str) -> bytes:
        publish = commands.Basic.Publish(exchange="amq.topic", routing_key=key)
        return one.replace(plain, pframe.marshal(publish, 1))

    return b"".join(map(to, keys)), b"".join(to(rnd.choice(keys)) for _ in range(n))


async def _child(n: int, sync: Path, scenarios: list[str]) -> None:
    for scenario in scenarios:
        await _scenario(scenario, n, sync)


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=600)


def measure(n: int, scenarios: list[str]) -> dict[str, float]:
    """Instructions per message of each scenario (one valgrind run for all of them)."""
    work = Path(tempfile.mkdtemp(prefix="skred-cg-"))
    sync = work / "go"
    out: dict[str, float] = {}
    try:
        child = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/cg.out", sys.executable,
             __file__, "--child", str(n), str(sync), *scenarios],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"})  # the same str hashes, run after run
        assert child.stdout is not None
        pid = str(child.pid)
        for i, scenario in enumerate(scenarios):
            for expect in ("ready", "done"):
                line = child.stdout.readline().strip()
                if line != expect:
                    raise RuntimeError(f"{scenario}: child said {line!r}, not {expect!r}")
                if expect == "ready":
                    _control("--zero", pid)
                else:
                    _control("--dump", pid)
                sync.touch()
            dumps = sorted(work.glob("cg.out*"), key=lambda p: p.stat().st_mtime)
            m = _TOTALS.search(dumps[-1].read_text(errors="replace"))
            if m is None or len(dumps) < i + 1:
                raise RuntimeError(f"{scenario}: no callgrind dump")
            out[scenario] = int(m.group(1)) / n
        child.wait(timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def profile(n: int, scenarios: list[str], top: int = 25) -> None:
    """The scenarios in this process under cProfile (no valgrind): each one's ``top`` broker
    functions by own time. A thread plays the parent's part of touching the flag file."""
    import cProfile
    import pstats
    import threading

    sync = Path(tempfile.mkdtemp(prefix="skred-prof-")) / "go"
    done = threading.Event()

    def touch() -> None:
        end = time.monotonic() + 600
        while not done.is_set() and time.monotonic() < end:
            if not sync.exists():
                sync.touch()
            time.sleep(0.001)

    threading.Thread(target=touch, daemon=True).start()
    try:
        for scenario in scenarios:
            prof = cProfile.Profile()
            prof.enable()
            asyncio.run(_child(n, sync, [scenario]))
            prof.disable()
            print(f"-- {scenario} (set-up included)", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(r"broker/", top)
    finally:
        done.set()
        shutil.rmtree(sync.parent, ignore_errors=True)


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "--child":
        asyncio.run(_child(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="messages per scenario")
    ap.add_argument("--profile", action="store_true", help="cProfile the scenarios instead (no valgrind)")
    ap.add_argument("scenarios", nargs="*", help=f"of {', '.join(SCENARIOS)} (default: all)")
    args = ap.parse_args()
    for scenario in args.scenarios:
        if scenario not in SCENARIOS:
            ap.error(f"no scenario {scenario!r}")
    if args.profile:
        profile(args.n, args.scenarios or list(SCENARIOS))
        return
    print(f"{'scenario':18s} instructions/msg")
    for scenario, per in measure(args.n, args.scenarios or list(SCENARIOS)).items():
        print(f"{scenario:18s} {per:12,.0f}", flush=True)


if __name__ == "__main__":
    main()
