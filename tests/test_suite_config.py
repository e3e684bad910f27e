"""The suite's own configuration: per-directory hooks stay in their directory.

pytest hands ``pytest_collection_modifyitems`` in any conftest.py every collected item of
the session, so a hook that marks "its" tests must filter by path. Run together with
``tests/integration`` (as the full suite does), this test sees whether the integration
conftest's 60 s timeout leaked onto it.
"""

from __future__ import annotations

import pytest


def test_no_directory_hook_put_a_timeout_on_this_test(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout") is None


def test_every_scheduled_scope_names_a_path_of_the_suite() -> None:
    """A file in SLOW_FIRST or SHARED_GROUPS that was renamed or moved would quietly lose its
    place at the front of the run (and a slow file left at the tail leaves one worker alone)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("suite_conftest", root / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    for scope in [*suite.SLOW_FIRST, *suite.SHARED_GROUPS]:
        assert (root / scope).exists(), scope
