"""The documents hold: every relative link resolves in a clone, and every code block of the
README and the tutorial runs and prints what the page says (or is marked as not run).

A link's target (without its ``#anchor``) must be a file or a directory that git tracks, and be
in the work tree: a file that is only on this disk (ignored, or never added) is not in a clone,
and an exists() check alone would pass it.  An anchor into a Markdown file must name one of its
headings, slugged as GitHub does.  Absolute URLs (``http:``, ``https:``, ``mailto:``, ...) are
not checked; code blocks and code spans are not links.

The code blocks' runs (below) are in the sockets lane, the Spark program's in the spark lane;
the checks of links and marks are unit.
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from helpers import free_port, lacking

ROOT = Path(__file__).resolve().parent.parent

#: ``[text](target "title")`` and ``![alt](target)``; the text may span lines.
_INLINE = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"  # [text], one level of [] inside
                     r"\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)")  # (target "title")
#: ``[label]: target`` reference definitions.
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
#: ``<img src="...">`` and ``<a href="...">``.
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_HTML_ID = re.compile(r"<a\b[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def _git(*args: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                         text=True).stdout
    return [line for line in out.split("\0") if line]


@cache
def tracked_files() -> frozenset[str]:
    return frozenset(_git("ls-files", "-z"))


@cache
def tracked_dirs() -> frozenset[str]:
    dirs = {""}
    for path in tracked_files():
        parent = posixpath.dirname(path)
        while parent not in dirs:
            dirs.add(parent)
            parent = posixpath.dirname(parent)
    return frozenset(dirs)


def markdown_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return []
    return sorted(_git("ls-files", "-z", "*.md"))


def _prose_lines(text: str) -> list[str]:
    """The lines of ``text`` with fenced code blocks blanked (line numbers kept)."""
    lines = text.split("\n")
    fence: str | None = None
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                lines[i] = ""
        else:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                fence = None
            lines[i] = ""
    return lines


def _blank_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (markup gone), lowercased, everything but
    letters, digits, marks, ``_``, ``-`` and spaces dropped, spaces to ``-``."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    kept = "".join(c for c in text
                   if c in " -_" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


@cache
def anchors(path: str) -> frozenset[str]:
    """The anchors of the Markdown file ``path``: its headings' slugs, a repeated slug with
    ``-1``, ``-2``, ... as GitHub numbers them, and explicit ``<a name/id>`` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    lines = _prose_lines((ROOT / path).read_text(encoding="utf-8"))
    for i, line in enumerate(lines):
        match = _ATX.match(line)
        text = None
        if match:
            text = match.group(2) or ""
        elif (i > 0 and lines[i - 1].strip() and re.fullmatch(r" {0,3}(=+|-+)[ \t]*", line)
              and not _ATX.match(lines[i - 1])):
            text = lines[i - 1].strip()  # a setext heading
        if text is None:
            continue
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
        found.update(_HTML_ID.findall(line))
    for line in lines:
        found.update(_HTML_ID.findall(line))
    return frozenset(found)


def links(path: str) -> list[tuple[int, str]]:
    """(line, target) of every link, image and reference definition in ``path``."""
    text = _blank_code_spans("\n".join(_prose_lines((ROOT / path).read_text(encoding="utf-8"))))
    found = []
    for pattern, group in ((_INLINE, 3), (_DEFINITION, 1), (_HTML, 1)):
        for match in pattern.finditer(text):
            target = match.group(group)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, match.start(group)) + 1, target))
    return sorted(found)


def _why_untracked(path: str) -> str:
    if not (ROOT / path).exists():
        return "does not exist"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0
    return ("is on this disk but ignored by git: not in a clone" if ignored else
            "is on this disk but not added to git: not in a clone")


def broken(path: str, target: str) -> str | None:
    """Why ``target``, linked from ``path``, does not resolve in a clone; None if it does."""
    if _SCHEME.match(target) or target.startswith("//"):
        return None  # an absolute URL
    where, _, anchor = target.partition("#")
    where = unquote(where.split("?", 1)[0])
    if not where:
        resolved = path
    else:
        base = "" if where.startswith("/") else posixpath.dirname(path)
        resolved = posixpath.normpath(posixpath.join(base, where.lstrip("/")))
        if resolved == ".":
            resolved = ""
        if resolved == ".." or resolved.startswith("../"):
            return f"{resolved} is outside the repository"
        is_file = resolved in tracked_files()
        if not is_file and resolved not in tracked_dirs():
            return f"{resolved} {_why_untracked(resolved)}"
        if not (ROOT / resolved).exists():
            return f"{resolved} is tracked but missing from the work tree"
        if not is_file:
            return None  # a directory: no anchors
    if anchor and resolved.endswith(".md") and unquote(anchor) not in anchors(resolved):
        return f"{resolved} has no heading for #{anchor}"
    return None


MARKDOWN = markdown_files()


def test_the_markdown_files_are_found() -> None:
    if not MARKDOWN:
        pytest.skip("not a git checkout")
    assert "README.md" in MARKDOWN
    assert "docs/FLOW.md" in MARKDOWN


@pytest.mark.parametrize("path", MARKDOWN)
def test_every_relative_link_resolves_in_a_clone(path: str) -> None:
    problems = [f"{path}:{line}: ({target}) {why}"
                for line, target in links(path)
                if (why := broken(path, target)) is not None]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_are_for() -> None:
    """The checker itself: slugs, and what counts as broken."""
    if not MARKDOWN:
        pytest.skip("not a git checkout")
    assert slug("Offsets, credit and commit") == "offsets-credit-and-commit"
    assert slug("A scenario on namespace hosts (`--on-hosts`)") == \
        "a-scenario-on-namespace-hosts---on-hosts"
    assert slug("Against stock Aeron 1.15.1 (tests/test_interop.py)") == \
        "against-stock-aeron-1151-teststest_interoppy"
    assert broken("README.md", "https://example.com/x.png") is None
    assert broken("README.md", "docs/SPARK.md#offsets-credit-and-commit") is None
    assert broken("docs/FLOW.md", "../README.md#a-first-program") is None
    assert broken("docs/FLOW.md", "../README.md#spark") is not None  # a heading that went
    assert broken("docs/FLOW.md", "PROTOCOL.md") is None
    assert broken("README.md", "examples/spark_pipeline/") is None
    assert broken("README.md", "docs/SPARK.md#no-such-heading") is not None
    assert broken("README.md", "docs/NO-SUCH.md") is not None
    assert broken("README.md", ".venv/") is not None  # on this disk, ignored by git
    assert broken("docs/FLOW.md", "../../outside.md") is not None
    assert links("docs/FLOW.md")  # it has links, the parser sees them


# -- section citations, page lengths, the table of defaults ---------------------------------
#
# The protocol's pages number their sections as one sequence: §1-§2 PROTOCOL.md, §3-§6
# DRIVER.md, §7 CHANNELS.md, §8 DEFAULTS.md, §9 DEPARTURES.md.  A citation names its page
# (``docs/DRIVER.md §4.3``, ``[CHANNELS.md](CHANNELS.md) §7.8``, the page's name on the line
# before the section number included) or is a bare ``§4.3``, which names the one page that
# has that section.  Another standard's sections (``RFC 8312 §4.2``) are not ours.

NUMBERED_PAGES = ("docs/PROTOCOL.md", "docs/DRIVER.md", "docs/CHANNELS.md", "docs/DEFAULTS.md",
                  "docs/DEPARTURES.md")
#: What a page may be over: a reader finds nothing in a page longer than this.
PAGE_LINES_MAX = 1000

_SECTION_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+§(\d+(?:\.\d+)*)[ \t]")
_CITATION = re.compile(r"(?:(?P<page>[\w/.-]+\.md)(?:\]\([^)\s]*\))?[ \t\n#*/\"']*)?"
                       r"§ ?(?P<section>\d+(?:\.\d+)*)")
_OTHER_STANDARD = re.compile(r"\bRFC \d+[ \t]*$")


def sections(page: str) -> list[str]:
    """The section numbers of the headings of ``page`` (``["7", "7.1", ...]``)."""
    return [m.group(1) for line in _prose_lines((ROOT / page).read_text(encoding="utf-8"))
            if (m := _SECTION_HEADING.match(line))]


@cache
def section_pages() -> dict[str, list[str]]:
    """Every section number of the numbered pages, with the pages that have it."""
    found: dict[str, list[str]] = {}
    for page in NUMBERED_PAGES:
        for number in sections(page):
            found.setdefault(number, []).append(page)
    return found


def citations(text: str) -> Iterator[tuple[int, str | None, str]]:
    """(line, page named or None, section) of every section citation in ``text``."""
    for match in _CITATION.finditer(text):
        start = match.start("page") if match.group("page") else match.start()
        if _OTHER_STANDARD.search(text[max(0, start - 20):start]):
            continue
        yield (text.count("\n", 0, match.start("section")) + 1, match.group("page"),
               match.group("section"))


def unresolved(page: str | None, section: str) -> str | None:
    """Why ``§section`` (in ``page``, or bare) names no heading; None if it names one."""
    if page is None:
        pages = section_pages().get(section, [])
        return None if pages else f"no page has a heading §{section}"
    name = posixpath.basename(page)
    named = [p for p in tracked_files() if posixpath.basename(p) == name
             and (p == page or p.endswith("/" + page) or "/" not in page)]
    if not named:
        return f"{page} is not a page of the repository"
    if not any(section in sections(p) for p in named):
        where = ", ".join(section_pages().get(section, [])) or "no page"
        return f"{page} has no heading §{section} (it is in {where})"
    return None


def _cited_files() -> list[str]:
    """The tracked text files that cite sections; this file only shows the forms."""
    if not MARKDOWN:
        return []
    found = []
    for path in sorted(tracked_files() - {"tests/test_docs.py"}):
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # gone from the work tree, or not text
            continue
        if "§" in text:
            found.append(path)
    return found


def test_section_numbers_are_unique_across_the_numbered_pages() -> None:
    if not MARKDOWN:
        pytest.skip("not a git checkout")
    assert {str(n) for n in range(1, 10)} <= set(section_pages())  # each page's are found
    twice = {number: pages for number, pages in section_pages().items() if len(pages) > 1}
    assert not twice, twice
    for page in NUMBERED_PAGES:
        numbers = [tuple(map(int, n.split("."))) for n in sections(page)]
        assert numbers == sorted(numbers), f"{page}: sections out of order"


@pytest.mark.parametrize("path", _cited_files())
def test_every_section_citation_names_a_heading_of_its_page(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    problems = [f"{path}:{line}: §{section}: {why}"
                for line, page, section in citations(text)
                if (why := unresolved(page, section)) is not None]
    assert not problems, "\n".join(problems)


def test_the_citation_checks_catch_what_they_are_for() -> None:
    if not MARKDOWN:
        pytest.skip("not a git checkout")
    sign = "\u00a7"  # spelled so that this file's own scan has nothing to read
    found = list(citations(f"docs/DRIVER.md\n    # {sign}4.3 and {sign}7.8, RFC 8312 {sign}4.2; "
                           f"[CHANNELS.md](CHANNELS.md#78-x) {sign}7.8"))
    assert found == [(2, "docs/DRIVER.md", "4.3"), (2, None, "7.8"),
                     (2, "CHANNELS.md", "7.8")]
    assert unresolved("docs/DRIVER.md", "4.3") is None
    assert unresolved(None, "7.8") is None
    assert "CHANNELS.md" in unresolved("docs/DRIVER.md", "7.8")
    assert unresolved("PROTOCOL.md", "4.3") is not None  # the section moved to DRIVER.md
    assert unresolved(None, "4.99") is not None
    assert unresolved("docs/NO-SUCH.md", "1") is not None


def _pages() -> list[str]:
    return [p for p in MARKDOWN if p == "README.md" or posixpath.dirname(p) == "docs"]


@pytest.mark.parametrize("path", _pages())
def test_no_page_is_over_the_line_limit(path: str) -> None:
    lines = (ROOT / path).read_text(encoding="utf-8").count("\n")
    assert lines <= PAGE_LINES_MAX, (
        f"{path} has {lines} lines, over {PAGE_LINES_MAX}: split it by what a reader comes for")


def _settings_doc() -> object:
    spec = importlib.util.spec_from_file_location("settings_doc",
                                                  ROOT / "scripts" / "settings_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_of_defaults_is_the_settings_table() -> None:
    """DEFAULTS.md lists every setting with its default as daemon/config.py has it, and says
    of each whether it is Aeron's: after a setting is added or its default changed,
    ``python scripts/settings_doc.py`` makes the table again."""
    settings_doc: Any = _settings_doc()
    page = (ROOT / "docs" / "DEFAULTS.md").read_text(encoding="utf-8")
    assert settings_doc.render(page) == page, "run: python scripts/settings_doc.py"
    from slipstream.daemon.config import SETTINGS
    kept = settings_doc.notes(page)
    assert list(kept) == list(SETTINGS)
    assert not [key for key, note in kept.items() if not note], "a setting without its note"


# -- the code blocks of the README and the tutorial, run ------------------------------------
#
# Every fenced block of RUN_DOCS carries a mark on the line above it (an HTML comment, which
# the rendered page does not show):
#
#   <!-- block: NAME -->     run by a run of PAGE_RUNS; a python block named *.py is a
#                            file that the page's shell blocks run
#   <!-- output: NAME -->    what block NAME prints, compared with what it printed
#   <!-- not run: WHY -->    deliberately not run here, saying why
#
# The blocks run as written, in real driver processes, with three exceptions that keep runs
# apart from each other and from a reader's own driver: the driver directory is a private one
# ($SLIPSTREAM_DIR; /dev/shm/tutorial-... becomes a private prefix too), the ports the pages
# use are free ones, and the drivers have small terms and a short drain (their settings'
# environment variables), which no block's output depends on.

RUN_DOCS = ("README.md", "docs/TUTORIAL.md")

#: The runs of the pages' blocks: the page, the blocks that start its drivers (they run until
#: the run ends), and the blocks run to their end in this order, each printing what the page
#: shows as its output.  A python block named *.py is run by the blocks that name it.
PAGE_RUNS = {
    "first-program": ("README.md", ("first-driver",), ("first-program",)),
    "one-host": ("docs/TUTORIAL.md", ("driver",),
                 ("ipc-run", "back-pressure", "asyncio", "invoker")),
    "two-hosts": ("docs/TUTORIAL.md", ("driver-a", "driver-b"), ("udp-run", "mdc-run")),
    "spark": ("docs/TUTORIAL.md", ("driver",), ("spark",)),
}
_RUNNABLE = {"python", "sh"}
_MARK = re.compile(r"^<!-- (block|output|not run): *(.*?) *-->$")
#: What the pages name that a run replaces with its own.
_PAGE_DIRECTORY_PREFIX = "/dev/shm/tutorial-"
_PAGE_PORTS = ("40123", "40124", "40456", "40457")
#: The drivers' settings in the runs (SLIPSTREAM_<KEY>): small terms, a short drain.
_RUN_SETTINGS = {"SLIPSTREAM_IPC_TERM_BUFFER_LENGTH": "1m",
                 "SLIPSTREAM_TERM_BUFFER_LENGTH": "1m",
                 "SLIPSTREAM_DRAIN_TIMEOUT": "2s"}


@dataclass(frozen=True)
class Block:
    """A fenced code block of a Markdown page and its mark (None when it has none)."""

    path: str
    line: int  # of the opening fence, from 1
    language: str  # the fence's info string: "python", "sh", "text" or ""
    text: str
    mark: str | None  # "block", "output" or "not run"
    name: str  # the block's name, the name of the block whose output it is, or why not run


def code_blocks(path: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of the page ``path`` (its text in the work tree, or ``text``)."""
    lines = (text if text is not None else (ROOT / path).read_text(encoding="utf-8")).split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening.group(1)
        end = i + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing.group(1)[0] == fence[0] \
                    and len(closing.group(1)) >= len(fence) \
                    and not lines[end].strip()[len(closing.group(1)):].strip():
                break
            end += 1
        above = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        mark = _MARK.match(above)
        blocks.append(Block(path, i + 1, lines[i].strip()[len(fence):].strip(),
                            "\n".join(lines[i + 1:end]) + "\n",
                            mark.group(1) if mark else None, mark.group(2) if mark else ""))
        i = end + 1
    return blocks


def runs_of(path: str, text: str | None = None) -> set[str]:
    """The names of the blocks of ``path`` that PAGE_RUNS runs."""
    run: set[str] = set()
    for page, drivers, checked in PAGE_RUNS.values():
        if page == path:
            run.update(drivers, checked)
    ran = [block.text for block in code_blocks(path, text) if block.name in run]
    run.update(block.name for block in code_blocks(path, text)
               if block.name.endswith(".py") and any(block.name in code for code in ran))
    return run


def unmarked_or_unrun(path: str, text: str | None = None,
                      run: set[str] | None = None) -> list[str]:
    """What is wrong with the marks of ``path``'s blocks: a block neither run nor marked as not
    run, a name no run runs (``run``, default :func:`runs_of`) or one used twice, an output of
    no block, a reason missing."""
    problems = []
    blocks = code_blocks(path, text)
    run = runs_of(path, text) if run is None else run
    named = [block.name for block in blocks if block.mark == "block"]
    for block in blocks:
        where = f"{path}:{block.line}"
        if block.mark is None:
            problems.append(f"{where}: a block with no mark: run it (<!-- block: NAME --> and "
                            "a run in PAGE_RUNS) or say <!-- not run: WHY -->")
        elif block.mark == "block":
            if block.name not in run:
                problems.append(f"{where}: block {block.name!r} is in no run of PAGE_RUNS")
            if named.count(block.name) > 1:
                problems.append(f"{where}: block {block.name!r} is named twice")
            if block.language not in _RUNNABLE:
                problems.append(f"{where}: block {block.name!r} is {block.language or 'plain'}"
                                f"; a run block is one of {sorted(_RUNNABLE)}")
        elif block.mark == "output" and block.name not in named:
            problems.append(f"{where}: the output of {block.name!r}, which is no block here")
        elif block.mark == "not run" and not block.name:
            problems.append(f"{where}: a block not run must say why")
    return problems


def test_every_block_of_the_readme_and_the_tutorial_is_run_or_marked_not_run() -> None:
    problems = [problem for path in RUN_DOCS for problem in unmarked_or_unrun(path)]
    for run, (path, drivers, checked) in PAGE_RUNS.items():
        named = {block.name for block in code_blocks(path) if block.mark == "block"}
        outputs = {block.name for block in code_blocks(path) if block.mark == "output"}
        problems += [f"PAGE_RUNS[{run!r}] runs {name!r}, which {path} has no block for"
                     for name in (*drivers, *checked) if name not in named]
        problems += [f"PAGE_RUNS[{run!r}] checks {name!r}, which {path} shows no output of"
                     for name in checked if name not in outputs]
    assert not problems, "\n".join(problems)


def test_the_block_marks_are_checked() -> None:
    """The checker itself: each kind of mistake is found."""
    good = "<!-- block: ipc-run -->\n```sh\ntrue\n```\n\n<!-- output: ipc-run -->\n```\nx\n```\n"
    assert unmarked_or_unrun("X.md", good, run={"ipc-run"}) == []
    assert [b.name for b in code_blocks("X.md", good)] == ["ipc-run", "ipc-run"]
    assert code_blocks("X.md", good)[0].text == "true\n"
    for bad in ("```sh\ntrue\n```\n",  # no mark
                "<!-- block: no-such-run -->\n```sh\ntrue\n```\n",
                "<!-- block: ipc-run -->\n```text\ntrue\n```\n",  # not runnable
                good + "<!-- block: ipc-run -->\n```sh\ntrue\n```\n",  # twice
                "<!-- output: ipc-run -->\n```\nx\n```\n",  # of no block
                "<!-- not run: -->\n```\nmake test\n```\n"):  # no reason
        assert unmarked_or_unrun("X.md", bad, run={"ipc-run"}), bad


def _block(path: str, name: str, mark: str = "block") -> Block:
    [block] = [b for b in code_blocks(path) if b.mark == mark and b.name == name]
    return block


class _PageRun:
    """The blocks of one page run as a reader runs them, in a private directory with private
    drivers; :meth:`close` stops the drivers the run started."""

    def __init__(self, path: str, work: Path) -> None:
        self.path = path
        self.work = work
        self.prefix = f"/dev/shm/slipstream-doc-{uuid.uuid4().hex[:10]}-"
        self.ports = {port: str(free_port()) for port in _PAGE_PORTS}
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")},
                    **_RUN_SETTINGS, "SLIPSTREAM_DIR": f"{self.prefix}default",
                    "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        self.drivers: list[tuple[subprocess.Popen[bytes], Path]] = []
        for block in code_blocks(path):  # the page's programs, as files its commands run
            if block.mark == "block" and block.name.endswith(".py"):
                (work / block.name).write_text(self.own(block.text))

    def own(self, text: str) -> str:
        """``text`` with the page's directories and ports replaced by the run's."""
        text = text.replace(_PAGE_DIRECTORY_PREFIX, self.prefix)
        for port, free in self.ports.items():
            text = text.replace(port, free)
        return text

    def command(self, block: Block) -> list[str]:
        assert block.language in _RUNNABLE, block
        if block.language == "python":
            return [sys.executable, "-c", self.own(block.text)]
        return ["bash", "-euo", "pipefail", "-c", self.own(block.text)]

    def start_drivers(self, names: tuple[str, ...]) -> None:
        """Run the blocks ``names`` (drivers, which run until stopped) until each serves;
        they start side by side, as a reader's terminals would."""
        started = []
        for name in names:
            log = self.work / f"{name}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(self.command(_block(self.path, name)),
                                           cwd=self.work, env=self.env,
                                           stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            self.drivers.append((process, log))
            started.append((name, process, log))
        deadline = time.monotonic() + 60
        for name, process, log in started:
            while "running in" not in log.read_text(errors="replace"):
                assert process.poll() is None and time.monotonic() < deadline, \
                    f"{self.path}: block {name!r} did not start a driver:\n{log.read_text()}"
                time.sleep(0.05)

    def check(self, name: str, text: str | None = None, timeout: float = 60) -> None:
        """Run the block ``name`` (or ``text`` in its place) to its end, and compare what it
        printed with the page's output of it."""
        block = _block(self.path, name)
        if text is not None:
            block = Block(block.path, block.line, block.language, text, block.mark, block.name)
        # A session of its own: what a shell block started in the background goes with it.
        process = subprocess.Popen(self.command(block), cwd=self.work, env=self.env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            ended = f"exited {process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            ended = f"did not end in {timeout} s"
        expected = _block(self.path, name, "output").text
        assert (process.returncode, stdout) == (0, expected), (
            f"{self.path}:{block.line}: block {name!r} {ended} and printed\n{stdout}\n"
            f"instead of\n{expected}\nstderr:\n{stderr[-4000:]}")

    def close(self) -> None:
        for process, _log in reversed(self.drivers):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # a reader's Ctrl-C: the driver drains
        for process, log in self.drivers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise AssertionError(f"a driver did not stop:\n{log.read_text()}") from None
        for leftover in Path("/dev/shm").glob(f"{Path(self.prefix).name}*"):
            shutil.rmtree(leftover, ignore_errors=True)


@pytest.fixture
def page_run(tmp_path: Path) -> Iterator[Callable[[str], _PageRun]]:
    runs: list[_PageRun] = []

    def start(path: str) -> _PageRun:
        runs.append(_PageRun(path, tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def _run(page_run: Callable[[str], _PageRun], name: str, timeout: float = 60) -> _PageRun:
    path, drivers, checked = PAGE_RUNS[name]
    run = page_run(path)
    run.start_drivers(drivers)
    for block in checked:
        run.check(block, timeout=timeout)
    return run


@pytest.mark.sockets
@pytest.mark.parametrize("name", [name for name in PAGE_RUNS if name != "spark"])
def test_the_pages_blocks_print_what_the_pages_say(page_run, name: str) -> None:
    run = _run(page_run, name)
    if name == "first-program":
        # A change to the program that changes what it prints fails the comparison.
        changed = _block("README.md", "first-program").text.replace('b"hello"', 'b"hullo"')
        with pytest.raises(AssertionError, match="hullo"):
            run.check("first-program", changed)


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_the_tutorials_spark_program_prints_what_it_says(page_run) -> None:
    if importlib.util.find_spec("pyspark") is None:
        lacking("pyspark is not installed (make install installs it)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        lacking("no Java for Spark (make java)")
    _run(page_run, "spark", timeout=500)
