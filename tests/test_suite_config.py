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
