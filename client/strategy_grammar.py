"""The URI grammar of the driver's strategies: ``fc=NAME[,key:value...]`` (flow control),
``cc=`` (congestion control) and ``rc=`` (send-rate control).

Each strategy's URI value is declared once, as a :class:`StrategyGrammar`: its name (and older
names), what it means, and its options, each an :class:`Option` (key, value type with its
units and range, default, meaning).  :func:`parse_strategy` parses and checks a value against
the grammars in the table, so the client refuses a bad value before it reaches a driver
(:func:`~slipstream.client.channel.parse_channel` names the key), and the canonical spelling
of a value is its grammar's.

The grammars of the shipped strategies are declared at the bottom of this module (the client
imports nothing of the driver, and must know them to check a URI).  The strategy classes in
``daemon/flow/`` carry their grammar (``uri = strategy_grammar.MIN``), and registering a class
with the driver's registry registers a grammar declared elsewhere (a test's or a plugin's
strategy) in this table too, for this process.

Units: durations in ns, sizes in bytes.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final, Self

import attrs

from slipstream.client.layout import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    RATE_ANNOUNCE_MAX_THRESHOLDS,
    RATE_WINDOW_MAX_US,
    RATE_WINDOW_MIN_US,
)
from slipstream.client.units import parse_duration_ns, parse_size

#: The URI keys that name a strategy.
KEYS: Final = ("fc", "cc", "rc")

_INTEGER = re.compile(r"[+-]?[0-9]+\Z")


class BadValue(ValueError):
    """A value is invalid; ``parse_channel`` turns it into a ChannelError naming the key."""


# -- the values a URI's keys and options share (raise BadValue with the problem) ---------------


def parse_int(text: str, low: int, high: int) -> int:
    if not _INTEGER.match(text):
        raise BadValue(f"{text!r} is not an integer")
    value = int(text)
    if not low <= value <= high:
        raise BadValue(f"{value} is out of range {low}..{high}")
    return value


def parse_size_in(text: str, low: int = 1, high: int = INT32_MAX) -> int:
    try:
        value = parse_size(text)
    except ValueError as e:
        raise BadValue(str(e)) from None
    if not low <= value <= high:
        raise BadValue(f"{value} is out of range {low}..{high} bytes")
    return value


def parse_duration_in(text: str, low: int = 0, high: int | None = None) -> int:
    try:
        value = parse_duration_ns(text)
    except ValueError as e:
        raise BadValue(str(e)) from None
    if high is not None and not low <= value <= high:
        raise BadValue(f"{format_ns(value)} is out of range {format_ns(low)}..{format_ns(high)}")
    return value


def format_ns(ns: int) -> str:
    """The largest exact unit among s, ms, us and ns: the ones Aeron's duration parser takes."""
    for unit, scale in (("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000)):
        if ns and ns % scale == 0:
            return f"{ns // scale}{unit}"
    return f"{ns}ns"


def split_options(options: list[str], forms: Mapping[str, str]) -> dict[str, str]:
    """A value's ``kind:value`` options (``fc=min,g:/3,t:5s``), each kind of ``forms`` (its
    spelling, for the error) at most once: kind -> value, in the URI's order."""
    values: dict[str, str] = {}
    for option in options:
        kind, colon, value = option.partition(":")
        if not colon or kind not in forms or not value:
            raise BadValue(f"option {option!r} is not {' or '.join(forms.values())}")
        if kind in values:
            raise BadValue(f"option {kind}: given twice")
        values[kind] = value
    return values


def _alternatives(names: Iterable[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    names = list(names)
    if len(names) < 2:
        return names[0] if names else "any registered strategy (none is)"
    return f"{', '.join(names[:-1])} or {names[-1]}"


# -- value types: what an option's value is, its units and range -------------------------------


class ValueType(abc.ABC):
    """The type of an option's value: how it is spelled (``form``, for errors), its units,
    and how it parses (BadValue naming the problem) and prints (canonically)."""

    form: ClassVar[str]
    #: What its values count (a class attribute, or a field of the type).
    units = ""
    #: The fields one value fills (the group option fills a tag and a size).
    arity: ClassVar[int] = 1

    @abc.abstractmethod
    def parse(self, text: str, key: str, strategy: str) -> Any:
        """The value of ``key:text`` in ``strategy``'s URI value."""

    def format(self, value: Any) -> str:
        return str(value)


@attrs.frozen
class Integer(ValueType):
    low: int
    high: int
    units: str = ""
    form: ClassVar[str] = "<integer>"

    def parse(self, text: str, key: str, strategy: str) -> int:
        return parse_int(text, self.low, self.high)


@attrs.frozen
class Size(ValueType):
    low: int
    high: int
    form: ClassVar[str] = "<size>"
    units = "bytes"  # a class attribute (not annotated: no field)

    def parse(self, text: str, key: str, strategy: str) -> int:
        return parse_size_in(text, self.low, self.high)


@attrs.frozen
class Duration(ValueType):
    """A duration within ``low..high`` ns; ``refusal`` spells the error of one outside
    (``{key}``, ``{text}``, ``{low}``, ``{high}``)."""

    low: int
    high: int
    refusal: str = "{key}:{text} is out of range {low}..{high}"
    form: ClassVar[str] = "<duration>"
    units = "ns"  # a class attribute (not annotated: no field)

    def parse(self, text: str, key: str, strategy: str) -> int:
        value = parse_duration_in(text)
        if not self.low <= value <= self.high:
            raise BadValue(self.refusal.format(key=key, text=text, low=format_ns(self.low),
                                               high=format_ns(self.high)))
        return value

    def format(self, value: Any) -> str:
        return format_ns(value)


@attrs.frozen
class Percentages(ValueType):
    """1 to ``max_count`` ascending percentages, ``a/b/...``."""

    max_count: int
    form: ClassVar[str] = "<percent>/..."
    units = "percent"  # a class attribute (not annotated: no field)

    def parse(self, text: str, key: str, strategy: str) -> tuple[int, ...]:
        values = tuple(parse_int(t, 1, 100) for t in text.split("/"))
        if len(values) > self.max_count or list(values) != sorted(set(values)):
            raise BadValue(f"{key} {text} are not 1 to {self.max_count} ascending percentages")
        return values

    def format(self, value: Any) -> str:
        return "/".join(map(str, value))


@attrs.frozen
class ReceiverGroup(ValueType):
    """``TAG[/N]`` or ``/N``: a receiver group tag (int64) and the receivers required before
    the sender moves; (tag, size), each None when left out.  Without ``tag`` only ``/N``."""

    tag: bool = True
    form: ClassVar[str] = "<tag>[/<min group size>]"
    arity: ClassVar[int] = 2

    def parse(self, text: str, key: str, strategy: str) -> tuple[int | None, int | None]:
        tag_text, slash, size_text = text.partition("/")
        tag = size = None
        if tag_text:
            if not self.tag:
                raise BadValue(f"{strategy} takes a group size only ({key}:/N); use tagged for "
                               f"a group tag")
            tag = parse_int(tag_text, INT64_MIN, INT64_MAX)
        if slash:
            size = parse_int(size_text, 0, INT32_MAX)
        elif not self.tag:
            raise BadValue(f"{strategy} takes a group size only ({key}:/N)")
        return tag, size

    def format(self, value: Any) -> str:
        tag, size = value
        return ("" if tag is None else str(tag)) + ("" if size is None else f"/{size}")


# -- a strategy's grammar -------------------------------------------------------------------------


def _as_fields(fields: str | tuple[str, ...]) -> tuple[str, ...]:
    return (fields,) if isinstance(fields, str) else tuple(fields)


@attrs.frozen
class Option:
    """One ``key:value`` option of a strategy's URI value.

    ``fields`` are the names its value goes by in the parsed spec and the driver's parameters
    (one, or one per part of a type that fills several); ``default`` is the value when the URI
    leaves it out (a tuple for several fields), None for "the driver's" (its setting, for the
    fields the strategy's interface carries: daemon/protocol/params.py)."""

    key: str
    type: ValueType
    meaning: str
    fields: tuple[str, ...] = attrs.field(converter=_as_fields)
    default: Any = None
    #: How an error spells its value (the type's form unless given).
    form: str | None = None

    @property
    def spelling(self) -> str:
        return f"{self.key}:{self.form or self.type.form}"

    def __attrs_post_init__(self) -> None:
        if len(self.fields) != self.type.arity:
            raise ValueError(f"option {self.key}: {type(self.type).__name__} fills "
                             f"{self.type.arity} field(s), not {self.fields}")


#: Names a spec keeps for itself: an option's field may not be one.
_RESERVED = frozenset({"name", "values", "key", "get", "grammar"})


def _options(options: Iterable[Option]) -> tuple[Option, ...]:
    return tuple(options)


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@attrs.frozen
class StrategyGrammar:
    """A strategy's URI value: ``NAME[,key:value...]`` under the URI key ``key`` (``fc``,
    ``cc`` or ``rc``), also taken under its ``aliases``."""

    key: str
    name: str
    meaning: str
    options: tuple[Option, ...] = attrs.field(default=(), converter=_options)
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_names)

    def __attrs_post_init__(self) -> None:
        if self.key not in KEYS:
            raise ValueError(f"{self.key!r} is not a strategy's URI key ({', '.join(KEYS)})")
        for name in (self.name, *self.aliases):
            if not name or any(c in name for c in ",|:="):
                raise ValueError(f"{name!r} cannot be a {self.key}= name")
        keys = [option.key for option in self.options]
        fields = self.fields()
        if len(set(keys)) != len(keys) or len(set(fields)) != len(fields):
            raise ValueError(f"{self.name}: an option key or field twice in {keys} {fields}")
        clashing = [f for f in fields if f in _RESERVED or f.startswith("_") or hasattr(str, f)]
        if clashing:
            raise ValueError(f"{self.name}: options may not be called {clashing}")

    def fields(self) -> tuple[str, ...]:
        """Every field its options fill, in their order."""
        return tuple(field for option in self.options for field in option.fields)

    def defaults(self) -> dict[str, Any]:
        """field -> its value when the URI leaves it out (None: the driver's)."""
        defaults: dict[str, Any] = {}
        for option in self.options:
            parts = (option.default,) if len(option.fields) == 1 else (
                option.default or (None,) * len(option.fields))
            defaults.update(zip(option.fields, parts, strict=True))
        return defaults

    def parse(self, options: list[str]) -> dict[str, Any]:
        """The values of ``options`` (``["g:/3", "t:5s"]``) by field; BadValue names the
        problem."""
        if options and not self.options:
            raise BadValue(f"{self.name} takes no options")
        by_key = {option.key: option for option in self.options}
        values: dict[str, Any] = {}
        given = split_options(options, {o.key: o.spelling for o in self.options})
        for key, text in given.items():
            option = by_key[key]
            value = option.type.parse(text, key, self.name)
            values.update(zip(option.fields, value if len(option.fields) > 1 else (value,),
                              strict=True))
        return values

    def spell(self, values: Mapping[str, Any]) -> str:
        """The canonical value: the name, then each option given in declaration order."""
        parts = [self.name]
        for option in self.options:
            given = tuple(values.get(field) for field in option.fields)
            if any(value is not None for value in given):
                parts.append(f"{option.key}:"
                             f"{option.type.format(given if len(given) > 1 else given[0])}")
        return ",".join(parts)


# -- parsed values ------------------------------------------------------------------------------


class StrategySpec(str):
    """A strategy's URI value, parsed.  It is a str, its canonical spelling, so specs are equal
    when they mean the same (``t:5s`` and ``t:5000000000``), print as the URI writes them, and
    ``channel.cc == "cubic"`` holds.  ``name`` is the strategy's name (an alias resolved),
    ``values`` the options given by field; ``spec.<field>`` is an option's value, None when
    left out.

    Built directly, the values after the name are its grammar's fields in order, or by field:
    ``FlowControlSpec("min", None, 3)``, ``FlowControlSpec("min", group_min_size=3)``."""

    key: ClassVar[str]
    name: str
    values: Mapping[str, Any]

    def __new__(cls, name: str, /, *positional: Any, **named: Any) -> Self:
        grammar = grammar_of(cls.key, name)
        fields = grammar.fields() if grammar is not None else ()
        if len(positional) > len(fields):
            raise TypeError(f"{cls.key}={name} has {len(fields)} option fields {fields}, "
                            f"not {len(positional)}")
        values = dict(zip(fields, positional, strict=False))  # the first ones
        for field, value in named.items():
            if field not in fields or field in values:
                raise TypeError(f"{cls.key}={name}: {field!r} is not one of {fields} or is "
                                f"given twice")
            values[field] = value
        given = {field: values[field] for field in fields if values.get(field) is not None}
        text = grammar.spell(given) if grammar is not None else name
        return cls._make(text, name if grammar is None else grammar.name, given, fields)

    @classmethod
    def _make(cls, text: str, name: str, values: Mapping[str, Any],
              fields: Iterable[str]) -> Self:
        spec = str.__new__(cls, text)
        spec.__dict__.update(name=name, values=MappingProxyType(dict(values)),
                             _fields=frozenset(fields))
        return spec

    def get(self, field: str, default: Any = None) -> Any:
        """The value of option field ``field``, ``default`` when not given."""
        return self.values.get(field, default)

    def __getattr__(self, attribute: str) -> Any:
        if attribute in self.__dict__.get("_fields", ()):
            return self.__dict__["values"].get(attribute)
        raise AttributeError(f"{type(self).__name__} {str(self)!r} has no option field "
                             f"{attribute!r}")

    def __setattr__(self, attribute: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_remake, (type(self), str(self), self.name, dict(self.values),
                          tuple(self.__dict__["_fields"])))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


def _remake(cls: type[StrategySpec], text: str, name: str, values: dict[str, Any],
            fields: tuple[str, ...]) -> StrategySpec:
    return cls._make(text, name, values, fields)


class FlowControlSpec(StrategySpec):
    """The ``fc`` parameter: ``max``, ``unicast``, ``min[,g:/N][,t:T]`` or
    ``tagged[,g:TAG[/N]][,t:T]`` (or a registered strategy's).  ``group_tag`` (int64),
    ``group_min_size`` (receivers required before the sender moves) and
    ``receiver_timeout_ns`` (how long a silent receiver still counts) are None when not
    given: the driver's settings.  A tagged spec without a tag uses the default group tag."""

    key = "fc"


class CongestionControlSpec(StrategySpec):
    """The ``cc`` parameter: ``static`` or ``cubic`` (or a registered strategy's)."""

    key = "cc"


class RateControlSpec(StrategySpec):
    """The ``rc`` parameter: ``nak-strength[,thresholds:50/75/87/100][,window:50ms]``, the
    send-rate adaptation of docs/FLOW.md.  ``thresholds`` (percent of a receiver's window,
    ascending, at most four) and ``window_ns`` (how long the sender takes the strongest signal
    as one) are None when not given: the driver's defaults."""

    key = "rc"


SPECS: Final[dict[str, type[StrategySpec]]] = {
    cls.key: cls for cls in (FlowControlSpec, CongestionControlSpec, RateControlSpec)}


# -- the table ----------------------------------------------------------------------------------

_GRAMMARS: Final[dict[str, dict[str, StrategyGrammar]]] = {key: {} for key in KEYS}
_ALIASES: Final[dict[str, dict[str, str]]] = {key: {} for key in KEYS}


def grammars(key: str) -> Mapping[str, StrategyGrammar]:
    """The grammars ``key=`` takes now, by name (a live view)."""
    return MappingProxyType(_GRAMMARS[key])


def grammar_of(key: str, name: str) -> StrategyGrammar | None:
    """The grammar of ``key=name`` (an alias too), None for a name not registered."""
    table = _GRAMMARS[key]
    return table.get(_ALIASES[key].get(name, name))


def register(grammar: StrategyGrammar) -> bool:
    """Take ``grammar``'s values under ``grammar.key``; False if it is there already.  A
    name or alias another grammar has is a ValueError."""
    table, aliases = _GRAMMARS[grammar.key], _ALIASES[grammar.key]
    if table.get(grammar.name) is grammar:
        return False
    for name in (grammar.name, *grammar.aliases):
        if name in table or name in aliases:
            raise ValueError(f"{grammar.key}={name} is taken by another strategy")
    table[grammar.name] = grammar
    aliases.update(dict.fromkeys(grammar.aliases, grammar.name))
    return True


def unregister(grammar: StrategyGrammar) -> None:
    """Stop taking ``grammar``'s values (nothing if it is not registered)."""
    table, aliases = _GRAMMARS[grammar.key], _ALIASES[grammar.key]
    if table.get(grammar.name) is grammar:
        del table[grammar.name]
        for alias in grammar.aliases:
            aliases.pop(alias, None)


def parse_strategy(key: str, text: str) -> StrategySpec:
    """A ``key=`` value (``"min,g:/3,t:5s"``) parsed against the registered grammars;
    BadValue names the problem (the caller adds the key)."""
    name, *options = text.split(",")
    grammar = grammar_of(key, name)
    if grammar is None:
        raise BadValue(f"{name!r} is not {_alternatives(_GRAMMARS[key])}")
    values = grammar.parse(options)
    return SPECS[key]._make(grammar.spell(values), grammar.name, values, grammar.fields())


# -- the shipped strategies (daemon/flow/: one module each) ------------------------------------

#: How long min / tagged flow control may wait for a silent receiver before it forgets it,
#: ns (the URI's fc=...,t: and the setting flow_control_receiver_timeout): 0 would forget
#: every receiver at once (min turned into max).
RECEIVER_TIMEOUT_RANGE_NS: Final = (1_000_000, 3_600_000_000_000)
#: NAK strength's thresholds (percent of a receiver's window) and window when rc= leaves them
#: out (docs/FLOW.md).
NAK_STRENGTH_THRESHOLDS: Final = (50, 75, 87, 100)
NAK_STRENGTH_WINDOW_NS: Final = 50_000_000

_RECEIVER_TIMEOUT = Option(
    "t", Duration(*RECEIVER_TIMEOUT_RANGE_NS,
                  refusal="{key}:{text} is not a receiver timeout in {low}..{high}"),
    "how long a silent receiver still counts (else the setting flow_control_receiver_timeout)",
    fields="receiver_timeout_ns", form="<timeout>")


def _group(tag: bool) -> Option:
    return Option("g", ReceiverGroup(tag=tag),
                  ("the receivers' group tag (else flow_control_group_tag) and " if tag else "")
                  + "how many receivers are required before the sender moves (else "
                    "flow_control_group_min_size)",
                  fields=("group_tag", "group_min_size"))


MAX: Final = StrategyGrammar(
    "fc", "max", "the fastest receiver sets the pace (multicast's default)")
MIN: Final = StrategyGrammar(
    "fc", "min", "the slowest live receiver sets the pace",
    options=(_group(tag=False), _RECEIVER_TIMEOUT))
TAGGED: Final = StrategyGrammar(
    "fc", "tagged", "the slowest live receiver of a tagged group sets the pace",
    options=(_group(tag=True), _RECEIVER_TIMEOUT),
    aliases=("preferred",))  # Aeron's older name (PreferredMulticastFlowControl)
UNICAST: Final = StrategyGrammar(
    "fc", "unicast", "one receiver sets the pace (unicast's default)")
STATIC: Final = StrategyGrammar(
    "cc", "static", "a fixed receiver window: rcv-wnd, at most half a term (the default)")
CUBIC: Final = StrategyGrammar(
    "cc", "cubic", "CUBIC's window, cut on loss (its settings: cubic_*)")
NAK_STRENGTH: Final = StrategyGrammar(
    "rc", "nak-strength", "the send rate adapts to how full the receivers say they are",
    options=(
        Option("thresholds", Percentages(RATE_ANNOUNCE_MAX_THRESHOLDS),
               "the fills a receiver signals at, percent of its window, ascending",
               fields="thresholds", default=NAK_STRENGTH_THRESHOLDS),
        Option("window", Duration(RATE_WINDOW_MIN_US * 1000, RATE_WINDOW_MAX_US * 1000,
                                  refusal="{key} {text} is not between {low} and {high}"),
               "how long the sender takes the strongest signal as one",
               fields="window_ns", default=NAK_STRENGTH_WINDOW_NS)))

#: The shipped strategies' grammars, in the order errors list their names.
SHIPPED: Final = (MAX, MIN, TAGGED, UNICAST, STATIC, CUBIC, NAK_STRENGTH)
for _grammar in SHIPPED:
    register(_grammar)
