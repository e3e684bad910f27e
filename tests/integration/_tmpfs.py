"""A broker on a small tmpfs of its own: a private mount namespace (``unshare -m``) holds the
mount, and the broker runs inside it (``nsenter -m``). Shared by the full-disk tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._support import SkredProcess, is_external

NEEDS = pytest.mark.skipif(
    is_external() or os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
    reason="needs root, unshare and nsenter (private mount namespace with a tmpfs)",
)

TMPFS_SIZE = 24 * 1024 * 1024


class NamespacedBroker(SkredProcess):
    """A broker process started inside the holder's mount namespace."""

    def __init__(self, data_dir: Path, holder: int, extra_args: list[str]) -> None:
        self.holder = holder
        super().__init__(data_dir, extra_args)
        # SkredProcess puts its log next to the data dir, which is on the tmpfs only
        # inside the namespace: the outside directory stays empty, so this is fine.

    def argv(self) -> list[str]:
        return ["nsenter", "-t", str(self.holder), "-m", "--", *super().argv()]

    def run_inside(self, *cmd: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["nsenter", "-t", str(self.holder), "-m", "--", *cmd],
                              capture_output=True, timeout=60, check=False)


def mount_tmpfs(tmp_path: Path, size: int = TMPFS_SIZE) -> Iterator[tuple[Path, int]]:
    """(mount point, pid of the namespace holder); for a fixture to yield from."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
         f"mount -t tmpfs -o size={size} skredtest '{mnt}' && echo ready && exec sleep 900"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if line.strip() != b"ready":
        holder.kill()
        why = holder.stderr.read() if holder.stderr else b""
        pytest.skip(f"cannot mount a tmpfs in a private namespace: {why!r}")
    try:
        yield mnt, holder.pid
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)
