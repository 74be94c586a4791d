"""The conductor touches a network publication or a publication image only where
daemon/streams/ownership.py lets it (``CONDUCTOR_MAY``): the fields set as it was made, the
counters and what its agent publishes, and its own.  Everything else belongs to the sender's or
the receiver's thread, which the conductor asks by command (daemon/agents/commands.py).

The check reads the conductor's modules: an attribute of an expression that is a publication
(``<x>.publication``, or a name bound to one) or an image (``<x>.image``, ``<x>.response_image``,
``new_image(...)``, or a name bound to one) must be in the table, with an owner the conductor
may touch.

The stream objects' code is grouped the same way: their ``__init__`` sets the fields, and the
class defines the methods, in sections headed by their owner (``SECTION_HEADINGS``), checked
against the tables; so is the code of the driver's name cache and resolver (``NAME_THREADS``,
whose owners tests/test_names.py checks as a driver runs)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from slipstream.daemon.media.names import NameCache, NameResolver
from slipstream.daemon.streams import ownership
from slipstream.daemon.streams.image import PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication

ROOT = Path(__file__).resolve().parent.parent
CONDUCTOR = ROOT / "daemon" / "conductor"
PUBLICATION, IMAGE = "publication", "image"
TABLES = {PUBLICATION: ownership.PUBLICATION_THREADS, IMAGE: ownership.IMAGE_THREADS}
_KIND_OF_ATTRIBUTE = {"publication": PUBLICATION, "image": IMAGE, "response_image": IMAGE}
_KIND_OF_ANNOTATION = {"NetworkPublication": PUBLICATION, "PublicationImage": IMAGE}

#: (function, kind, attribute) the check lets be, each with its reason.
ALLOWED = {
    # The image is the conductor's until on_add_publication_image hands it over: its first
    # subscribers are added as it is made (handed_over=False).
    ("link", IMAGE, "add_subscriber_position"),
}


def _kind(node: ast.expr, names: dict[str, str]) -> str | None:
    """Whether ``node`` is a publication or an image (by the names bound so far)."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        return _KIND_OF_ATTRIBUTE.get(node.attr)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "new_image"):
        return IMAGE
    return None


def _bind(target: ast.expr, value: ast.expr | None, names: dict[str, str]) -> None:
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        for t, v in zip(target.elts, value.elts, strict=False):
            _bind(t, v, names)
    elif isinstance(target, ast.Name) and value is not None:
        kind = _kind(value, names)
        if kind is not None:
            names[target.id] = kind


def _arguments(args: ast.arguments, names: dict[str, str]) -> None:
    """Parameters annotated as a publication or an image, and lambda defaults bound to one
    (``lambda now, p=publication: ...``)."""
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    for arg in every:
        annotation = arg.annotation
        text = ast.unparse(annotation) if annotation is not None else ""
        for name, kind in _KIND_OF_ANNOTATION.items():
            if name in text:
                names[arg.arg] = kind
    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults,
                            strict=True):
        _bind(ast.Name(arg.arg), default, names)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None:
            _bind(ast.Name(arg.arg), default, names)


def violations(source: str, filename: str) -> list[str]:
    """Every touch of a publication or an image in ``source`` that its table does not give
    the conductor: ``file:line function kind.attribute (owner)``."""
    found: dict[tuple[int, int], str] = {}  # by place: a lambda is walked in its function too
    tree = ast.parse(source, filename)
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)]
    for function in functions:
        names: dict[str, str] = {}
        _arguments(function.args, names)
        name = getattr(function, "name", "<lambda>")
        body = function.body if isinstance(function.body, list) else [function.body]
        nodes = sorted((n for b in body for n in ast.walk(b)),
                       key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    _bind(target, node.value, names)
            elif isinstance(node, ast.AnnAssign | ast.NamedExpr):
                _bind(node.target, node.value, names)
            elif isinstance(node, ast.Lambda):
                _arguments(node.args, names)
            elif isinstance(node, ast.Attribute):
                kind = _kind(node.value, names)
                if kind is None:
                    continue
                owner = TABLES[kind].get(node.attr, "nobody (not in the table)")
                if owner in ownership.CONDUCTOR_MAY or (name, kind, node.attr) in ALLOWED:
                    continue
                found.setdefault((node.lineno, node.col_offset),
                                 f"{filename}:{node.lineno} {name}: {kind}.{node.attr} ({owner})")
    return sorted(found.values())


def test_the_architecture_page_shows_the_tables() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert ownership.threads_markdown() in text, (
        "paste ownership.threads_markdown() into docs/ARCHITECTURE.md")


def test_the_conductor_touches_only_what_its_thread_may_of_publications_and_images() -> None:
    found = [v for path in sorted(CONDUCTOR.glob("*.py"))
             for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("the conductor touches what an agent's thread owns (ask the agent by "
                       "a command, or read what it publishes):\n" + "\n".join(found))


@pytest.mark.parametrize(("source", "expected"), [
    ("def f(entry):\n    return entry.publication.is_flushed\n", "publication.is_flushed"),
    ("def f(entry):\n    publication = entry.publication\n    publication._receivers\n",
     "publication._receivers"),
    ("def f(entry):\n    return [lambda now, p=entry.publication: p.close(now)]\n",
     "publication.close"),
    ("def f(image: PublicationImage):\n    image.left_behind\n", "image.left_behind"),
    ("def f(e):\n    image, cell = e.image, e.cell\n    image.remove_subscriber_position(cell)\n",
     "image.remove_subscriber_position"),
])
def test_the_check_finds_a_touch_of_an_agents_field(source: str, expected: str) -> None:
    found = violations(source, "example.py")
    assert len(found) == 1 and expected in found[0], found


def test_the_check_lets_the_conductor_read_what_is_fixed_or_published() -> None:
    source = ("def f(entry):\n    p = entry.publication\n"
              "    return p.session_id, p.sender_position, p.status, entry.image.rcv_pos\n")
    assert violations(source, "example.py") == []


_TABLES_OF_CLASSES = [(NetworkPublication, ownership.PUBLICATION_THREADS),
                      (PublicationImage, ownership.IMAGE_THREADS),
                      (NameCache, ownership.NAME_THREADS["NameCache"]),
                      (NameResolver, ownership.NAME_THREADS["NameResolver"])]


@pytest.mark.parametrize(("cls", "table"), _TABLES_OF_CLASSES)
def test_every_public_field_and_method_has_an_owner(cls: type, table: dict[str, str]) -> None:
    """The table names every public field and method of the class, its bases' properties
    included (and nothing else), so that a new one is given an owner as it is written."""
    path = Path(__import__(cls.__module__, fromlist=["_"]).__file__ or "")
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    public = {n.name for n in node.body
              if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    public |= {n.attr for n in ast.walk(node)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "self" and isinstance(n.ctx, ast.Store)
               and not n.attr.startswith("_")}
    # and the fields it takes from its bases (OfOneLog's: those of its log's identity)
    public |= {name for base in cls.__mro__[1:] if base.__module__.startswith("slipstream.")
               for name, value in vars(base).items()
               if hasattr(value, "__get__") and not callable(value) and not name.startswith("_")}
    assert public == set(table), (f"no owner: {sorted(public - set(table))}; "
                                  f"not in the class: {sorted(set(table) - public)}")


_HEADING = re.compile(r"^\s+# -- (.+?)(?: -+)?$")


def misplaced(source: str, class_name: str, table: dict[str, str]) -> list[str]:
    """Every public field that ``class_name``'s ``__init__`` sets, and every public method of
    it, under a section heading (``# -- ...``) whose owner is not the table's; and every
    heading of the class that names no owner.  ``line name: under <owner>, the table's
    <owner>``."""
    lines = source.splitlines()
    node = next(n for n in ast.parse(source).body
                if isinstance(n, ast.ClassDef) and n.name == class_name)
    headings: list[tuple[int, str | None]] = []  # (line, the owner it names)
    found = []
    for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        match = _HEADING.match(lines[number - 1])
        if match:
            owner = next((owner for owner, heading in ownership.SECTION_HEADINGS.items()
                          if match.group(1).startswith(heading)), None)
            headings.append((number, owner))
            if owner is None:
                found.append(f"{number} heading {match.group(1)!r}: names no owner")

    def under(number: int) -> str | None:
        owners = [owner for line, owner in headings if line < number]
        return owners[-1] if owners else None

    named: list[tuple[int, str]] = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            if not item.name.startswith("_"):
                named.append((item.lineno, item.name))
            elif item.name == "__init__":
                named += [(n.lineno, n.attr) for n in ast.walk(item)
                          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                          and n.value.id == "self" and isinstance(n.ctx, ast.Store)
                          and not n.attr.startswith("_")]
    for number, name in named:
        owner = under(number)
        if owner != table.get(name):
            found.append(f"{number} {name}: under {owner}, the table's {table.get(name)}")
    return found


@pytest.mark.parametrize(("cls", "table"), _TABLES_OF_CLASSES)
def test_the_code_groups_fields_and_methods_by_their_owner(cls: type,
                                                           table: dict[str, str]) -> None:
    """The stream object's ``__init__`` sets its fields, and the class defines its methods,
    in sections headed by their owner (as aeron_network_publication.h groups its fields), so
    that a reader sees who may touch what; the owners are the table's."""
    path = Path(__import__(cls.__module__, fromlist=["_"]).__file__ or "")
    found = misplaced(path.read_text(), cls.__name__, table)
    assert not found, "in the wrong section (or a heading without an owner):\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "expected"), [
    ("class P:\n    def __init__(self):\n        # -- fixed at creation\n        self.a = 1\n"
     "        # -- the sender thread's: its state\n        self.b = 2\n", "6 b: under sender"),
    ("class P:\n    # -- sampled: counters\n    def a(self):\n        pass\n",
     "3 a: under sampled"),
    ("class P:\n    # -- the spies ---\n    def b(self):\n        pass\n", "names no owner"),
])
def test_the_section_check_finds_a_field_or_method_out_of_place(source: str,
                                                                  expected: str) -> None:
    found = misplaced(source, "P", {"a": ownership.FIXED, "b": ownership.FIXED})
    assert any(expected in line for line in found), found
