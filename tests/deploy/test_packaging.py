"""What ``pip install .`` gives: a node that can cluster (the etcd client is a core dependency),
and a LICENSE file that says what pyproject.toml says."""

from __future__ import annotations

import re
import tomllib

from ._tools import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower() for req in requirements}


def test_the_etcd_client_is_a_core_dependency() -> None:
    # Docker compose, Helm and the README's local cluster all enable clustering after `pip install .`.
    assert "aetcd" in requirement_names(PYPROJECT["project"]["dependencies"])
