"""Every relative link and image in the tracked Markdown files resolves in a clone.

A link's target (without its ``#anchor``) must be a file or a directory that git tracks, and be
in the work tree: a file that is only on this disk (ignored, or never added) is not in a clone,
and an exists() check alone would pass it.  An anchor into a Markdown file must name one of its
headings, slugged as GitHub does.  Absolute URLs (``http:``, ``https:``, ``mailto:``, ...) are
not checked; code blocks and code spans are not links.
"""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

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
