"""Suite-wide settings.

Brokers started by the tests run ONE worker unless a test asks for more (``--workers 2``: a
flag beats the environment): ``[main] workers`` defaults to one per core, so on CI's two
cores every existing test would otherwise run two workers, and the suite is the proof that
``workers = 1`` is today's broker unchanged. Multi-worker behaviour has its own tests
(tests/integration/test_workers.py). Set SKRED_MAIN_WORKERS yourself to run the suite on
more workers.
"""

from __future__ import annotations

import os

os.environ.setdefault("SKRED_MAIN_WORKERS", "1")
