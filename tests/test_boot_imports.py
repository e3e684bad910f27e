"""What a boot imports before its client ports open (issue 28).

aiohttp's import builds TLS contexts (a tenth of the CPU of a restart with 10,000 MQTT sessions);
a single-process node imports it when it opens its HTTP listeners, after MQTT and AMQP's modules,
so nothing the node, the CLI or the MQTT and AMQP front ends import at module level may pull it in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BOOT_MODULES = ("broker.cli", "broker.node", "broker.mqtt.server", "broker.net.server", "broker.metrics")


def test_the_boot_path_does_not_import_aiohttp() -> None:
    code = ("import sys\n"
            f"for name in {BOOT_MODULES!r}:\n"
            "    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m == 'aiohttp' or m.startswith('aiohttp.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at boot: {out.stdout.strip()}"
