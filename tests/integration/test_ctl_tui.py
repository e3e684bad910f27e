"""``skredctl tui`` in a real terminal: tmux runs it against a real broker, the test sends keys
and reads the screen (capture-pane): pages, sort, reverse, filter, details, resize, quit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._support import REPO_ROOT, SkredProcess, wait_until
from .test_mgmt_api import Api, pytestmark, start_mgmt_broker  # noqa: F401

QUEUES = [f"tuiq-{i:02d}" for i in range(20)]


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("tui"))
    api = Api(b.mgmt_port)
    for i, name in enumerate(QUEUES):
        api.ok("PUT", f"/api/queues/%2F/{name}", {"durable": True}, expect=(201, 204))
        for _ in range(i % 3):
            api.ok(
                "POST",
                "/api/exchanges/%2F/amq.default/publish",
                {"properties": {}, "routing_key": name, "payload": "x", "payload_encoding": "string"},
                expect=(200,),
            )
    yield b
    b.close()


class Tmux:
    """A tmux server of the test's own (its socket in tmp), one session running the dashboard."""

    def __init__(self, sock: Path) -> None:
        self.sock = str(sock)

    def __call__(self, *args: str) -> str:
        r = subprocess.run(
            ["tmux", "-f", os.devnull, "-S", self.sock, *args], capture_output=True, text=True, timeout=10
        )
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "tui")

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", "tui", *keys)

    def wait_for(self, text: str, what: str, gone: bool = False) -> str:
        shown: list[str] = [""]

        def seen() -> bool:
            shown[0] = self.screen()
            return (text not in shown[0]) if gone else (text in shown[0])

        try:
            wait_until(seen, 15, what)
        except AssertionError:
            raise AssertionError(f"{what}: screen was\n{shown[0]}") from None
        return shown[0]


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    assert shutil.which("tmux"), "tmux is needed (.ci/run installs it)"
    t = Tmux(tmp_path / "tmux.sock")
    yield t
    subprocess.run(["tmux", "-S", t.sock, "kill-server"], capture_output=True, timeout=10)


def _rows(screen: str) -> list[str]:
    return [line.split()[1] for line in screen.splitlines() if line.startswith("/ ") and "tuiq-" in line]


def test_dashboard_in_tmux(mb: SkredProcess, tmux: Tmux) -> None:
    cmd = (
        f"env PYTHONPATH={REPO_ROOT} {sys.executable} -m broker.ctl --url http://127.0.0.1:{mb.mgmt_port} "
        "tui --interval 0.3"
    )
    tmux("new-session", "-d", "-s", "tui", "-x", "150", "-y", "40", cmd)
    tmux("resize-window", "-t", "tui", "-x", "150", "-y", "40")  # a detached session may start at 80x24
    screen = tmux.wait_for("queued msgs", "the overview with its graphs")
    assert "<o>OVERVIEW" in screen and "publish/s" in screen
    tmux.wait_for("queues 20", "the overview's totals")

    tmux.keys("q")  # the queues page, paged to the terminal: 40 lines leave 37 rows
    screen = tmux.wait_for("<q>QUEUES", "the queues page")
    screen = tmux.wait_for("tuiq-19", "every queue on one screen")
    assert "(20 of 20; rows 1-20)" in screen

    tmux.keys("S")  # sort by the next column: name
    screen = tmux.wait_for("sort: name", "sorted by name")
    assert _rows(screen) == QUEUES
    tmux.keys("R")
    screen = tmux.wait_for("sort: name desc", "reversed")
    assert _rows(screen) == QUEUES[::-1]

    tmux.keys("/", "tuiq-1", "Enter")  # filter: tuiq-10..19
    screen = tmux.wait_for("filter: tuiq-1 ", "filtered")
    assert _rows(screen) == [f"tuiq-1{i}" for i in range(9, -1, -1)]

    tmux.keys("Down", "Enter")  # details of the second row (descending: tuiq-18)
    # the page's title comes at once, the row's details when their request answers
    screen = tmux.wait_for('"durable": true', "the row's details")
    assert "details: queues" in screen and "\nname: tuiq-18\n" in screen and "\nmessages: 0\n" in screen
    tmux.keys("Escape")
    tmux.wait_for("details:", "back to the list", gone=True)

    tmux("resize-window", "-t", "tui", "-x", "90", "-y", "10")  # 10 lines: 7 rows a page
    screen = tmux.wait_for("90x10", "redrawn at the new size")
    assert "(10 of 20; rows 1-7)" in screen and len(_rows(screen)) == 7
    tmux.keys("NPage", "NPage")  # the cursor a page down twice: to the last row, the view follows
    screen = tmux.wait_for("rows 4-10", "the last page")
    assert _rows(screen)[-1] == "tuiq-10"

    tmux.keys("c")  # the connections page, then one the broker does not offer
    tmux.wait_for("<c>CONNECTIONS", "the connections page")
    tmux.keys("l")
    tmux.wait_for("does not offer logs", "a page the API lacks says so")

    tmux.keys("Q")
    wait_until(
        lambda: (
            subprocess.run(
                ["tmux", "-S", tmux.sock, "has-session", "-t", "tui"], capture_output=True, timeout=10
            ).returncode
            != 0
        ),
        10,
        "the dashboard quit",
    )
