"""The settings framework: a table of settings, and every layer a setting is read from.

A table is an attrs class whose fields are made by :func:`setting` (or its shorthands
:func:`size`, :func:`duration`, :func:`integer`, :func:`boolean`, :func:`choice`, :func:`text`,
:func:`path`, :func:`text_list`, :func:`port_table`): each field carries a :class:`Setting`,
its kind, default, accepted range and one-line doc.  :class:`SettingsTable` derives the rest
from the class: parsing of TOML/environment/command-line values, the range checks and their
messages, ``--print-config`` output and the shipped TOML file of every key at its default.
The driver's settings (:mod:`slipstream.daemon.config`) and the archive's
(:mod:`slipstream.archive.settings`) are two such tables.

Units: sizes are bytes, durations are nanoseconds, both as ``int``.  Strings from any source may
carry units (``"64k"``, ``"200ms"``), parsed by :mod:`slipstream.client.units`.

Precedence: built-in defaults < TOML file < environment (``<PREFIX><KEY_UPPER>``) < command
line / keyword overrides.  A bad value raises :class:`~slipstream.client.errors.ConfigurationError`
(or the table's subclass of it) naming the key and the accepted range.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib.resources
import logging
import os
import re
import textwrap
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import attrs

from slipstream.client.errors import ConfigurationError
from slipstream.client.units import format_duration_ns, format_size, parse_duration_ns, parse_size

#: Where a value came from, lowest precedence first.
SOURCES = ("default", "file", "env", "cli")

_META = "slipstream.setting"
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

log = logging.getLogger("slipstream.config")


class Kind(enum.Enum):
    """How a setting's value is written and parsed."""

    SIZE = "size"  # bytes; "64k", "16m", or an int
    DURATION = "duration"  # nanoseconds; "200ms", "5s", or an int
    INT = "int"  # a plain count or id
    BOOL = "bool"  # true/false, 1/0, yes/no, on/off
    CHOICE = "choice"  # one of ``choices`` (case-insensitive); a member of ``enum`` if given
    TEXT = "text"  # free text, checked by ``check``
    PATH = "path"  # a file system path, as a Path
    LIST = "list"  # a TOML array of strings, or text separated by commas; items by ``convert``
    TABLE = "table"  # a TOML table of names to integers, or text NAME=N separated by commas


@attrs.frozen
class Setting:
    """Everything known about one key except its name (the field's name): a row of the table.

    ``optional`` keys accept ``None`` (or ``""`` from text sources) meaning "unset".
    ``check`` returns a problem description for a bad value, or None.
    ``convert`` turns one item of a LIST from its text into its native value (ValueError
    naming the problem otherwise); ``enum`` is the Enum a CHOICE's value is a member of.
    ``accepted_text`` words the accepted values where the kind's own words do not.
    ``section`` starts a new group (a comment header in the shipped file) at this key.
    """

    kind: Kind
    default: Any
    doc: str
    low: int | None = None
    high: int | None = None
    multiple_of: int | None = None
    power_of_two: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    accepted_text: str = ""
    check: Callable[[Any], str | None] | None = None
    section: str | None = None
    convert: Callable[[str], Any] | None = None
    enum: type[enum.Enum] | None = None

    def accepted(self) -> str:
        """The accepted values in words, as used by error messages and the shipped file."""
        if self.accepted_text:
            return self.accepted_text
        if self.kind is Kind.BOOL:
            text = "true or false"
        elif self.kind is Kind.CHOICE:
            text = "one of " + "|".join(self.choices)
        elif self.kind in (Kind.TEXT, Kind.PATH):
            text = "a path" if self.kind is Kind.PATH else "text"
        elif self.kind is Kind.LIST:
            text = "a list of strings"
        elif self.kind is Kind.TABLE:
            text = "a table of names to integers"
        else:
            text = f"in {self.show(self.low)}..{self.show(self.high)}"
            if self.power_of_two:
                text = f"a power of 2 {text}"
            elif self.multiple_of:
                text = f"a multiple of {self.multiple_of} {text}"
            else:
                text = f"{_NOUN[self.kind]} {text}"
        if self.optional:
            text += ', or "" for unset'
        return text

    def show(self, value: Any) -> str:
        """A value spelled with its unit, for messages (``65536`` → ``64k``)."""
        if isinstance(value, bool) or value is None:
            return repr(value)
        if self.kind is Kind.SIZE and isinstance(value, int) and value >= 0:
            return format_size(value)
        if self.kind is Kind.DURATION and isinstance(value, int) and value >= 0:
            return format_duration_ns(value)
        if isinstance(value, enum.Enum):
            return str(value.value)
        return str(value)

    def parse(self, key: str, value: Any) -> Any:
        """A value from any source (native, or text with units) → the native value, unchecked."""
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if self.optional and (value is None or value == ""):
            return None
        try:
            return self._parse(value)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(key, f"{exc}; expected {self.accepted()}") from None

    def _parse(self, value: Any) -> Any:
        kind = self.kind
        if kind is Kind.BOOL:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError(f"{value!r} is not a boolean")
        if kind is Kind.CHOICE and self.enum is not None and isinstance(value, self.enum):
            return value
        if kind is Kind.LIST:
            return self._parse_list(value)
        if kind is Kind.TABLE:
            return self._parse_table(value)
        if kind in (Kind.CHOICE, Kind.TEXT, Kind.PATH):
            if not isinstance(value, str):
                raise TypeError(f"{value!r} is not a string")
            if kind is Kind.PATH:
                if not value:
                    raise ValueError("'' is not a path")
                return Path(value)
            if kind is Kind.TEXT:
                return value
            choice = value.strip().lower()
            return self.enum(choice) if self.enum is not None and choice in self.choices \
                else choice
        # Numbers: a float would silently truncate (0.5 of what?), so only ints and text.
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"{value!r} is not a {kind.value}")
        if kind is Kind.SIZE:
            return parse_size(value)
        if kind is Kind.DURATION:
            return parse_duration_ns(value)
        try:
            return int(value)  # int("1_000") works too
        except ValueError:
            raise ValueError(f"{value!r} is not an integer") from None

    def _parse_list(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, str):
            items = [item.strip() for item in value.split(",")] if value.strip() else []
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            raise TypeError(f"{value!r} is not a list")
        convert = self.convert or str
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(convert(item))
            elif isinstance(item, int | float | list | dict) or self.convert is None:
                raise TypeError(f"{item!r} is not a string")
            else:
                out.append(item)  # an item made already (a keyword argument's)
        return tuple(out)

    @staticmethod
    def _parse_table(value: Any) -> dict[str, int]:
        if isinstance(value, str):
            value = dict(entry.partition("=")[::2] for entry in value.split(",")
                         if entry.strip())
            value = {name.strip(): number.strip() for name, number in value.items()}
        if not isinstance(value, Mapping):
            raise TypeError(f"{value!r} is not a table of names to integers")
        out = {}
        for name, number in value.items():
            if isinstance(number, bool) or not isinstance(number, int | str):
                raise TypeError(f"{name} = {number!r} is not an integer")
            try:
                out[str(name)] = int(number)
            except ValueError:
                raise ValueError(f"{name} = {number!r} is not an integer") from None
        return out

    def validate(self, key: str, value: Any) -> None:
        """Raise ConfigurationError unless the native ``value`` is in this setting's range."""
        if value is None and self.optional:
            return
        problem: str | None = None
        if self.kind in (Kind.SIZE, Kind.DURATION, Kind.INT):
            assert self.low is not None and self.high is not None
            ok = self.low <= value <= self.high
            if self.power_of_two:
                ok = ok and value & (value - 1) == 0
            if self.multiple_of:
                ok = ok and value % self.multiple_of == 0
            if not ok:
                problem = f"{self.show(value)} is not {self.accepted()}"
        elif self.kind is Kind.CHOICE and self.show(value) not in self.choices:
            problem = f"{value!r} is not {self.accepted()}"
        if problem is None and self.check is not None:
            detail = self.check(value)
            if detail is not None:
                shown = repr(value) if self.kind in (Kind.TEXT, Kind.PATH) else \
                    "" if self.kind in (Kind.LIST, Kind.TABLE) else self.show(value)
                problem = f"{shown} {detail}".lstrip() + f"; expected {self.accepted()}"
        if problem is not None:
            raise ConfigurationError(key, problem)

    def toml(self, value: Any) -> str:
        """``value`` as a TOML literal that :meth:`parse` turns back into ``value``."""
        if value is None:
            return '""'
        if self.kind is Kind.BOOL:
            return "true" if value else "false"
        if self.kind is Kind.INT:
            return str(value)
        if self.kind is Kind.SIZE:
            text = format_size(value)
            return text if text.isdigit() else toml_string(text)
        if self.kind is Kind.DURATION:
            return toml_string(format_duration_ns(value))
        if self.kind is Kind.LIST:
            return "[" + ", ".join(toml_string(str(item)) for item in value) + "]"
        if self.kind is Kind.TABLE:
            entries = [f"{toml_key(name)} = {number}" for name, number in value.items()]
            return "{ " + ", ".join(entries) + " }" if entries else "{}"
        return toml_string(self.show(value))


_NOUN = {Kind.SIZE: "a size", Kind.DURATION: "a duration", Kind.INT: "an integer"}


def toml_string(text: str) -> str:
    """A TOML basic string; control characters escaped as TOML requires."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_key(name: str) -> str:
    """``name`` as a TOML key: bare where TOML allows, quoted otherwise."""
    return name if _BARE_KEY.fullmatch(name) else toml_string(name)


def checked_by(parse: Callable[[str], Any]) -> Callable[[str], str | None]:
    """A TEXT setting's ``check`` from a parser: the problem ``parse`` raises as ValueError,
    or None when it takes the value; "" (unset) passes."""
    def check(value: str) -> str | None:
        if value == "":
            return None
        try:
            parse(value)
        except ValueError as e:
            return str(e)
        return None
    return check


def _convert(value: Any, field: attrs.Attribute) -> Any:
    return field.metadata[_META].parse(field.name, value)


def _validate(_instance: Any, field: attrs.Attribute, value: Any) -> None:
    field.metadata[_META].validate(field.name, value)


def setting(kind: Kind, default: Any, doc: str, *, within: tuple[int, int] | None = None,
            **row: Any) -> Any:
    """One row of a table: an attrs field whose metadata holds the :class:`Setting`.
    ``within`` is ``(low, high)`` in one, as the channel grammar's ranges are defined."""
    if within is not None:
        row["low"], row["high"] = within
    spec = Setting(kind, default, doc, **row)
    return attrs.field(
        default=default,
        converter=attrs.Converter(_convert, takes_field=True),
        validator=_validate,
        metadata={_META: spec},
    )


def size(default: int, doc: str, **row: Any) -> Any:
    """A size in bytes."""
    return setting(Kind.SIZE, default, doc, **row)


def duration(default: int, doc: str, low: int = 0, high: int = 3600 * 10**9, **row: Any) -> Any:
    """A duration in nanoseconds (by default at most an hour)."""
    if "within" not in row:
        row["low"], row["high"] = low, high
    return setting(Kind.DURATION, default, doc, **row)


def integer(default: int | None, doc: str, **row: Any) -> Any:
    """A plain integer: a count, an id, a port."""
    return setting(Kind.INT, default, doc, **row)


def boolean(default: bool, doc: str, **row: Any) -> Any:
    """true or false."""
    return setting(Kind.BOOL, default, doc, **row)


def choice(default: Any, choices: tuple[str, ...] | type[enum.Enum], doc: str, **row: Any
           ) -> Any:
    """One of ``choices``: names, or an Enum whose members the values are."""
    if isinstance(choices, type):
        return setting(Kind.CHOICE, default, doc, choices=tuple(m.value for m in choices),
                       enum=choices, **row)
    return setting(Kind.CHOICE, default, doc, choices=choices, **row)


def text(default: str | None, doc: str, **row: Any) -> Any:
    """Free text, checked by ``check``."""
    return setting(Kind.TEXT, default, doc, **row)


def path(default: Path | None, doc: str, **row: Any) -> Any:
    """A file system path (a Path)."""
    return setting(Kind.PATH, default, doc, **row)


def text_list(doc: str, convert: Callable[[str], Any], **row: Any) -> Any:
    """A list, empty by default, of items each written as text and made by ``convert``."""
    return setting(Kind.LIST, (), doc, convert=convert, **row)


def port_table(doc: str, **row: Any) -> Any:
    """A table of names to integers, empty by default."""
    return setting(Kind.TABLE, MappingProxyType({}), doc, **row)


def freeze_sources(sources: Mapping[str, str] | None) -> Mapping[str, str]:
    """The converter of a table's ``sources`` field: where each value came from."""
    return MappingProxyType(dict(sources or {}))


def sources_field() -> Any:
    """A table's ``sources`` field: where each value came from (default/file/env/cli), for
    ``--print-config``; not part of equality."""
    return attrs.field(factory=dict, converter=freeze_sources, eq=False, repr=False)


def _assignment(assignment: str) -> tuple[str, str]:
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {assignment!r}")
    # --set mtu-length=4k reads as naturally as mtu_length on a command line.
    return key.strip().lower().replace("-", "_"), value.strip()


T = TypeVar("T")


class SettingsTable(Generic[T]):
    """The layers of one table of settings: file, environment, command line, and the texts.

    ``cls`` is the attrs class whose fields are the rows; it has a ``sources`` field
    (:func:`sources_field`) and a ``from_mapping(values, *, sources)`` class method that
    builds it from ``{key: value}`` (native, or text with units) and raises on an unknown key.
    ``name`` is what the settings are of (``"driver"``), ``env_prefix`` the environment's
    prefix (``"SLIPSTREAM_"``), ``shipped`` the shipped file's name in the
    ``slipstream.config`` package (``"driver.toml"``).  ``tables`` names the TOML tables a
    file may hold besides the flat keys (``[[record]]``), which ``from_mapping`` reads.
    """

    def __init__(self, cls: type[T], *, name: str, env_prefix: str, shipped: str,
                 tables: Sequence[str] = ()) -> None:
        self.cls = cls
        self.name = name
        self.env_prefix = env_prefix
        self.shipped = shipped
        self.tables = tuple(tables)
        self.settings: Mapping[str, Setting] = MappingProxyType(
            {f.name: f.metadata[_META] for f in attrs.fields(cls)  # type: ignore[arg-type]
             if _META in f.metadata})

    # ------------------------------------------------------------------------ one key

    def require_known(self, key: str) -> None:
        """A ConfigurationError naming ``key`` unless it is a setting (or a table) here, with
        the closest key as a hint."""
        if key in self.settings or key in self.tables:
            return
        names = [*self.settings, *self.tables]
        close = difflib.get_close_matches(key, names, n=1)
        if not close:  # "directory" → "dir": difflib misses short names that are contained
            close = [name for name in names if name in key or key in name][:1]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(key, f"unknown setting{hint} (all keys: config/{self.shipped})")

    def _require_setting(self, key: str) -> None:
        if key in self.tables:
            raise ConfigurationError(key, f"is a table ([[{key}]]): it is set in a file only")
        self.require_known(key)

    def check_setting(self, key: str, value: Any) -> Any:
        """One setting alone, as a tool's ``--set KEY=VALUE`` gives it: its native value, or
        a ConfigurationError naming the key when it is unknown or the value out of its range.
        The rules across settings need all of them: they are checked when the table is
        built."""
        self._require_setting(key)
        spec = self.settings[key]
        native = spec.parse(key, value)
        spec.validate(key, native)
        return native

    def to_dict(self, settings: T) -> dict[str, Any]:
        """``{key: native value}`` for every setting; ``from_mapping`` inverts it."""
        return {name: getattr(settings, name) for name in self.settings}

    # ------------------------------------------------------------------------ the layers

    def _file_values(self, path: Path) -> dict[str, Any]:
        try:
            with path.open("rb") as f:
                values = tomllib.load(f)
        except OSError as exc:
            raise ConfigurationError("config", f"cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:  # TOMLDecodeError, or bytes that are not UTF-8
            line = re.search(r"line (\d+)", str(exc))
            where = f"{path}:{line[1]}" if line else str(path)
            raise ConfigurationError("config", f"{where}: not valid TOML: {exc}") from None
        for key, value in values.items():
            if isinstance(value, dict) and (
                    key not in self.settings or self.settings[key].kind is not Kind.TABLE):
                raise ConfigurationError(
                    key, f"in {path}: keys are flat, tables like [{key}] are not used"
                )
            self.require_known(key)
        return values

    def _env_values(self, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
        """The settings among ``<prefix>*`` variables, as ``{key: (variable, text)}``.

        Other variables of the prefix may belong to other tools and are passed over, except
        one spelt so close to a setting that it can only be a misspelling of it: that raises
        ConfigurationError naming the variable and the setting (a service that ran on with
        the default instead would hide the mistake).
        """
        found = {}
        for name, value in env.items():
            if not name.startswith(self.env_prefix):
                continue
            key = name[len(self.env_prefix):].lower()
            if key in self.settings:
                found[key] = (name, value)
                continue
            close = difflib.get_close_matches(key, self.settings, n=1, cutoff=0.85)
            if close:
                raise ConfigurationError(
                    name, f"is not a setting; did you mean {self.env_prefix}"
                    f"{close[0].upper()}? (all keys: config/{self.shipped})")
        return found

    def _meant(self, key: str, written: Any, winning: Any) -> bool:
        """Whether a file's value for ``key`` that another layer outranks was meant: it is not
        the default (the shipped file sets every key to it) nor the value that wins."""
        spec = self.settings[key]
        try:
            value = spec.parse(key, written)
            return value != spec.default and value != spec.parse(key, winning)
        except (ConfigurationError, ValueError, TypeError):
            return True  # the bad value is refused below, naming its key

    def load(self, config_file: str | Path | None = None, env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> T:
        """Defaults < ``config_file`` (TOML) < ``env`` (default ``os.environ``) < overrides.

        Raises ConfigurationError naming the key, the accepted range and where the bad value
        came from; unknown keys in the file or overrides suggest the closest valid key.
        """
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        origins: dict[str, str] = {}
        if config_file is not None:
            path = Path(config_file)
            for key, value in self._file_values(path).items():
                values[key], sources[key], origins[key] = value, "file", f"in {path}"
        in_file = {key: value for key, value in values.items() if key in self.settings}
        for key, (name, value) in self._env_values(os.environ if env is None else env).items():
            values[key], sources[key], origins[key] = value, "env", f"from ${name}"
        for key, value in (overrides or {}).items():
            self._require_setting(key)
            values[key], sources[key], origins[key] = value, "cli", "by override"
        for key, written in in_file.items():
            if sources[key] != "file" and self._meant(key, written, values[key]):
                # The file's line is dead: say so, since someone changed it to count.
                log.warning("%s in %s is not used: it is set %s, which outranks the file", key,
                            config_file, origins[key])
        try:
            return self.cls.from_mapping(values, sources=sources)  # type: ignore[attr-defined]
        except ConfigurationError as exc:
            # Say where the offending values came from: the key itself, and for a rule across
            # keys the other key the message names.
            notes = [
                f"set {origin}" if key == exc.key else f"{key} set {origin}"
                for key, origin in origins.items()
                if key == exc.key or re.search(rf"\b{key}\b", exc.problem)
            ]
            if not notes:
                raise
            raise type(exc)(exc.key, f"{exc.problem} ({'; '.join(notes)})") from None

    # ------------------------------------------------------------------------ the texts

    def sections(self) -> Iterator[tuple[str, list[str]]]:
        """(title, keys) of each section, in the table's order."""
        title, keys = "", list[str]()
        for name, spec in self.settings.items():
            if spec.section is not None:
                if keys:
                    yield title, keys
                title, keys = spec.section, []
            keys.append(name)
        yield title, keys

    def format(self, settings: T, notes: Mapping[str, str] | None = None) -> str:
        """The resolved settings as loadable TOML, one ``key = value  # source`` line each.

        Values carry units (``status_message_timeout = "200ms"``); the comment is default,
        file, env or cli, then ``notes[key]`` if any.  Loading the text as a config file gives
        settings equal to ``settings``.
        """
        lines = [f"# slipstream {self.name} settings, resolved; the comment says where each "
                 f"came from"]
        for title, keys in self.sections():
            lines += ["", f"# --- {title}"]
            for key in keys:
                spec, value = self.settings[key], getattr(settings, key)
                note = settings.sources.get(key, "default")  # type: ignore[attr-defined]
                if notes and key in notes:
                    note += f" ({notes[key]})"
                lines.append(f"{key} = {spec.toml(value)}  # {note}")
        return "\n".join(lines) + "\n"

    def render_default(self, header: Sequence[str], footer: str = "") -> str:
        """The text of the shipped file: ``header`` (comment lines), then every key at its
        default with its doc and range above it, then ``footer``."""
        lines = list(header)
        for title, keys in self.sections():
            if title:
                lines += ["", "# " + "=" * 78, f"# {title}", "# " + "=" * 78]
            for key in keys:
                spec = self.settings[key]
                lines.append("")
                lines += textwrap.wrap(
                    spec.doc, width=98, initial_indent="# ", subsequent_indent="# "
                )
                lines.append(f"# Accepts {spec.accepted()}.")
                lines.append(f"{key} = {spec.toml(spec.default)}")
        rendered = "\n".join(lines) + "\n"
        return rendered + ("\n" + footer if footer else "")

    def shipped_text(self) -> str:
        """The shipped file in the ``slipstream.config`` package."""
        return importlib.resources.files("slipstream.config").joinpath(self.shipped).read_text()

    # ------------------------------------------------------------------------ the command line

    def add_arguments(self, parser: argparse.ArgumentParser, *, set_example: str,
                      dir_help: str | None = None) -> None:
        """Add ``--config FILE``, ``--dir DIR`` (when ``dir_help`` is given), ``--set
        KEY=VALUE`` (repeatable) and ``--print-config``.

        Destinations: ``config_file`` (Path | None), ``dir``, ``set_values``, ``print_config``.
        """
        prefix = self.env_prefix + "<KEY>"
        group = parser.add_argument_group(
            "configuration",
            f"defaults < --config file < {prefix} environment < "
            + ("--dir / --set" if dir_help else "--set"),
        )
        group.add_argument(
            "--config", dest="config_file", metavar="FILE", type=Path, default=None,
            help=f"TOML file of settings (see config/{self.shipped} for every key)",
        )
        if dir_help:
            group.add_argument("--dir", dest="dir", metavar="DIR", default=None, help=dir_help)
        group.add_argument(
            "--set", dest="set_values", metavar="KEY=VALUE", type=_assignment, action="append",
            default=[], help=f"override one setting, e.g. --set {set_example} (repeatable)",
        )
        group.add_argument(
            "--print-config", dest="print_config", action="store_true",
            help="print the resolved settings and where each came from, then exit",
        )

    @staticmethod
    def overrides_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
        """The command-line overrides in ``namespace``: every ``--set``, then ``--dir``
        (wins)."""
        overrides: dict[str, Any] = dict(getattr(namespace, "set_values", None) or [])
        if getattr(namespace, "dir", None) is not None:
            overrides["dir"] = namespace.dir
        return overrides

    def load_from_args(self, namespace: argparse.Namespace,
                       env: Mapping[str, str] | None = None) -> T:
        """:meth:`load` with the file and overrides given by :meth:`add_arguments` flags."""
        return self.load(getattr(namespace, "config_file", None), env,
                         self.overrides_from_args(namespace))
