"""The daemon's folders are its layers (docs/ARCHITECTURE.md): a module imports only from its
own layer or the layers below, so the tree shows what may depend on what.  The client library
is below the whole daemon and imports none of it."""

from __future__ import annotations

import ast
import re
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


def test_the_daemon_imports_nothing_of_the_simulator() -> None:
    """The simulator builds its drivers from the daemon's parts, so it sits above the daemon:
    nothing in daemon/ imports it, lazily or not (the ``slipstream`` command that offers
    both, ``sim`` beside ``driver``, is slipstream.cli, above them)."""
    offending = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                 for path in sorted((ROOT / "daemon").rglob("*.py"))
                 for line, module in _imports(path)
                 if module.startswith("slipstream.sim")]
    assert not offending, "\n".join(offending)


def test_the_simulator_uses_only_the_drivers_public_names() -> None:
    """What sim/ takes of the daemon is its public interface: no name with a leading
    underscore imported from a daemon module, and no private attribute of another object
    (``driver._ready()``).  The C extension ``_network`` is a module whose interface is
    network.h, not a private name."""
    offending = []
    for path in sorted((ROOT / "sim").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "slipstream.daemon"):
                offending += [f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}"
                              for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and not (
                        isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} uses "
                                 f"{ast.unparse(node)}")
    assert not offending, "\n".join(offending)


# -- import cycles ---------------------------------------------------------------------------
#: The product's folders and the package each is installed as (pyproject.toml's package-dir).
PRODUCT = {"namespace": "slipstream", "client": "slipstream.client",
           "daemon": "slipstream.daemon", "sim": "slipstream.sim",
           "spark_bridge": "slipstream.spark_bridge", "archive": "slipstream.archive",
           "config": "slipstream.config"}


def _product_modules() -> dict[str, Path]:
    """Module name -> its source, or a C extension's stub (``.pyi``: it imports nothing)."""
    modules = {}
    for folder, package in PRODUCT.items():
        for path in sorted((ROOT / folder).rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.setdefault(".".join((package, *parts)), path)
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(tree: ast.AST, *, annotations: bool = False,
                     ) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level and in functions; with ``annotations`` those
    under ``if TYPE_CHECKING:`` too (they import nothing, but name what the module's types
    depend on).  Such a block's ``else:`` runs."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking_block(node) and not annotations:
            assert isinstance(node, ast.If)
            yield from _runtime_imports(ast.Module(body=node.orelse, type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _runtime_imports(node, annotations=annotations)


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path,
              modules: dict[str, Path]) -> set[str]:
    """The product modules ``node`` (an import in ``module``, at ``path``) imports.
    ``from P import N`` imports the module P.N when there is one, else P (N is a name P
    defines); a name outside the product is left out."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    imported: set[str | None]
    if isinstance(node, ast.Import):
        imported = {known(alias.name) for alias in node.names}
    else:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        imported = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                    else known(base) for alias in node.names}
    return {name for name in imported if name is not None and name != module}


def _import_graph(*, annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the product modules it imports (with ``annotations``, for its types too)."""
    modules = _product_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        if path.suffix == ".pyi":
            continue
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)),
                                     annotations=annotations):
            graph[module] |= _imported(node, module, path, modules)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's,
    iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_import_graph_finds_a_cycle_through_a_function_level_import() -> None:
    """The checks below see what they guard: a cycle closed by an import inside a function
    (and one under ``TYPE_CHECKING`` when annotations count), and ``from package import
    module`` as an import of that module."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]
    graph = _import_graph()
    tree = ast.parse("def f():\n    from slipstream.spark_bridge import runtime\n")
    assert [ast.unparse(node) for node in _runtime_imports(tree)] == [
        "from slipstream.spark_bridge import runtime"]
    hidden = ast.parse("if TYPE_CHECKING:\n    from slipstream.sim.runner import Simulation\n")
    assert not list(_runtime_imports(hidden))
    other = ast.parse("if TYPE_CHECKING:\n    import a\nelse:\n    import b\n")
    assert [ast.unparse(node) for node in _runtime_imports(other)] == ["import b"]
    assert len(list(_runtime_imports(hidden, annotations=True))) == 1
    assert "slipstream.spark_bridge.runtime" in graph["slipstream.spark_bridge.writer"]


def test_no_import_cycles_among_the_product_modules() -> None:
    """No module of the product imports, directly or through others, one that imports it
    back: imports inside functions count (they run, only later), ``if TYPE_CHECKING:``
    blocks do not.  A cycle is a layer boundary crossed both ways."""
    cycles = [sorted(cycle) for cycle in _cycles(_import_graph())]
    assert not cycles, "import cycles:\n" + "\n".join(" ".join(c) for c in cycles)


def test_no_type_checking_import_closes_a_cycle() -> None:
    """An import under ``if TYPE_CHECKING:`` that closes a cycle is the cycle, hidden from
    the interpreter: what one module uses of another that imports it is stated as a
    Protocol where it is used (sim/host.py's ``World``, media/events.py's ``ImageMaker``),
    or the shared type moves below both."""
    cycles = [sorted(cycle) for cycle in _cycles(_import_graph(annotations=True))]
    assert not cycles, "cycles through TYPE_CHECKING imports:\n" + "\n".join(
        " ".join(c) for c in cycles)


#: (module, the product module it imports under ``if TYPE_CHECKING:``) -> why the import may
#: not run.  Closing an import cycle is no reason (see above); nor is an import the module's
#: importers run anyway.  A third-party module there (pyarrow in the Spark bridge: half a
#: second) is the module's own affair, with its reason on the ``if`` line.
TYPE_CHECKING_IMPORTS: dict[tuple[str, str], str] = {}


def _type_checking_imports(module: str, path: Path, tree: ast.AST,
                           modules: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, product module) of every import under ``if TYPE_CHECKING:`` in ``tree`` (the
    source of ``module`` at ``path``), however deep the block."""
    for block in ast.walk(tree):
        if not _is_type_checking_block(block):
            continue
        assert isinstance(block, ast.If)
        for node in (inner for statement in block.body for inner in ast.walk(statement)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for imported in sorted(_imported(node, module, path, modules)):
                    yield node.lineno, imported


def _unlisted_type_checking_imports(sources: dict[str, str],
                                    listed: dict[tuple[str, str], str]) -> list[str]:
    """``module:line imports X`` for each import of a product module under ``if
    TYPE_CHECKING:`` in ``sources`` (module -> its text) that ``listed`` does not give a
    reason for, and ``listed: (module, X) is gone`` for each listed one not found."""
    modules = _product_modules()
    found = set()
    refused = []
    for module, text in sources.items():
        path = modules[module]
        for line, imported in _type_checking_imports(module, path, ast.parse(text), modules):
            found.add((module, imported))
            if (module, imported) not in listed:
                refused.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    refused += [f"listed: {pair} is gone" for pair in listed if pair not in found]
    return refused


def test_no_product_module_is_imported_only_for_type_checking() -> None:
    """A product module imported under ``if TYPE_CHECKING:`` is an import that exists to
    hide something (most often a cycle): unless :data:`TYPE_CHECKING_IMPORTS` says why it
    may not run, it is a plain import, or the type it names moves below both modules."""
    sources = {module: path.read_text() for module, path in _product_modules().items()
               if path.suffix == ".py"}
    refused = _unlisted_type_checking_imports(sources, TYPE_CHECKING_IMPORTS)
    assert not refused, (
        "imports under TYPE_CHECKING (import it, move the type below both modules, or list "
        "it in TYPE_CHECKING_IMPORTS with why):\n" + "\n".join(refused))


def test_a_type_checking_import_of_a_product_module_is_refused_unless_listed() -> None:
    """The check above sees what it guards: a planted block in media/events.py (``typing.``
    spelled out, relative and absolute imports, one nested in a function) is refused line
    by line; a third-party import there is not; listed, it passes, and a listed import
    that is gone is reported."""
    events = "slipstream.daemon.media.events"
    planted = ("import typing\nimport attrs\n"
               "if typing.TYPE_CHECKING:\n"
               "    import pyarrow as pa\n"
               "    from .receive_channel import ReceiveChannel\n"
               "def f():\n"
               "    if TYPE_CHECKING:\n"
               "        from slipstream.daemon.agents import commands\n"
               "    return attrs\n")
    assert _unlisted_type_checking_imports({events: planted}, {}) == [
        "daemon/media/events.py:5 imports slipstream.daemon.media.receive_channel",
        "daemon/media/events.py:8 imports slipstream.daemon.agents.commands"]
    listed = {(events, "slipstream.daemon.media.receive_channel"): "a reason",
              (events, "slipstream.daemon.agents.commands"): "another"}
    assert _unlisted_type_checking_imports({events: planted}, listed) == []
    assert _unlisted_type_checking_imports({events: "import attrs\n"}, listed) == [
        f"listed: {pair} is gone" for pair in listed]


# -- the client's C files --------------------------------------------------------------------
#: client/'s C files and headers in layers, lowest first: a file includes and calls only
#: files of lower layers (a header's inline functions count as calls of the files that use
#: them).
C_LAYERS: list[tuple[str, ...]] = [
    ("native.h",),  # the interface Python calls
    ("native_internal.h",),  # what the C files share, all of it static inline
    ("native.c", "native_thread.c"),  # the atomics; a thread's name
    ("native_park.c",),  # park and wake: futex eventcounts, the doorbell, the waits
    ("native_logbuffer.c",),  # rotation, cleaning, pre-touch
    ("native_reader.c", "native_scanner.c", "native_rebuilder.c", "native_gap_scanner.c",
     "native_keeper.c"),
    ("native_appender.c",),  # offer, batch, claim; a refusal told apart; credit
    ("native_block_appender.c",),  # an exclusive publication's block appends
    ("fastpath.c",),  # offer() and the subscriber's loop as CPython calls
]
C_RANK = {name: rank for rank, names in enumerate(C_LAYERS) for name in names}


def _c_code(path: Path) -> str:
    """The file without comments, string and character literals and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', '""', text)
    return re.sub(r"^\s*#.*$", " ", text, flags=re.M)


def _c_functions(code: str) -> dict[str, str]:
    """Name -> body of every function defined at the top level of ``code``."""
    functions = {}
    depth, start, header_from = 0, 0, 0
    for at, char in enumerate(code):
        if char == "{":
            if depth == 0:
                start = at
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                header = code[header_from:start]
                match = re.search(r"(\w+)\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*$", header)
                if match and "=" not in header:
                    functions[match.group(1)] = code[start:at + 1]
                header_from = at + 1
        elif char == ";" and depth == 0:
            header_from = at + 1
    return functions


_C_CALL = re.compile(r"\b(\w+)\s*\(")


def test_the_client_c_files_include_and_call_only_downward() -> None:
    files = sorted([*(ROOT / "client").glob("*.c"), *(ROOT / "client").glob("*.h")])
    assert {path.name for path in files} == set(C_RANK), "place every C file in C_LAYERS"
    upward = []
    defined_in: dict[str, str] = {}
    functions = {path.name: _c_functions(_c_code(path)) for path in files}
    for path in files:
        for included in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
            if C_RANK[included] >= C_RANK[path.name]:
                upward.append(f"{path.name} includes {included}")
        if path.suffix == ".c":
            for name in functions[path.name]:
                defined_in.setdefault(name, path.name)
    inline = {name: body for header in ("native.h", "native_internal.h")
              for name, body in functions[header].items()}

    def calls(body: str, seen: frozenset[str] = frozenset()) -> set[str]:
        names = set(_C_CALL.findall(body))
        for name in names & inline.keys() - seen:
            names |= calls(inline[name], seen | {name})
        return names

    for path in files:
        if path.suffix != ".c":
            continue
        for function, body in functions[path.name].items():
            for called in sorted(calls(body)):
                where = defined_in.get(called)
                if where is not None and where != path.name and \
                        C_RANK[where] >= C_RANK[path.name]:
                    upward.append(f"{path.name}: {function} calls {called} of {where}")
    assert not upward, "against the layers of client/'s C files:\n" + "\n".join(upward)
