"""A private mosquitto 2.0 broker: the MQTT conformance harness's reference for 3.1.1 and 5.

Theory of operation: Debian's ``mosquitto`` package is installed by ``.ci/run`` with its service
left down. ``MosquittoProcess`` writes a config of its own under a temp dir (one listener on a
free loopback port, no anonymous logins, a password file with ``guest``/``guest`` made by
``mosquitto_passwd``, no persistence file unless ``persistence=True``: benchmarks/mqtt.py restarts
it with persistent sessions) and runs the broker in the foreground in a process
group of its own; readiness is a completed TCP connect under a deadline, and ``close`` stops the
group by its PID (SIGTERM, then SIGKILL after a deadline).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

from .._support import free_port

BOOT_DEADLINE = 20.0


def missing() -> str | None:
    if shutil.which("mosquitto") is None or shutil.which("mosquitto_passwd") is None:
        return "mosquitto is not installed (Debian package mosquitto; .ci/run installs it)"
    return None


class MosquittoProcess:
    def __init__(self, root: Path, persistence: bool = False) -> None:
        self.root = root
        self.persistence = persistence
        self.host = "127.0.0.1"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        passwd = self.root / "passwd"
        passwd.write_text("")
        subprocess.run([str(shutil.which("mosquitto_passwd")), "-b", str(passwd), "guest", "guest"],
                       check=True, timeout=20, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conf = self.root / "mosquitto.conf"
        conf.write_text(f"listener {self.port} {self.host}\nallow_anonymous false\n"
                        f"password_file {passwd}\n"
                        + (f"persistence true\npersistence_location {self.root}/\nautosave_interval 0\n"
                           if self.persistence else "persistence false\n")
                        # as root it would switch to the mosquitto user, who cannot read our temp dir
                        + ("user root\n" if os.geteuid() == 0 else ""))
        self._log = open(self.root / "mosquitto.log", "ab")
        self.proc = subprocess.Popen([str(shutil.which("mosquitto")), "-c", str(conf)], stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + BOOT_DEADLINE
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: "
                                   f"{(self.root / 'mosquitto.log').read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)  # poll interval of a readiness loop with a deadline
        raise RuntimeError("mosquitto did not accept within the deadline")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None
