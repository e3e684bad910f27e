"""The broker's cost per row of the Spark sink's exactly-once rows through a deduplicating
exchange, against the same rows through a plain one: process CPU, or instructions (callgrind), A/B;
the cache in memory and on disk (``x-cache-persistence``, broker/model/dedup_cache.py).

The broker's side only, no sockets: a session (``tests/_amqp_session.py``) is fed the frames the
sink writes for exactly once to an exchange (``amqp_frames.frame_batch`` of ``dedup_props``: each
row persistent, its id in ``message_id`` and the ``x-deduplication-header`` header) into a fanout
exchange bound to a stream, in confirm mode, in reads of 64 KiB as a socket would hand them
over. The exchange is declared with ``x-message-deduplication`` and ``x-cache-persistence``
``memory`` or ``disk`` (a tree older than that argument ignores it: memory both times), or
without (``plain``: the same varied property lists, no cache). Each tree (this checkout, and any other
given with ``--base``, e.g. an older commit unpacked by ``git archive``) runs in a process of
its own. By default the child times its rows (process CPU, the best of ``--rounds`` fresh
brokers; on a loaded machine compare the ratio). With ``--callgrind`` it runs under
``valgrind --tool=callgrind`` with ``n`` and with ``2n`` rows and the difference over ``n`` is
the instructions of one row (start-up, imports and declarations cancel out; slow: minutes per
run for the imports alone).

Usage: ``python benchmarks/dedup_exchange_cost.py [-n 20000] [--rounds 3] [--base DIR] [--callgrind]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)
READ = 65536  # bytes per read, as the network layer hands them over


MODES = ("plain", "memory", "disk")


def _child(n: int, mode: str, rounds: int) -> None:
    """Publish ``n`` rows ``rounds`` times on fresh brokers; print the best CPU µs per row."""
    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"]) / "tests"))
    import pyarrow as pa
    from _amqp_session import Client, close_node, make_node, pump  # type: ignore[import-not-found]
    from pamqp import commands

    from broker.spark.amqp_frames import dedup_props, frame_batch

    values = pa.array([b"value-%d" % i for i in range(n)], pa.binary())
    props = dedup_props("x-deduplication-header", "q.0.0", 1, n)
    data = frame_batch(b"in", False, b"", props, values, 131072)
    assert data is not None

    async def run(tmp: Path) -> float:
        node = make_node(tmp)
        c = Client(node)
        c.open(1)
        c.method(commands.Confirm.Select())
        c.method(commands.Queue.Declare(queue="s", durable=True, arguments={"x-queue-type": "stream"}))
        args = {"x-message-deduplication": True, "x-cache-size": 1_000_000,
                "x-cache-persistence": mode} if mode != "plain" else {}
        c.method(commands.Exchange.Declare(exchange="in", exchange_type="fanout", durable=True,
                                           arguments=args))
        c.method(commands.Queue.Bind(queue="s", exchange="in"))
        c.read()
        t0 = time.process_time()
        for at in range(0, len(data), READ):
            c.session.receive_data(data[at:at + READ])
            c.session.after_batch()
            await pump(node)
        cpu = time.process_time() - t0
        assert node.vhosts["/"].queues["s"].message_count == n
        close_node(node)
        return cpu / n * 1e6

    best = float("inf")
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="skred-dxc-") as tmp:
            best = min(best, asyncio.run(run(Path(tmp))))
    print(f"{best:.3f}")


def _cpu(tree: Path, n: int, mode: str, rounds: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", str(n), mode, str(rounds)],
                         check=True, env=env, capture_output=True, text=True, timeout=1800)
    return float(out.stdout.split()[-1])


def _count(tree: Path, n: int, mode: str) -> int:
    with tempfile.TemporaryDirectory(prefix="skred-dxc-cg-") as work:
        out = Path(work) / "cg.out"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                        __file__, "--child", str(n), mode, "1"],
                       check=True, env=env, cwd=work, capture_output=True, timeout=1800)
        m = _TOTALS.search(out.read_text(errors="replace"))
        assert m is not None
        return int(m.group(1))


def per_row(tree: Path, n: int, mode: str) -> float:
    return (_count(tree, 2 * n, mode) - _count(tree, n, mode)) / n


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        _child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", type=Path, help="another tree (holding broker/ and tests/) to compare")
    ap.add_argument("--callgrind", action="store_true", help="count instructions instead (needs valgrind)")
    a = ap.parse_args()
    trees = [("this", REPO_ROOT)] + ([("base", a.base.resolve())] if a.base else [])
    unit = "instructions" if a.callgrind else "CPU µs"
    print(f"sink rows through a fanout exchange into a stream, {a.n} rows: {unit} per row")
    print("| tree | plain exchange | dedup, memory | dedup, disk | memory / plain | disk / memory |\n"
          "| --- | --: | --: | --: | --: | --: |")
    for name, tree in trees:
        if a.callgrind:
            plain, memory, disk = (per_row(tree, a.n, mode) for mode in MODES)
        else:
            plain, memory, disk = (_cpu(tree, a.n, mode, a.rounds) for mode in MODES)
        print(f"| {name} | {plain:,.2f} | {memory:,.2f} | {disk:,.2f} | {memory / plain:.2f} | "
              f"{disk / memory:.2f} |", flush=True)

if __name__ == "__main__":
    main()
