"""Runs README.md's local three-node cluster as written; started by test_readme_cluster.py
inside a private network namespace and a private /tmp (see there). Exits 0 when the cluster
worked and stopped, else prints what failed and exits 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pika

DEADLINE = 90.0  # seconds for etcd + three nodes to elect a leader and serve, under load


def wait(predicate: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)  # poll interval of a readiness loop with a deadline
    raise SystemExit(f"timed out after {timeout}s waiting for {what}")


def login(port: int) -> pika.BlockingConnection | None:
    try:
        return pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", port, socket_timeout=5, connection_attempts=1))
    except pika.exceptions.AMQPError:
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    repo, start_block, stop_block = sys.argv[1], sys.argv[2], sys.argv[3]
    # `skred` from this checkout, not whatever an earlier install put on PATH.
    shim = Path("/tmp/.readme-shim")
    shim.mkdir()
    (shim / "skred").write_text(f'#!/bin/sh\nPYTHONPATH={repo} exec {sys.executable} -m broker "$@"\n')
    (shim / "skred").chmod(0o755)
    os.environ["PATH"] = f"{shim}:{os.environ['PATH']}"
    pid_files = [Path(f"/tmp/skred-{n}.pid") for n in ("1", "2", "3", "etcd")]
    try:
        subprocess.run(["bash", "-euc", start_block], check=True, timeout=60)
        for port in (5671, 5672, 5673):
            wait(lambda port=port: (c := login(port)) is not None and c.close() is None, f"AMQP on {port}")
        wait(lambda: Path("/tmp/skred-hooks.log").exists(), "/tmp/skred-hooks.log from the hook")
        conn = login(5672)
        assert conn is not None
        with conn:
            channel = conn.channel()
            channel.confirm_delivery()
            channel.queue_declare("readme", durable=True)
            channel.basic_publish("", "readme", b"hello", pika.BasicProperties(delivery_mode=2))
        conn = login(5673)
        assert conn is not None
        with conn:
            method, _, body = conn.channel().basic_get("readme", auto_ack=True)
        assert method is not None and body == b"hello", "a message published on 5672 was not read on 5673"
        status = subprocess.run(["skred", "--cluster-status", "--json"], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        print("cluster status:", json.dumps(json.loads(status.stdout))[:300])

        pids = [int(f.read_text()) for f in pid_files]
        subprocess.run(["bash", "-euc", stop_block], check=True, timeout=60)
        wait(lambda: not any(alive(pid) for pid in pids), "every node and etcd to exit", 60.0)
        for n in ("1", "2", "3"):
            log = Path(f"/tmp/skred-{n}.log").read_text()
            assert "stopped" in log and "Traceback" not in log, f"node {n} did not stop:\n{log[-2000:]}"
    finally:
        for f in pid_files:
            if f.exists() and alive(pid := int(f.read_text())):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
