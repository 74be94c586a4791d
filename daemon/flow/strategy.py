"""What every strategy declares on its class, and the tables the registry keeps of them.

A strategy (flow control, congestion control, send-rate control) declares:

* ``uri``: its URI grammar, a :class:`~slipstream.client.strategy_grammar.StrategyGrammar`
  (its name under ``fc=``, ``cc=`` or ``rc=``, and its options: key, value type with units and
  range, default, meaning), from which the client's URI grammar parses and checks its values.
  The class's ``name`` is the grammar's.  The shipped strategies' grammars are declared in the
  client (which must check a URI without the driver); another strategy declares its own;
* ``counters``: the counters it keeps (:class:`StrategyCounter`: label, Prometheus name and
  type, how to read the value from the strategy), which the conductor allocates, the stream
  publishes and the metrics exporter serves.  Congestion control's are per image (Aeron's
  PerImageIndicator); flow and rate control have their interface's only (``fc-receivers``
  under ``tracks_receivers``, ``snd-rate``), so the registry refuses counters of theirs;
* whether the C data path may run it (flow control: ``c_fast_path``; congestion control:
  ``is_static``, a fixed window the C half advertises; rate control's limit is always C's).

A strategy module registers its class at its bottom (``register_flow_control(...)``,
``register_congestion_control(...)``, ``register_rate_control(...)``, from the interface's
module), and :mod:`slipstream.daemon.flow` imports every shipped module: nothing else names a
strategy.  Registering also registers a grammar the client does not have yet (for this
process).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal, TypeVar

import attrs

from slipstream.client import strategy_grammar
from slipstream.client.strategy_grammar import StrategyGrammar


@attrs.frozen
class StrategyCounter:
    """One counter a strategy keeps: ``label`` names it in the counters file (the label's
    kind, as Aeron's ``rcv-cc-cubic-rtt``), ``metric`` and ``help`` its Prometheus family,
    of ``type`` gauge (a value now) or counter (a count), whose value is the counter's times
    ``scale`` (1e-9: ns to seconds); ``read`` gives its value now from the strategy."""

    label: str
    metric: str
    help: str
    read: Callable[[Any], int]
    type: Literal["gauge", "counter"] = "gauge"
    scale: float = 1


class Strategy(abc.ABC):
    """The declarations every strategy interface shares (see the module docstring)."""

    #: The URI key of the interface's strategies: ``fc``, ``cc`` or ``rc``.
    uri_key: ClassVar[str]
    #: Whether its strategies' counters are published (per image: congestion control).
    publishes_counters: ClassVar[bool] = False
    #: Its URI grammar: name and options.
    uri: ClassVar[StrategyGrammar]
    #: Its URI name, the grammar's.
    name: ClassVar[str]
    #: The counters it keeps, in the order of :meth:`counter_values`.
    counters: ClassVar[tuple[StrategyCounter, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        uri = cls.__dict__.get("uri")
        if uri is not None:
            if "name" in cls.__dict__ and cls.__dict__["name"] != uri.name:
                raise TypeError(f"{cls.__name__}: name {cls.__dict__['name']!r} is not its "
                                f"grammar's {uri.name!r} (declare uri only)")
            cls.name = uri.name

    def counter_values(self) -> tuple[int, ...]:
        """The values of :attr:`counters` now."""
        return tuple(counter.read(self) for counter in self.counters)


#: The registered strategies, by URI key and name.
_TABLES: Final[dict[str, dict[str, type[Any]]]] = {key: {} for key in strategy_grammar.KEYS}
#: The grammars registering a class added to the client's table (to remove with it).
_ADDED_GRAMMARS: Final[set[StrategyGrammar]] = set()


def table(key: str) -> dict[str, type[Any]]:
    """The strategies registered under ``key`` (``fc``, ``cc``, ``rc``), by name: the live
    dict the registry reads."""
    return _TABLES[key]


def register(cls: type[Any], interface: type[Strategy]) -> None:
    """Register ``cls``, an implementation of ``interface``, under its URI name.  TypeError
    for a class that is not one, ValueError for a name, counter label or metric another
    strategy has, or counters its interface does not publish."""
    if not (isinstance(cls, type) and issubclass(cls, interface)) or inspect.isabstract(cls):
        raise TypeError(f"{cls!r} is not a concrete {interface.__name__}")
    uri = getattr(cls, "uri", None)
    if not isinstance(uri, StrategyGrammar) or uri.key != interface.uri_key:
        raise TypeError(f"{cls.__name__} declares no {interface.uri_key}= grammar (uri)")
    registered = _TABLES[uri.key]
    if registered.get(uri.name, cls) is not cls:
        raise ValueError(f"{uri.key}={uri.name} is {registered[uri.name].__name__}'s already")
    if cls.counters and not interface.publishes_counters:
        raise ValueError(f"{cls.__name__}: a {interface.__name__} keeps its interface's "
                         f"counters only; nothing would publish "
                         f"{[c.label for c in cls.counters]}")
    taken = {(c.label, c.metric): other for other in registered.values() if other is not cls
             for c in other.counters}
    for counter in cls.counters:
        for (label, metric), other in taken.items():
            if counter.label == label or counter.metric == metric:
                raise ValueError(f"{cls.__name__}: counter {counter.label} ({counter.metric}) "
                                 f"is {other.__name__}'s already")
    if strategy_grammar.register(uri):
        _ADDED_GRAMMARS.add(uri)
    registered[uri.name] = cls


StrategyClass = TypeVar("StrategyClass", bound=type[Any])


def registrar(interface: type[Strategy]) -> Callable[[StrategyClass], StrategyClass]:
    """The function a strategy module calls at its bottom to register its class, an
    implementation of ``interface``, under its ``fc=``, ``cc=`` or ``rc=`` name
    (:func:`register`); it returns the class."""
    def register_strategy(cls: StrategyClass) -> StrategyClass:
        register(cls, interface)
        return cls

    register_strategy.__doc__ = (f"Take ``{interface.uri_key}=`` values of ``cls``'s grammar "
                                 f"for ``cls``, a {interface.__name__}; returns ``cls``.")
    return register_strategy


def unregister(cls: type[Any]) -> None:
    """Forget ``cls`` (registered by :func:`register`), and the grammar its registration added
    to the client's table."""
    uri = cls.uri
    if _TABLES[uri.key].get(uri.name) is cls:
        del _TABLES[uri.key][uri.name]
        if uri in _ADDED_GRAMMARS:
            _ADDED_GRAMMARS.discard(uri)
            strategy_grammar.unregister(uri)
