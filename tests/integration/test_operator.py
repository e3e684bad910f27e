"""An operator's first hour with ``skred``: one-line startup errors naming the option or
path, the log lines an operator reads, and SIGHUP reloading what can change at runtime.

Every case runs the real command (``python -m broker``) in a subprocess; a startup error
must be exactly one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import REPO_ROOT, SkredProcess, is_external

pytestmark = pytest.mark.skipif(
    is_external(), reason="tests the Skred command line; SKRED_TEST_EXTERNAL_URL points at another broker"
)

RUN_TIMEOUT = 60.0  # seconds for one short-lived skred run (it must exit on its own)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


def run_skred(args: list[str], *, preamble: str = "",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``skred ARGS`` to completion; ``preamble`` is Python run first in the same process."""
    if "--data-dir" in args:  # a node start: LMQ's fixed default ports are not what these tests check
        args = [*args, "--no-lmq"]
    code = f"{preamble}\nimport sys\nfrom broker.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=str(REPO_ROOT), env=_env(env),
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``skred: error: ...`` line a failed start must print (log lines before it aside)."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_clustering_without_the_etcd_client_is_one_line(tmp_path: Path) -> None:
    # sys.modules[name] = None makes `import aetcd` fail exactly as if it were not installed.
    result = run_skred(["--data-dir", str(tmp_path / "d"), "--clustering"],
                       preamble="import sys; sys.modules['aetcd'] = None")
    line = one_error_line(result)
    assert "aetcd" in line and "clustering" in line, line
    assert result.returncode == 1


def test_unknown_flag_is_one_line_without_the_usage() -> None:
    result = run_skred(["--no-such-flag"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "skred: error: unrecognized arguments: --no-such-flag (see skred --help)"], result.stderr


def test_unresolvable_amqp_bind_names_the_option(tmp_path: Path) -> None:
    result = run_skred(["--data-dir", str(tmp_path / "d"), "--amqp-bind", "no-such-host.invalid",
                        "--amqp-port", "0", "--mgmt-port", "0", "--mgmt-metrics-port", "0"])
    line = one_error_line(result)
    assert "amqp.bind" in line and "no-such-host.invalid" in line, line


def test_data_dir_that_is_a_file_names_the_path(tmp_path: Path) -> None:
    data = tmp_path / "not-a-dir"
    data.write_text("")
    result = run_skred(["--data-dir", str(data), "--amqp-port", "0", "--mgmt-port", "0",
                        "--mgmt-metrics-port", "0"])
    line = one_error_line(result)
    assert str(data) in line and "not a directory" in line, line


def test_read_only_data_dir_names_the_path(tmp_path: Path) -> None:
    data = tmp_path / "ro"
    data.mkdir()
    args = ["--data-dir", str(data), "--amqp-port", "0", "--mgmt-port", "0", "--mgmt-metrics-port", "0",
            "--no-lmq"]
    code = "import sys\nfrom broker.cli import main\nsys.exit(main(sys.argv[1:]))"
    if os.geteuid() == 0:
        # root writes through permission bits: make the directory a read-only mount instead.
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'mount -t tmpfs -o ro tmpfs "{data}" && exec "$@"', "sh", sys.executable, "-c", code, *args]
    else:
        data.chmod(0o555)
        argv = [sys.executable, "-c", code, *args]
    result = subprocess.run(argv, cwd=str(REPO_ROOT), env=_env(), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT)
    line = one_error_line(result)
    assert str(data) in line and ("read-only" in line or "permission denied" in line), line


def test_data_dir_in_use_is_said_once(broker_factory: Callable[..., SkredProcess]) -> None:
    first = broker_factory()
    assert first.data_dir is not None
    result = run_skred(["--data-dir", str(first.data_dir), "--amqp-port", "0", "--mgmt-port", "0",
                        "--mgmt-metrics-port", "0"])
    line = one_error_line(result)
    assert line.count(str(first.data_dir)) == 1 and line.count("in use") == 1, line


def test_metrics_port_in_use_exits_naming_the_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_skred(["--data-dir", str(tmp_path / "d"), "--amqp-port", "0", "--mgmt-port", "0",
                            "--mgmt-metrics-port", str(port)])
    line = one_error_line(result)
    assert "mgmt.metrics_port" in line and str(port) in line, line


def test_skredctl_into_a_closed_pipe_is_quiet(shared_broker: SkredProcess) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `skredctl ... | head` after head exited
    try:
        result = subprocess.run(
            [sys.executable, "-m", "broker.ctl", "--url", f"http://127.0.0.1:{shared_broker.mgmt_port}",
             "list", "exchanges"],
            cwd=str(REPO_ROOT), env=_env(), stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=RUN_TIMEOUT)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 141, result.returncode  # 128 + SIGPIPE, as `head` pipelines expect


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)  # poll interval of a readiness loop with a deadline
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def messages(path: Path) -> list[str]:
    return [entry["message"] for entry in json_lines(path)]


def test_operator_log_lines_as_json_in_a_file(broker_factory: Callable[..., SkredProcess],
                                              tmp_path: Path) -> None:
    log_file = tmp_path / "skred.jsonl"
    b = broker_factory(["--log-format", "json", "--log-file", str(log_file), "--log-level", "debug"])
    wait_for(lambda: log_file.exists() and any("AMQP listening" in m for m in messages(log_file)),
             "the AMQP listening line in the log file")
    entries = json_lines(log_file)  # every line is a JSON object (json.loads would raise)
    assert {"time", "level", "logger", "message"} <= set(entries[0])
    assert any(m.startswith("skred 0.1.0 starting") for m in messages(log_file))
    assert any("created default user 'guest'" in m for m in messages(log_file))

    params = pika.URLParameters(b.url)
    params.client_properties = {"connection_name": "operator-test"}
    conn = pika.BlockingConnection(params)
    wait_for(lambda: any("opened" in m and "operator-test" in m for m in messages(log_file)),
             "a connection-opened line naming the client")
    opened = next(m for m in messages(log_file) if "opened" in m and "operator-test" in m)
    assert "user 'guest'" in opened and "vhost '/'" in opened and "127.0.0.1:" in opened, opened
    conn.close()
    wait_for(lambda: any("closed" in m and "operator-test" in m for m in messages(log_file)),
             "a connection-closed line")
    assert any(e["level"] == "debug" for e in json_lines(log_file)), "--log-level debug adds nothing"

    bad = pika.URLParameters(b.url.replace("guest:guest", "guest:wrong"))
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        pika.BlockingConnection(bad)
    wait_for(lambda: any("login refused" in m and "wrong password" in m for m in messages(log_file)),
             "a login-refused line saying why")


def test_sighup_reloads_and_keeps_serving(broker_factory: Callable[..., SkredProcess],
                                          tmp_path: Path) -> None:
    ini = tmp_path / "skred.ini"
    ini.write_text("[main]\nlog_level = info\n")
    b = broker_factory(["-c", str(ini)])
    assert b.pid is not None
    definitions = tmp_path / "definitions.json"
    definitions.write_text(json.dumps({"queues": [
        {"name": "from-sighup", "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}]}))
    ini.write_text(f"[main]\nlog_level = debug\nload_definitions = {definitions}\n"
                   "[amqp]\ntrusted_proxies = 10.0.0.0/8\n")
    os.kill(b.pid, signal.SIGHUP)
    wait_for(lambda: "SIGHUP: reloaded" in b.log_text(), "the SIGHUP reload line")
    line = next(x for x in b.log_text().splitlines() if "SIGHUP: reloaded" in x)
    assert "log level info -> debug" in line and "10.0.0.0/8" in line and str(definitions) in line, line
    assert b.alive(), "SIGHUP must not stop the broker"
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    with conn:
        conn.channel().queue_declare("from-sighup", passive=True)  # imported by the reload

    ini.write_text("[main]\nlog_level = loud\n")
    os.kill(b.pid, signal.SIGHUP)
    wait_for(lambda: "configuration not reloaded" in b.log_text(), "the refused reload line")
    assert b.alive()
    assert b.stop() == 0


def test_perf_stops_when_the_broker_goes_away_and_removes_its_queue(
        broker_factory: Callable[..., SkredProcess], tmp_path: Path) -> None:
    b = broker_factory()
    out_path = tmp_path / "perf.out"
    with open(out_path, "w") as out:
        perf = subprocess.Popen(
            [sys.executable, "-m", "broker.perf", "throughput", "--uri", b.url, "-z", "120",
             "--queue-durable", "-s", "16"],
            cwd=str(REPO_ROOT), env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "published" in out_path.read_text(), "skred-perf's first rate line", 30.0)
        declared = [line.split("declared queue ", 1)[1].split()[0]
                    for line in out_path.read_text().splitlines() if "declared queue " in line]
        assert declared, out_path.read_text()
        b.kill9()
        b.start()  # the broker comes back (same data dir and port); the durable queue with it
        assert perf.wait(60) == 1, out_path.read_text()
    finally:
        if perf.poll() is None:
            os.killpg(perf.pid, signal.SIGKILL)
            perf.wait(10)
    text = out_path.read_text()
    assert "Traceback" not in text, text
    assert "connection to the broker lost" in text, text
    assert f"deleted queue {declared[0]}" in text, text
    conn = pika.BlockingConnection(pika.URLParameters(b.url))
    with conn:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            conn.channel().queue_declare(declared[0], passive=True)
    assert err.value.reply_code == 404
