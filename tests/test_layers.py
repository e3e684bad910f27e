"""The layering rules of STYLE.md: the import-linter contracts in pyproject.toml, run with
``lint-imports``, plus an ``ast`` check of the sans-IO and store rules that also sees dynamic
imports (``__import__``, ``importlib.import_module``).

Every import statement of a module counts, wherever it stands (module top,
function body, ``if TYPE_CHECKING``), and relative imports are resolved to
absolute names first, so ``from .. import net`` cannot slip through.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

BROKER = Path(__file__).resolve().parent.parent / "broker"


def module_name(path: Path) -> str:
    rel = path.relative_to(BROKER.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``.

    ``from a import b`` yields both ``a`` and ``a.b`` (b may be a submodule).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{mod}.{alias.name}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def files_in(layer: str) -> list[Path]:
    files = sorted((BROKER / layer).rglob("*.py")) if (BROKER / layer).is_dir() else [BROKER / f"{layer}.py"]
    assert files and files[0].exists(), f"no sources under broker/{layer}"
    return files


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(layer: str, allowed_broker: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in files_in(layer):
        rel = path.relative_to(BROKER.parent)
        for line, name in imports_of(path):
            if any(is_under(name, b) for b in banned):
                found.append(f"{rel}:{line} imports {name}")
            elif is_under(name, "broker") and name != "broker":
                if not any(is_under(name, a) or a.startswith(name + ".") for a in allowed_broker):
                    found.append(f"{rel}:{line} imports {name}")
    return found


NETWORK = ("asyncio", "socket", "uvloop", "selectors", "ssl", "aiohttp")
BOTTOM = ("broker.errors", "broker.properties", "broker.bursts", "broker.patterns",
          "broker.jsonbody")  # the bottom every layer may use


def test_import_linter_contracts_kept() -> None:
    """Every layer of STYLE.md, as the contracts in pyproject.toml state it."""
    exe = shutil.which("lint-imports")
    assert exe is not None, "import-linter is in the test extra: pip install -e '.[test]'"
    done = subprocess.run([exe, "--no-cache", "--no-logo"], cwd=BROKER.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_amqp_layer_is_sans_io() -> None:
    # the session glue logs users in (auth), reads its settings (config) and a peer's certificate
    assert violations("amqp", (*BOTTOM, "broker.amqp", "broker.model", "broker.auth", "broker.config",
                               "broker.tls", "broker.__version__"), NETWORK) == []


@pytest.mark.parametrize("module", ["amqp/codec", "amqp/connection"])
def test_amqp_protocol_machine_is_pure(module: str) -> None:
    assert violations(module, (*BOTTOM, "broker.amqp.codec", "broker.amqp.connection", "broker.model"),
                      NETWORK) == []


def test_net_holds_transport_only() -> None:
    """The AMQP-to-model glue lives in broker/amqp; net adapts it to asyncio sockets."""
    assert {p.stem for p in files_in("net")} == {"__init__", "listener", "proxy", "server"}


def test_store_layer_imports_only_errors_and_itself() -> None:
    assert violations("store", (*BOTTOM, "broker.store"), ("asyncio", "uvloop")) == []


def test_model_layer_is_protocol_neutral() -> None:
    # The model stores messages with AMQP basic properties (the on-disk record format); it
    # reads them through broker.properties, never through the AMQP layer.
    banned = NETWORK + ("broker.net", "broker.http", "broker.cluster", "broker.amqp")
    allowed = ("broker.model", "broker.store", *BOTTOM)
    assert violations("model", allowed, banned) == []


def test_model_layer_never_imports_net_http_cluster() -> None:
    # The hard floor of the rule above, kept separate so a failure names it.
    banned = ("asyncio", "socket", "broker.net", "broker.http", "broker.cluster")
    assert violations("model", ("broker",), banned) == []


# ------------------------------------------------------ self-checks
@pytest.mark.parametrize(
    "source,expected,bad",
    [
        ("import asyncio\n", "asyncio", True),
        ("from asyncio import sleep\n", "asyncio", True),
        ("def f():\n    import socket\n", "socket", True),
        ("from .. import net\n", "broker.net", True),
        ("from ..net.session import Session\n", "broker.net.session", True),
        ("import broker.http.api as api\n", "broker.http.api", True),
        ("__import__('asyncio')\n", "asyncio", True),
        ("import importlib\nimportlib.import_module('broker.cluster')\n", "broker.cluster", True),
        ("from . import codec\n", "broker.amqp.codec", False),
        ("from ..errors import NotFound\n", "broker.errors.NotFound", False),
        ("import struct\n", "struct", False),
    ],
)
def test_import_scanner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expected: str, bad: bool
) -> None:
    fake = tmp_path / "broker" / "amqp"
    fake.mkdir(parents=True)
    (fake / "mod.py").write_text(source, encoding="utf-8")
    monkeypatch.setattr(f"{__name__}.BROKER", tmp_path / "broker")
    assert expected in [n for _, n in imports_of(fake / "mod.py")]
    found = violations("amqp", ("broker.errors", "broker.amqp"), NETWORK)
    assert bool(found) is bad, found


def test_production_code_reads_no_test_hooks() -> None:
    """Faults enter through seams the tests own (e.g. broker.cluster.host.Host), never through
    environment variables the broker reads."""
    found = [f"{p.relative_to(BROKER.parent)}" for p in BROKER.rglob("*.py")
             if "SKRED_TEST" in p.read_text(encoding="utf-8")]
    assert found == []


# ------------------------------------------------------ the model's own stack
def model_stack() -> list[list[str]]:
    """The layers of the ``model-stack`` contract in pyproject.toml, top first."""
    data = tomllib.loads((BROKER.parent / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in data["tool"]["importlinter"]["contracts"] if c["id"] == "model-stack")
    assert contract["containers"] == ["broker.model"] and contract["exhaustive"] is True
    return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]


def test_model_is_a_stack() -> None:
    """queue engine -> exchanges and routing -> publish -> vhost registry (STYLE.md): no module of
    model/ imports one listed above it, nor a sibling of its own layer, wherever the import stands
    (function bodies, ``if TYPE_CHECKING``, ``__import__``); every module has its place."""
    layers = model_stack()
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    modules = {p.stem for p in files_in("model")} - {"__init__"}
    assert modules == set(level), f"unplaced: {modules - set(level)}, gone: {set(level) - modules}"
    found = []
    for path in files_in("model"):
        if path.stem == "__init__":
            continue
        for line, name in imports_of(path):
            target = name.split(".")[2] if is_under(name, "broker.model") and name != "broker.model" else None
            if target in level and target != path.stem and level[target] <= level[path.stem]:
                found.append(f"model/{path.name}:{line} imports {name}")
    assert found == []
