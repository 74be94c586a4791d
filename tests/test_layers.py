"""The daemon's folders are its layers (docs/ARCHITECTURE.md): a module imports only from its
own layer or the layers below, so the tree shows what may depend on what.  The client library
is below the whole daemon and imports none of it."""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Lowest first.  A name is a sub-package of daemon/ or a module at its top.
LAYERS: list[tuple[str, ...]] = [
    ("_network", "_network_build", "config"),  # the C data path and the settings
    ("reports",),  # what the driver records for operators: error log, loss report
    ("protocol",),  # sans-I/O pieces: types, parameters, loss detection, retransmits, cleaning
    ("flow",),  # flow- and congestion-control interfaces and strategies
    ("pressure",),  # back-pressure episodes and the pressure governor
    ("streams",),  # a network publication and a publication image
    ("media",),  # the endpoints' dispatchers, UDP transports, name resolution
    ("agents",),  # the sender, the receiver and their thread
    ("conductor",),  # commands, resources, IPC publications, the network side's endpoints
    ("ops",),  # stat, metrics, systemd
    # The process, in four layers:
    ("directory",),  # the driver directory: its lock, adopting it, the names a driver makes
    ("core",),  # what every driver runs: command socket, counters, the conductor's cycle
    ("shell", "embedded"),  # who runs it: a driver process's trio shell, or invoker mode
    ("driver", "demo", "cli"),  # the launcher (MediaDriver) and the commands
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _daemon_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, first name under slipstream.daemon) of every import in ``path``, lazy ones too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "slipstream.daemon":
                for alias in node.names:
                    yield node.lineno, alias.name
            elif node.module.startswith("slipstream.daemon."):
                yield node.lineno, node.module.split(".")[2]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("slipstream.daemon."):
                    yield node.lineno, alias.name.split(".")[2]


def _layer_of(path: Path) -> str:
    relative = path.relative_to(ROOT / "daemon")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_every_daemon_module_is_in_a_layer() -> None:
    unplaced = {_layer_of(p) for p in (ROOT / "daemon").rglob("*.py")} - set(RANK) - {"__init__"}
    assert not unplaced, f"place these in LAYERS (and docs/ARCHITECTURE.md): {unplaced}"


def test_daemon_modules_import_only_their_own_layer_or_below() -> None:
    upward = []
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        layer = _layer_of(path)
        for line, imported in _daemon_imports(path):
            if layer != "__init__" and RANK[imported] > RANK[layer]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {imported}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_client_library_imports_nothing_of_the_driver_or_the_tools() -> None:
    offending = []
    for path in sorted((ROOT / "client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                       [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offending += [f"{path.relative_to(ROOT)}:{node.lineno} imports {m}" for m in modules
                          if m.startswith(("slipstream.daemon", "slipstream.sim",
                                           "slipstream.spark_bridge"))]
    assert not offending, "\n".join(offending)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``path``, lazy ones too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_the_archive_is_a_client_of_the_driver_and_nothing_more() -> None:
    """The archive service is a client of its host's driver, as Aeron Archive is: it imports
    the client library (and itself), nothing of the driver, the simulator or the Spark
    bridge; and the client library imports nothing of the archive."""
    offending = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted((ROOT / "archive").rglob("*.py"))
                 for line, module in _imports(path)
                 if module.startswith("slipstream.") and
                 not module.startswith(("slipstream.client", "slipstream.archive"))]
    offending += [f"{path.relative_to(ROOT)}:{line} imports {module}"
                  for path in sorted((ROOT / "client").rglob("*.py"))
                  for line, module in _imports(path)
                  if module.startswith("slipstream.archive")]
    assert not offending, "\n".join(offending)


def _client_module(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = ["slipstream", *relative.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_client_librarys_modules_import_each_other_without_a_cycle() -> None:
    """Lazy imports and those under ``TYPE_CHECKING`` count too: a cycle held apart by them
    is still one.  ``from slipstream.client import name`` imports the module ``name`` when
    there is one (the C extensions too, by their stubs), else the package."""
    modules = {_client_module(path): path for path in (ROOT / "client").rglob("*.py*")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imported = graph.setdefault(module, set())
        if path.suffix == ".pyi":  # a C extension's stub: it imports nothing of the client
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                imported.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                                else node.module for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name in modules)
        imported.discard(module)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as cycle:
        raise AssertionError(f"an import cycle: {' -> '.join(cycle.args[1])}") from None
