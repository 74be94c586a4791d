"""Who runs each per-stream rule, the C half or the Python half: the one
table (:mod:`slipstream.daemon.streams.ownership`), the one function per stream type that sets
the flags (``sync_c_half``), and the C predicates the Python half asks instead of copying.

* the table is what docs/ARCHITECTURE.md shows, and each flag of it is set by its stream's one
  function and nowhere else;
* the Python half's answers (``PublicationImage._rebuilt_in_c``, ``_sends_sm_in_c``, ``due``)
  equal what the C duty cycle does (``ss_agent_c_deadline``, ``ss_agent_python_due``) across
  the flags and what only the C half sees (hypothesis), and across an image's states and
  events; an image with no loss detector, where the Python copy had drifted, gets C's answer;
* an event within a publication's pass sets the rules the table sets at once, and no other
  (the C control path may read the rest before the pass ends).
"""

from __future__ import annotations

import ast
import random
import re
import socket
import uuid
from pathlib import Path

import pytest
from helpers import network_publication
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client._native import ffi
from slipstream.client.channel import parse_channel
from slipstream.client.frames import Data, ErrorFrame, Setup, StatusMessage, heartbeat
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.events import ImageRequested
from slipstream.daemon.media.receive_channel import ReceiveChannel
from slipstream.daemon.protocol.types import LocalCounters
from slipstream.daemon.streams import ownership
from slipstream.daemon.streams.image import ImagePositions, ImageState, PublicationImage
from slipstream.daemon.streams.publication import NetworkPublication

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
TERM = 64 * 1024
SRC = ("10.0.0.1", 5555)
DEST = ("10.0.0.2", 40123)
UNICAST = "aeron:udp?endpoint=10.0.0.2:40123"
#: Receive channels whose images the C half may rebuild (the first) or may not (the rest).
IMAGE_URIS = (UNICAST, f"{UNICAST}|reliable=false", f"{UNICAST}|cc=cubic",
              f"{UNICAST}|group=true")


# -- the table --------------------------------------------------------------------------------
def test_the_architecture_page_shows_the_table() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "## Who runs each rule: the C half and the Python half" in text
    assert ownership.markdown() in text, "paste ownership.markdown() into docs/ARCHITECTURE.md"


def _flag_assignments(path: Path, flags: frozenset[str]) -> list[tuple[str, str, str, int]]:
    """(class, function, flag, line) of every assignment to an attribute named in ``flags``."""
    found = []

    def visit(node: ast.AST, cls: str, function: str) -> None:
        if isinstance(node, ast.ClassDef):
            cls, function = node.name, ""
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and target.attr in flags:
                found.append((cls, function, target.attr, target.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, cls, function)

    visit(ast.parse(path.read_text(), str(path)), "", "")
    return found


def test_each_flag_is_set_by_its_streams_one_function_and_nowhere_else() -> None:
    """h11's rule for the two halves: what decides who runs a rule lives in one place per
    stream type, which its transitions call."""
    one_function = {
        ROOT / "daemon" / "streams" / "publication.py": (
            "NetworkPublication", ownership.flags_set_by_sync(ownership.PUBLICATION)),
        ROOT / "daemon" / "streams" / "image.py": (
            "PublicationImage", ownership.flags_set_by_sync(ownership.IMAGE)),
    }
    every_flag = frozenset().union(*(flags for _, flags in one_function.values()))
    elsewhere = []
    for path in sorted([*(ROOT / "daemon").rglob("*.py"), *(ROOT / "sim").rglob("*.py")]):
        cls, flags = one_function.get(path, ("", frozenset()))
        set_here = set()
        for where_cls, function, flag, line in _flag_assignments(path, every_flag):
            if (where_cls, function) == (cls, "sync_c_half") and flag in flags:
                set_here.add(flag)
            else:
                elsewhere.append(f"{path.relative_to(ROOT)}:{line} {where_cls}.{function} "
                                 f"sets {flag}")
        assert set_here == flags, f"{path.name}: sync_c_half sets {set_here}, the table {flags}"
    assert not elsewhere, "set these in the stream's sync_c_half:\n" + "\n".join(elsewhere)


def test_the_c_predicates_of_the_table_are_exported_and_the_image_asks_them() -> None:
    header = (ROOT / "daemon" / "network.h").read_text()
    image_source = (ROOT / "daemon" / "streams" / "image.py").read_text()
    predicates = {rule.c_predicate for rule in ownership.RULES if rule.c_predicate}
    assert predicates == {"ss_image_rebuilt_in_c", "ss_image_sends_status_messages",
                          "ss_image_python_due_position", "ss_image_catch_up_due"}
    for name in predicates:
        assert hasattr(network, name)
        assert re.search(rf" {name}\(const ss_image_t \*image(, int64_t now_ns)?\);", header)
        assert f"network.{name}(" in image_source
    assert "eos_position < 0" not in image_source  # no copy of a C predicate left


def test_every_rule_names_a_flag_of_its_streams_c_struct() -> None:
    structs = {ownership.PUBLICATION: network_ffi.new("ss_send_publication_t *"),
               ownership.IMAGE: network_ffi.new("ss_image_t *")}
    for rule in ownership.RULES:
        assert hasattr(structs[rule.stream], rule.flag), rule
        assert rule.default in (ownership.PYTHON, ownership.C)


#: What each rule written once left behind in the Python half: text of the copy it had, which
#: must not come back (the rule's one copy is its C function).
REMOVED_PYTHON_COPIES = {
    "ss_publication_limit_step": ("publication.py",
                                  "self._last_publisher_limit + self._trip_gain:"),
    "ss_image_track_rebuild": ("image.py", "self.loss_detector.scan("),
    "ss_publication_heartbeat": ("publication.py", "heartbeat(self.session_id"),
    "ss_image_clean": ("image.py", "self.cleaner.clean_toward("),
    "ss_image_status_message_due": ("image.py", "sm_window >> 2"),
    "ss_image_allowed_window": ("image.py", "self.cleaner.reusable_limit() - position"),
    "ss_image_liveness_deadline": ("image.py", "time_of_last_packet_ns + self.liveness"),
    "ss_publication_status_message": ("publication.py", "sm.receiver_window > self.term_length"),
    "ss_publication_receiver_deadline": ("publication.py", "+ self.connection_timeout_ns"),
}


def _c_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in (ROOT / "daemon").glob("network*.c")}


def test_a_rule_written_once_is_one_c_function_that_both_halves_run() -> None:
    """Every rule is written once: its function is the data path's (daemon/network_*.c,
    which its duty cycle runs, with sockets or the simulator's virtual sends), exported, and
    where the Python half runs the rule by default it calls the same function: one copy of
    the rule, whichever half runs it."""
    header = (ROOT / "daemon" / "network.h").read_text()
    python = "\n".join(path.read_text() for path in sorted(
        [*(ROOT / "daemon").rglob("*.py"), *(ROOT / "sim").rglob("*.py")]))
    sources = _c_sources()
    assert [rule.rule for rule in ownership.RULES if not rule.written_once] == []
    for rule in ownership.RULES:
        name = rule.written_once
        assert any(re.search(rf"^\w+ \**{name}\(", text, re.M)
                   for text in sources.values()), f"{name}: not defined in daemon/network_*.c"
        assert hasattr(network, name) and re.search(rf"\b{name}\(", header), name
        if rule.default == ownership.PYTHON:
            assert f"network.{name}(" in python, f"{name}: the Python half does not run it"
    for name, (module, copy) in REMOVED_PYTHON_COPIES.items():
        assert hasattr(network, name), name
        source = (ROOT / "daemon" / "streams" / module).read_text()
        assert copy not in source, f"{module} has a copy of {name} again"


# -- an image ---------------------------------------------------------------------------------
def _setup(flags: int = 0) -> bytes:
    return Setup(0, 1, 2, 100, 100, TERM, 1408, 0, flags).encode()


def _data(offset: int, length: int = 32) -> bytes:
    return Data(offset, 1, 2, 100, b"x" * length).encode()


def make_image(shm: Path, uri: str = UNICAST, subscribers: int = 1, now_ns: int = 0):
    """An image of a receive channel (the conductor's part played here) with ``subscribers``
    subscriber cells at its join position."""
    rc = ReceiveChannel(channel=parse_channel(uri), settings=DriverSettings(),
                        receiver_id=7, counters=LocalCounters(), now_ns=now_ns,
                        rng=random.Random(1))
    rc.add_subscription(2)
    rc.on_datagram(_setup(), SRC, now_ns)
    [event] = rc.poll_events()
    assert isinstance(event, ImageRequested)
    setup = event.setup
    log = LogBuffer.create(shm / f"{uuid.uuid4().hex}.log", term_length=setup.term_length,
                           initial_term_id=setup.initial_term_id, session_id=setup.session_id,
                           stream_id=setup.stream_id, mtu=setup.mtu, correlation_id=1)
    image = rc.new_image(event, log, ImagePositions.in_process(), now_ns)
    cells = [ffi.new("int64_t *", image.join_position) for _ in range(subscribers)]
    for cell in cells:
        image.add_subscriber_position(cell)
    rc.add_image(image)
    return rc, image, cells


def _c_deadline(c, **fields: int) -> int:
    """``ss_agent_c_deadline`` of an agent whose one image is a copy of ``c`` with ``fields``
    set: the timers the C duty cycle keeps for it."""
    copy = network_ffi.new("ss_image_t *")
    network_ffi.memmove(copy, c, network_ffi.sizeof("ss_image_t"))
    for name, value in fields.items():
        setattr(copy, name, value)
    agent = network_ffi.new("ss_agent_t *")
    images = network_ffi.new("ss_image_t *[]", [copy])
    agent.images = images
    agent.image_count = 1
    return network.ss_agent_c_deadline(agent)


#: Timers out of the way: the image's liveness, its SM and gap timers (times in ns).
_QUIET = {"time_of_last_packet_ns": 1 << 61, "sm_deadline_ns": NO_DEADLINE,
          "loss_deadline_ns": NO_DEADLINE, "sm_unsent": 0}


def loop_rebuilds(c) -> bool:
    """Whether the C duty cycle keeps the image's gap timers: it runs its rebuild pass."""
    return _c_deadline(c, **{**_QUIET, "loss_deadline_ns": 100}) == 100


def loop_sends_status_messages(c) -> bool:
    """Whether the C duty cycle keeps the image's SM timer: it sends its SMs."""
    return _c_deadline(c, **{**_QUIET, "sm_deadline_ns": 200}) == 200


def loop_keeps_liveness(c) -> bool:
    return _c_deadline(c, **{**_QUIET, "time_of_last_packet_ns": 300,
                             "liveness_timeout_ns": 1}) == 301


def loop_finds_python_due(c, now_ns: int) -> bool:
    """Whether the C duty cycle's rule makes the image's Python half due at ``now_ns``."""
    agent = network_ffi.new("ss_agent_t *")
    images = network_ffi.new("ss_image_t *[]", [c])
    agent.images = images
    agent.image_count = 1
    agent.python_deadline_ns = NO_DEADLINE
    return bool(network.ss_agent_python_due(agent, now_ns) & network.SS_DUE_IMAGE)


def old_python_rebuilt_in_c(c) -> bool:
    """image.py's copy of the C half's rule before the ownership table, which had drifted
    from it."""
    return bool(c.rebuild_in_c and not c.python_on_data and c.eos_position < 0
                and c.subscriber_count > 0)


def assert_python_answers_as_the_c_half(image: PublicationImage) -> None:
    c = image.c
    assert image._rebuilt_in_c() is loop_rebuilds(c)
    assert image._sends_sm_in_c() is loop_sends_status_messages(c) is loop_keeps_liveness(c)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rebuild_in_c=st.booleans(), sm_in_c=st.booleans(), python_on_data=st.booleans(),
       eos=st.sampled_from([-1, 0, 4096]), subscribers=st.integers(0, 2),
       has_loss=st.booleans(), has_cleaner=st.booleans(),
       sm_due=st.integers(0, 8192), clean_due=st.sampled_from([0, 1024, 4096, NO_DEADLINE]),
       positions=st.lists(st.integers(0, 8192), min_size=2, max_size=2))
def test_the_python_half_answers_as_the_c_duty_cycle_across_flags_and_what_c_sees(
        shm: Path, rebuild_in_c: bool, sm_in_c: bool, python_on_data: bool, eos: int,
        subscribers: int, has_loss: bool, has_cleaner: bool, sm_due: int, clean_due: int,
        positions: list[int]) -> None:
    """Whatever the flags say and whatever only the C half sees (a loss detector, a cleaner,
    subscribers, an EOS heartbeat), the Python half's rebuild and SM rules and its
    subscriber-position rule of ``due`` are those of the C duty cycle."""
    rc, image, cells = make_image(shm, subscribers=subscribers)
    rc.on_datagram(_data(0, 8192), SRC, 1)  # a hwm for the subscribers to be below
    c = image.c
    for cell, position in zip(cells, positions, strict=False):
        cell[0] = position
    c.rebuild_in_c, c.sm_in_c, c.python_on_data = rebuild_in_c, sm_in_c, python_on_data
    c.eos_position = eos
    if not has_loss:
        c.loss = network_ffi.NULL
    if not has_cleaner:
        c.cleaner = network_ffi.NULL
    c.sm_due_position, c.clean_due_position = sm_due, clean_due
    assert_python_answers_as_the_c_half(image)
    # due(): nothing else pending, so only the subscribers' positions decide, in both halves.
    c.dirty = c.nak_count = c.sm_unsent = 0
    c.time_of_last_packet_ns = 1  # its liveness is not up either
    image._next_due_ns = NO_DEADLINE
    assert image.due(2) is loop_finds_python_due(c, 2)


def test_an_image_without_a_loss_detector_gets_the_c_halfs_answer(shm: Path) -> None:
    """The drift: the C half rebuilds only an image with a loss detector (``loss != NULL``),
    which image.py's copy of its rule left out.  It answered that the C half ran the rebuild
    pass, where the duty cycle did not; asked, C says no, as its duty cycle does."""
    _, image, _ = make_image(shm)
    c = image.c
    c.loss = network_ffi.NULL
    assert c.rebuild_in_c and old_python_rebuilt_in_c(c)  # the copy said C rebuilds
    assert image._rebuilt_in_c() is False is loop_rebuilds(c)


def _expected_flags(image: PublicationImage) -> tuple[bool, bool, bool]:
    """(rebuild_in_c, sm_in_c, python_on_data) as the table's image rows say."""
    eligible = (image.reliable and not image.is_group and image.congestion_control.is_static
                and image.left_behind is None)
    return (eligible and image.state in (ImageState.INIT, ImageState.ACTIVE,
                                         ImageState.DRAINING),
            eligible and image.state is ImageState.ACTIVE,
            not image.congestion_control.is_static or image.subscriber_count == 0)


_EVENTS = st.sampled_from(["subscribe", "unsubscribe", "data", "gap", "eos", "left_behind",
                           "pass", "timeout", "leave"])


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(uri=st.sampled_from(IMAGE_URIS), subscribers=st.integers(0, 2),
       events=st.lists(_EVENTS, max_size=12))
def test_the_image_flags_follow_every_event_and_the_python_half_answers_as_c(
        shm: Path, uri: str, subscribers: int, events: list[str]) -> None:
    """Through any run of events (subscribers come and go, data in order and past a gap, an
    EOS heartbeat, left behind, passes, liveness timeouts, the receiver leaving), the flags
    are the table's for the image's state at once, and the Python half's rules equal the C
    duty cycle's."""
    rc, image, cells = make_image(shm, uri, subscribers)
    now = 0
    hwm = 0
    for event in events:
        now += MS
        if event == "subscribe":
            cell = ffi.new("int64_t *", image.rcv_pos)
            cells.append(cell)
            image.add_subscriber_position(cell)
        elif event == "unsubscribe" and cells:
            image.remove_subscriber_position(cells.pop())
        elif event == "data":
            rc.on_datagram(_data(hwm), SRC, now)
            hwm += 32
        elif event == "gap":
            rc.on_datagram(_data(hwm + 64), SRC, now)
            hwm += 96
        elif event == "eos":
            rc.on_datagram(heartbeat(1, 2, 100, hwm, eos=True), SRC, now)
        elif event == "left_behind":
            image.c.overrun_position = image.rcv_pos + TERM
            image.datagrams_to_send(now, [])
        elif event == "pass":
            image.datagrams_to_send(now, [])
        elif event == "timeout":
            now += image.liveness_timeout_ns
            image.datagrams_to_send(now, [])
        elif event == "leave":
            image.leave(now)
        c = image.c
        assert (bool(c.rebuild_in_c), bool(c.sm_in_c), bool(c.python_on_data)) == (
            _expected_flags(image)), (event, image)
        assert_python_answers_as_the_c_half(image)


def test_a_rebuilt_image_that_goes_draining_hands_its_status_messages_back_at_once(
        shm: Path) -> None:
    """The hand-back at a transition: the last subscriber gone, the image drains, and its
    (EOS-flagged) SMs are the Python half's from that moment, its rebuild pass no longer
    C's (no subscriber)."""
    _rc, image, [cell] = make_image(shm)
    assert image._sends_sm_in_c() and image._rebuilt_in_c()
    image.remove_subscriber_position(cell)
    assert image.state is ImageState.DRAINING
    assert not image._sends_sm_in_c() and not image._rebuilt_in_c()
    assert image.c.rebuild_in_c and not image.c.sm_in_c and image.c.python_on_data


# -- a publication ----------------------------------------------------------------------------
def make_publication(shm: Path, uri: str = UNICAST) -> NetworkPublication:
    return network_publication(shm, uri, DEST, term_length=TERM)


def _publication_fields(pub: NetworkPublication) -> dict[str, int]:
    c = pub.c
    names = (*ownership.flags_set_by_sync(ownership.PUBLICATION), "python_send_position",
             "sm_receiver_id")
    return {name: getattr(c, name) for name in names}


AT_ONCE = frozenset(rule.flag for rule in ownership.rules_of(ownership.PUBLICATION)
                    if rule.at_once)


@pytest.mark.parametrize("event", ["close", "stop_credit", "refuse_offers", "rejected"])
def test_an_event_within_a_pass_sets_the_rules_set_at_once_and_no_other(
        shm: Path, event: str) -> None:
    """pub-lmt's rule goes back to the Python half at the event (a pass that fails after it
    must not leave the C half raising pub-lmt); the SMs and heartbeats at the end of the
    pass, as before the one function, since the C control path may read them before it."""
    assert AT_ONCE == {"limit_in_c"}
    pub = make_publication(shm, f"{UNICAST}|priority=-500")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        pub.c.fd = sock.fileno()  # as the send channel's socket
        pub.on_frame(StatusMessage(5, 6, 10, 0, 32 * 1024, 99, 0), DEST, 0)
        pub.datagrams_to_send(1)
        pub.sync_c_half()  # the end of the pass
        before = _publication_fields(pub)
        assert pub.c.limit_in_c and pub.c.sm_in_c and pub.c.heartbeat_in_c
        if event == "close":
            pub.close(2)
        elif event == "stop_credit":
            pub.stop_credit()
        elif event == "refuse_offers":
            pub.apply_pressure_step(4)
        else:
            # The receiver's ERR counts once its grace passed with no SM of it (§5.7): the
            # pass that finds it so is the event.
            pub.on_frame(ErrorFrame(5, 6, 99, 1, "no"), DEST, 2)
            assert pub.is_connected
            pub.datagrams_to_send(2 + 2 * DriverSettings().status_message_timeout)
            assert not pub.is_connected
        after = _publication_fields(pub)
        changed = {name for name in before if before[name] != after[name]}
        assert changed == {"limit_in_c"}
        pub.sync_c_half()  # the end of the pass: the rest follows
        assert not pub.c.limit_in_c
        if event in ("close", "rejected"):
            assert not pub.c.sm_in_c
        pub.c.fd = -1
