"""The table of the driver's settings in docs/DEFAULTS.md, made from the settings table.

Each row is one key of ``slipstream.daemon.config.SETTINGS``, in its order, with its default
as the driver prints it (``16m``, ``200ms``; ``unset`` for no value).  The third column says
whether the default is Aeron's and where a rule is described; it is written by hand and kept
by key, so a new setting's row comes with an empty note that its author fills in.

``python scripts/settings_doc.py`` rewrites the table in place; tests/test_docs.py checks
that the page holds what it would write and that no note is empty.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from slipstream.daemon.config import SETTINGS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "DEFAULTS.md"
BEGIN = ("<!-- The rows below are made by scripts/settings_doc.py from daemon/config.py: "
         "edit the third column only. -->")
END = "<!-- End of the rows made by scripts/settings_doc.py. -->"
_HEADER = ["| setting | default | |", "|---|---|---|"]
_ROW = re.compile(r"^\| `(?P<key>[a-z0-9_]+)` \| [^|]* \| (?P<note>.*?) ?\|$")


def default_text(default: Any, show: Any) -> str:
    """A default as the page shows it: ``unset`` for none, booleans lowercase, the rest with
    their unit as ``Setting.show`` spells them."""
    if default is None or default == "":
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(show(default))


def notes(page: str) -> dict[str, str]:
    """The hand-written third column of the table in ``page``, by key."""
    return {m.group("key"): m.group("note").strip()
            for m in map(_ROW.match, _region(page)[1].split("\n")) if m}


def rows(kept: dict[str, str]) -> list[str]:
    """The table: every setting with its default and the note ``kept`` holds for it."""
    return _HEADER + [
        f"| `{key}` | `{default_text(spec.default, spec.show)}` | {kept.get(key, '')} |"
        for key, spec in SETTINGS.items()]


def render(page: str) -> str:
    """``page`` with its table made again from the settings, the notes kept."""
    before, _, after = _region(page)
    return before + BEGIN + "\n\n" + "\n".join(rows(notes(page))) + "\n\n" + END + after


def _region(page: str) -> tuple[str, str, str]:
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no table between {BEGIN!r} and {END!r}")
    return page[:start], page[start + len(BEGIN):end], page[end + len(END):]


def main() -> int:
    text = PAGE.read_text(encoding="utf-8")
    made = render(text)
    if made != text:
        PAGE.write_text(made, encoding="utf-8")
        print(f"{PAGE}: table made again")
    empty = [key for key, note in notes(made).items() if not note]
    if empty:
        print(f"{PAGE}: write the note of {', '.join(empty)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
