"""Celery end to end against a real Skred process, with a real ``celery worker`` process.

The app (written into the test's temp dir) uses Celery 5.5+'s RabbitMQ-4 setup: quorum default
queue, a topic default exchange and native delayed delivery (kombu's 28 chained topic exchanges
and TTL queues with ``x-overflow: reject-publish``, dead-lettering at-least-once), ``acks_late``
and a prefetch multiplier of 1. Tasks record what they did in a file, one line each, so the test
reads the effects rather than a result backend. One broker and one worker run the whole story in
order: prefetch, groups, retries, countdowns that must not run early and must survive a broker
restart, and a task whose worker is killed with SIGKILL mid-run, which must run again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._support import REPO_ROOT, SkredProcess, wait_until
from .test_mgmt_api import Api, http_ready, pytestmark, q, start_mgmt_broker

__all__ = ["pytestmark"]

celery = pytest.importorskip("celery")

TASKS = '''
import os, time
from celery import Celery

app = Celery("skredtasks", broker=os.environ["SKRED_CELERY_BROKER"])
app.conf.update(
    task_default_queue_type="quorum",
    task_default_exchange_type="topic",
    broker_native_delayed_delivery_queue_type="quorum",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    broker_connection_retry=True,
    broker_heartbeat=0,
    worker_hijack_root_logger=False,
)
LOG = os.environ["SKRED_CELERY_LOG"]


def note(*words):
    with open(LOG, "a") as fh:
        fh.write(" ".join(str(w) for w in words) + f" {time.time():.3f}\\n")


@app.task
def record(tag):
    note("done", tag)


@app.task
def slow(tag, seconds):
    marker = LOG + "." + tag
    first = not os.path.exists(marker)
    open(marker, "a").close()
    note("start", tag)
    if first:
        time.sleep(seconds)  # the first run is killed here; the redelivery finishes at once
    note("done", tag)


@app.task(bind=True, max_retries=5)
def flaky(self, tag, failures):
    note("try", tag, self.request.retries)
    if self.request.retries < failures:
        raise self.retry(countdown=1)
    note("done", tag)
'''


class Worker:
    def __init__(self, tmp: Path, broker: SkredProcess) -> None:
        self.tmp = tmp
        self.broker = broker
        self.proc: subprocess.Popen[bytes] | None = None
        self.n = 0

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SKRED_CELERY_BROKER"] = f"amqp://guest:guest@127.0.0.1:{self.broker.port}//"
        env["SKRED_CELERY_LOG"] = str(self.tmp / "effects.log")
        env["PYTHONPATH"] = os.pathsep.join([str(self.tmp), str(REPO_ROOT)])
        return env

    def start(self) -> None:
        self.n += 1
        log = open(self.tmp / f"worker{self.n}.log", "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "skredtasks", "worker", "-c", "1", "-P", "prefork",
             "-l", "INFO", "--without-gossip", "--without-mingle", "-n", f"w{self.n}@%h"],
            cwd=self.tmp, env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and its pool child
            self.proc.wait(15)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def log(self) -> str:
        return "\n".join((self.tmp / f"worker{i}.log").read_text(errors="replace")[-3000:]
                         for i in range(1, self.n + 1))


def send(tmp: Path, worker: Worker, code: str) -> None:
    """Run ``code`` in a fresh producer process (the tasks module imported as the app)."""
    subprocess.run([sys.executable, "-c", "from skredtasks import *\n" + textwrap.dedent(code)],
                   cwd=tmp, env=worker.env(), check=True, timeout=60, capture_output=True)


def effects(tmp: Path) -> list[list[str]]:
    path = tmp / "effects.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def done_at(tmp: Path, tag: str) -> float | None:
    for words in effects(tmp):
        if words[0] == "done" and words[1] == tag:
            return float(words[-1])
    return None


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[SkredProcess, Worker]]:
    (tmp_path / "skredtasks.py").write_text(TASKS)
    b = start_mgmt_broker(tmp_path)
    worker = Worker(tmp_path, b)
    try:
        yield b, worker
    finally:
        worker.kill9()
        b.close()


def consumers_on(api: Api, queue: str) -> int:
    status, body, _ = api.call("GET", f"/api/queues/%2F/{q(queue)}")
    return int(body["consumers"]) if status == 200 else 0


@pytest.mark.timeout(240)
def test_celery_quorum_native_delayed_delivery_restart_acks_late(setup: tuple[SkredProcess, Worker],
                                                                 tmp_path: Path) -> None:
    b, worker = setup
    api = Api(b.mgmt_port)
    worker.start()
    wait_until(lambda: consumers_on(api, "celery") == 1, 60, f"the worker consuming:\n{worker.log()}")
    assert api.get("/api/queues/%2F/celery")["type"] == "quorum"
    assert api.get("/api/queues/%2F/celery_delayed_0")["type"] == "quorum"
    # Server identity: kombu sees product "Skred", so the spec's qos semantics; Celery sends
    # basic.qos(global=False), which Skred (like RabbitMQ) applies per consumer: 1 here.
    from kombu import Connection

    with Connection(worker.env()["SKRED_CELERY_BROKER"]) as kc:
        kc.connect()
        assert kc.connection.server_properties["product"] == "Skred"
        assert kc.qos_semantics_matches_spec is True
    consumer = next(c for c in api.get("/api/consumers") if c["queue"]["name"] == "celery")
    assert consumer["prefetch_count"] == 1, consumer
    channel = api.get(f"/api/channels/{q(consumer['channel_details']['name'])}")
    assert channel["global_prefetch_count"] == 0, channel

    # groups
    send(tmp_path, worker, "from celery import group\ngroup(record.s(f'g{i}') for i in range(10))()")
    wait_until(lambda: all(done_at(tmp_path, f"g{i}") for i in range(10)), 30, "the group")

    # retries through the delayed-delivery exchanges
    send(tmp_path, worker, "flaky.delay('f', 2)")
    wait_until(lambda: done_at(tmp_path, "f") is not None, 40, f"retried task\n{worker.log()}")
    assert [w[2] for w in effects(tmp_path) if w[0] == "try" and w[1] == "f"] == ["0", "1", "2"]

    # countdowns: not early, and not lost across a broker restart
    t0 = time.time()
    send(tmp_path, worker, "record.apply_async(('cd3',), countdown=3)\n"
                           "record.apply_async(('cd12',), countdown=12)")
    assert api.get("/api/queues/%2F/celery")["messages"] == 0  # held in the delay queues
    wait_until(lambda: done_at(tmp_path, "cd3") is not None, 30, f"cd3\n{worker.log()}")
    assert done_at(tmp_path, "cd3") >= t0 + 3  # type: ignore[operator]
    assert done_at(tmp_path, "cd12") is None
    b.restart()  # cd12 waits in celery_delayed_3 (8 s) or _2 (4 s) across the restart
    wait_until(lambda: http_ready(b.mgmt_port), 15, "management API after restart")
    wait_until(lambda: done_at(tmp_path, "cd12") is not None, 60, f"cd12 after restart\n{worker.log()}")
    assert done_at(tmp_path, "cd12") >= t0 + 12  # type: ignore[operator]

    # acks_late: the worker dies mid-task; the message comes back and runs to the end
    wait_until(lambda: consumers_on(api, "celery") == 1, 60, "the worker back after the restart")
    behind = "".join(f"record.delay('after{i}')\n" for i in range(3))
    send(tmp_path, worker, "slow.delay('k', 300)\n" + behind)
    wait_until(lambda: any(w[:2] == ["start", "k"] for w in effects(tmp_path)), 30, "slow task started")
    celery_q = api.get("/api/queues/%2F/celery")
    assert celery_q["messages_unacknowledged"] == 1 and celery_q["messages_ready"] == 3  # prefetch 1
    worker.kill9()
    wait_until(lambda: consumers_on(api, "celery") == 0, 15, "the dead worker's consumer gone")
    assert api.get("/api/queues/%2F/celery")["messages_ready"] == 4
    worker.start()
    wait_until(lambda: done_at(tmp_path, "k") is not None, 60, f"the killed task re-run\n{worker.log()}")
    wait_until(lambda: all(done_at(tmp_path, f"after{i}") for i in range(3)), 30, "tasks behind it")
    worker.stop()
