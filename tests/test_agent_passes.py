"""Which streams a pass of the network agents' Python half visits: a governor step costs no
pass over the streams, and a pass due for one stream, or for adding one, visits that stream's
endpoint alone, at a few streams as at many.

The streams are real: one publication's log per session, each sent over the test's link
(tests/test_protocol_pair.py's :class:`Pair`) to the receiver agent, which makes an image of
each and keeps them connected; or UDP streams on loopback between two embedded drivers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from helpers import free_port
from hypothesis import given
from hypothesis import strategies as st
from test_embedded import embedded, run_until  # noqa: F401 (embedded: a fixture)
from test_protocol_pair import RECEIVER, SESSION, STREAM, Pair

from slipstream.client import Client
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.agents.agent import MemberArray
from slipstream.daemon.agents.commands import SetPressureStep
from slipstream.daemon.agents.receiver import DUE_MEMBERS, Receiver
from slipstream.daemon.agents.sender import DUE_MEMBERS_OR_TIMERS, Sender
from slipstream.daemon.embedded import EmbeddedDriver
from slipstream.daemon.flow.registry import flow_control_for
from slipstream.daemon.pressure.governor import COALESCE_NS, STATUS_INTERVAL_FACTOR
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.streams.publication import NetworkPublication, SenderPositions

SECOND = 1_000_000_000
SS_DUE_COMMANDS = network.SS_DUE_COMMANDS


def _connected_pair(directory: Path, streams: int) -> Pair:
    """A pair whose sender agent carries ``streams`` sessions of one stream, all connected."""
    pair = Pair(directory)
    endpoint = pair.sender.endpoints[0]
    term_length = pair.log.term_length
    params = PublicationParams.for_network(
        attrs.evolve(pair.channel, term_length=term_length), pair.settings)
    for k in range(1, streams):
        log = LogBuffer.create(directory / f"pub-{k}.log", term_length=term_length,
                               initial_term_id=1000, session_id=SESSION + k, stream_id=STREAM,
                               mtu=pair.channel.mtu or 1408, correlation_id=10 + k)
        pair.sender.add_publication(endpoint, NetworkPublication(
            log=log, params=params, settings=pair.settings,
            positions=SenderPositions.in_process(), flow_control=flow_control_for(params),
            counters=pair.pub_counters, now_ns=pair.now, destination=RECEIVER))
    pair.run_until(SECOND)
    assert len(pair.receive.images) == streams
    assert all(p.is_connected for p in pair.sender.publications)
    return pair


def _recorded_passes(agent: Sender | Receiver) -> list[tuple[int, bool, int]]:
    """From now on each Python pass of ``agent`` is recorded as (the SS_DUE_* bits it was due
    for, whether commands were queued, the streams it visited)."""
    passes: list[tuple[int, bool, int]] = []
    do_python_work = agent.do_python_work

    def recorded(now_ns: int) -> int:
        due, commands = agent.c.due, agent.has_commands
        work = do_python_work(now_ns)
        passes.append((due, commands, agent.streams_visited))
        return work

    agent.do_python_work = recorded  # type: ignore[method-assign]
    return passes


def _assert_each_visits_at_most_one(passes: list[tuple[int, bool, int]], reasons: int) -> None:
    """Of the recorded ``passes``, those due for ``reasons`` alone (SS_DUE_* bits) with no
    command queued: there is at least one, and each visited one stream at most."""
    for_members = [visited for due, commands, visited in passes
                   if due and not commands and not due & ~reasons]
    assert for_members, passes
    assert all(visited <= 1 for visited in for_members), passes


def _run_commands_now(pair: Pair, step: int) -> None:
    """The conductor's governor step to both agents, run by a duty cycle at the same ``now``
    as the last one (so that no timer is due with it)."""
    pair.sender.enqueue(SetPressureStep(step))
    pair.receiver.enqueue(SetPressureStep(step))
    pair.sender.do_work(pair.now)
    pair.receiver.do_work(pair.now)




@pytest.mark.parametrize("streams", [10, 1000])
def test_a_governor_step_that_keeps_every_interval_visits_no_stream(
        shm: Path, streams: int) -> None:
    pair = _connected_pair(shm, streams)
    deadlines = (pair.sender.c.python_deadline_ns, pair.receiver.c.python_deadline_ns)

    # Step 1: coalescing starts (the C data path's alone); the SM interval stays.
    _run_commands_now(pair, 1)
    assert (pair.sender.streams_visited, pair.receiver.streams_visited) == (0, 0)
    assert all(p.c.coalesce_ns == COALESCE_NS for p in pair.sender.publications)
    assert (pair.sender.c.python_deadline_ns, pair.receiver.c.python_deadline_ns) == deadlines

    # Step 2 widens every image's SM interval, from its next SM on: a store each, and no
    # pass (no deadline either half holds moves).
    _run_commands_now(pair, 2)
    assert (pair.sender.streams_visited, pair.receiver.streams_visited) == (0, 0)
    assert all(image.status_interval_factor == STATUS_INTERVAL_FACTOR
               for image in pair.receive.images.values())
    # Within the pair's sender timeouts, the keepalives four times further apart.
    widened = min(pair.settings.status_message_timeout * STATUS_INTERVAL_FACTOR,
                  min(pair.settings.publication_connection_timeout,
                      pair.settings.flow_control_receiver_timeout) // 5)
    assert widened > pair.settings.status_message_timeout
    assert all(image.c.sm_interval_ns == widened for image in pair.receive.images.values())
    assert (pair.sender.c.python_deadline_ns, pair.receiver.c.python_deadline_ns) == deadlines
    # ... and back at step 1 the interval narrows again, with no pass either.
    _run_commands_now(pair, 1)
    assert (pair.sender.streams_visited, pair.receiver.streams_visited) == (0, 0)
    assert all(image.status_interval_factor == 1 for image in pair.receive.images.values())
    _run_commands_now(pair, 2)

    # The streams stay connected through the steps, their heartbeats and SMs on time.
    pair.run_until(pair.now + SECOND)
    assert all(p.is_connected for p in pair.sender.publications)
    assert len(pair.receive.images) == streams


@pytest.mark.sockets
@pytest.mark.parametrize("streams", [4, 100])
def test_a_pass_due_for_one_image_visits_that_images_endpoint_alone(
        embedded: Callable[..., EmbeddedDriver], streams: int) -> None:  # noqa: F811
    """Real UDP streams on their own endpoints between two embedded drivers: when one
    publication closes, the receiver's Python half is due for that image's end of stream
    (the C half's rule), and those passes visit its endpoint alone, at a few streams as at
    many; the others' images stay connected."""
    a, b = embedded(), embedded()
    with Client.connect(a.directory, invoker=a.do_work) as ca, \
            Client.connect(b.directory, invoker=b.do_work) as cb:
        pairs = []
        for i in range(streams):
            uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
            pairs.append((cb.add_subscription(uri, 100 + i), ca.add_publication(uri, 100 + i)))
        run_until(lambda: all(p.is_connected and s.images for s, p in pairs), a, b,
                  timeout=60, what="every stream connected")
        receiver = next(agent for agent in b._agents if isinstance(agent, Receiver))
        assert len(receiver.endpoints) == streams
        passes = _recorded_passes(receiver)
        closed, _ = pairs[0]
        pairs[0][1].close()
        run_until(lambda: not closed.images, a, b, what="the closed stream's image went")
        # Passes due for members alone (input, an image), with no command queued.
        _assert_each_visits_at_most_one(passes, DUE_MEMBERS)
        assert all(s.images for s, _ in pairs[1:])


@pytest.mark.sockets
@pytest.mark.parametrize("streams", [10, 120])
def test_idle_streams_cost_the_sender_and_the_governor_only_the_streams_due(
        embedded: Callable[..., EmbeddedDriver], streams: int) -> None:  # noqa: F811
    """Real UDP streams on one endpoint between two embedded drivers, all connected (their
    heartbeats and status messages kept in C).  When one publication closes, the sender's
    Python half is due for it alone (its drain and linger: the C half's list of publications,
    its Python timer, its receiver's answers), and those passes visit it alone, at a few
    streams as at many; the others stay connected.  The governor's send backlog looks only
    at the publications whose log or snd-pos moved since its last look."""
    # Every image's log made at once: no SETUP refused and asked for again meanwhile.
    # The blocked-publisher looks of idle publications (every half unblock timeout) fall
    # past the test's end: the passes left are those the closed publication made due.
    a, b = embedded(publication_unblock_timeout="600s"), embedded(image_pending_max=2 * streams)
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(a.directory, invoker=a.do_work) as ca, \
            Client.connect(b.directory, invoker=b.do_work) as cb:
        pairs = [(cb.add_subscription(uri, 100 + i), ca.add_publication(uri, 100 + i))
                 for i in range(streams)]
        run_until(lambda: all(p.is_connected and s.images for s, p in pairs), a, b,
                  timeout=120, what="every stream connected")
        sender = next(agent for agent in a._agents if isinstance(agent, Sender))
        assert len(sender.publications) == streams
        send_side = a.conductor.network._send_side  # type: ignore[union-attr]
        # Every look's visits, the conductor's own governor samples' among them: on a slow
        # machine one of those may come between the message and the test's look below.
        visits: list[int] = []
        send_backlog = send_side.send_backlog

        def recorded_look(*, deferring: bool) -> float:
            backlog = send_backlog(deferring=deferring)
            visits.append(send_side.backlog_streams_visited)
            return backlog

        send_side.send_backlog = recorded_look  # type: ignore[method-assign]

        def look() -> float:
            """The governor's look, after the conductor's cycle that samples the words."""
            send_side.sample_episodes(time.monotonic_ns())
            return send_side.send_backlog(deferring=False)

        # Idle: after a first look, the next finds no publication whose words moved.
        idle_until = time.monotonic() + 0.5
        run_until(lambda: time.monotonic() > idle_until, a, b)
        look()
        a.do_work()
        del visits[:]
        assert look() == 0.0
        assert visits == [0]
        # One message moves one publication's log and snd-pos: the looks from then on visit
        # it alone (again while a look finds it not all sent yet).
        del visits[:]
        subscription, publication = pairs[-1]
        while publication.offer(b"x" * 32) <= 0:
            a.do_work()
        run_until(lambda: subscription.poll(lambda *_: None, 1), a, b, what="the message")
        assert look() == 0.0
        assert max(visits) == 1, visits

        passes = _recorded_passes(sender)
        pairs[0][1].close()
        run_until(lambda: len(sender.publications) == streams - 1, a, b,
                  what="the closed publication done")
        # Passes due for members or timers alone, with no command queued.
        _assert_each_visits_at_most_one(passes, DUE_MEMBERS_OR_TIMERS)
        assert all(p.is_connected for _, p in pairs[1:])


@pytest.mark.sockets
@pytest.mark.parametrize("streams", [4, 60])
def test_adding_a_stream_visits_its_own_endpoint_not_every_one(
        embedded: Callable[..., EmbeddedDriver], streams: int) -> None:  # noqa: F811
    """Real UDP streams on their own endpoints between two embedded drivers: with
    ``streams`` connected, adding one more costs passes that visit that stream and the
    members the C half listed as due, at a few streams as at many: the receiver's (its
    endpoint, its interest, its image) and the sender's (its endpoint and publication);
    every stream connects."""
    a, b = embedded(), embedded()
    with Client.connect(a.directory, invoker=a.do_work) as ca, \
            Client.connect(b.directory, invoker=b.do_work) as cb:
        pairs = []

        def add_pair(i: int) -> None:
            uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
            pairs.append((cb.add_subscription(uri, 100 + i), ca.add_publication(uri, 100 + i)))
            run_until(lambda: all(p.is_connected and s.images for s, p in pairs), a, b,
                      timeout=60, what="every stream connected")

        for i in range(streams):
            add_pair(i)
        receiver = next(agent for agent in b._agents if isinstance(agent, Receiver))
        sender = next(agent for agent in a._agents if isinstance(agent, Sender))
        passes = _recorded_passes(receiver)
        sender_passes = _recorded_passes(sender)
        views_made = _counted_views(sender) + _counted_views(receiver)
        add_pair(streams)
        assert len(receiver.endpoints) == streams + 1
        assert len(sender.publications) == streams + 1
        # The C halves' views followed member by member, as one made anew would have them.
        assert sum(views_made) == 0
        for agent in (sender, receiver):
            _assert_view_is_current(agent)
        # The passes that ran the new stream's commands (no timer due with them).
        for_commands = [visited for due, commands, visited in passes
                        if commands and not due & ~(DUE_MEMBERS | SS_DUE_COMMANDS)]
        assert len(for_commands) >= 2, passes  # its endpoint and interest; its image
        assert all(visited <= 2 for visited in for_commands), passes
        # The sender's, its timers' among them: the new publication, and those due.
        for_commands = [visited for due, commands, visited in sender_passes
                        if commands and not due & ~(DUE_MEMBERS_OR_TIMERS | SS_DUE_COMMANDS)]
        assert for_commands, sender_passes  # its endpoint and publication
        assert all(visited <= 2 for visited in for_commands), sender_passes


def _counted_views(agent: Sender | Receiver) -> list[int]:
    """From now on each time ``agent`` makes its C half's view anew is counted (the list's
    one item)."""
    made = [0]
    c_view = agent._c_view

    def counted() -> tuple[list, list, list]:
        made[0] += 1
        return c_view()

    agent._c_view = counted  # type: ignore[method-assign]
    return made


def _assert_view_is_current(agent: Sender | Receiver) -> None:
    """The C half reads the members a view made anew would hold (each array in an order of
    its own: a member added goes last), each with its owner, and finds every endpoint's
    socket by its fd."""
    c = agent.c
    for view, (kind, count, array) in zip(
            agent._c_view(), (("receivers", c.endpoint_count, c.endpoints),
                              ("images", c.image_count, c.images),
                              ("sends", c.publication_count, c.publications)), strict=True):
        held = getattr(agent, f"_{kind}")
        read = [array[i] for i in range(count)]
        assert read == held.members
        assert {(int(network_ffi.cast("uintptr_t", m)), id(o)) for m, o in view} == {
            (int(network_ffi.cast("uintptr_t", m)), id(o))
            for m, o in zip(held.members, held.owners, strict=True)}
    for i in range(c.endpoint_count):
        receiver = c.endpoints[i]
        assert c.receivers_by_fd[receiver.fd] == receiver


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=60))
def test_a_member_array_holds_what_its_members_are_after_any_adds_and_removes(
        operations: list[tuple[bool, int]]) -> None:
    """The C half's array of members, grown by doubling and closed up on removal, reads as
    the members in the order they came, each with its owner, whatever the adds and removes."""
    structs = [network_ffi.new("ss_receiver_t *") for _ in range(12)]
    array = MemberArray("ss_receiver_t *")
    model: list[tuple[int, int]] = []  # (member, owner)
    for add, k in operations:
        if add and all(member != k for member, _ in model):
            array.append(structs[k], k % 3)
            model.append((k, k % 3))
        elif not add:
            assert array.remove(structs[k]) == any(member == k for member, _ in model)
            model = [(member, owner) for member, owner in model if member != k]
        if k % 7 == 6 and model:  # now and then an owner's members go at once
            owner = model[0][1]
            gone = array.remove_owned_by(owner)
            assert gone == [structs[m] for m, o in model if o == owner]
            model = [(m, o) for m, o in model if o != owner]
        assert array.capacity >= len(model)
        assert [array.array[i] for i in range(len(model))] == [structs[m] for m, _ in model]
        assert array.members == [structs[m] for m, _ in model]
        assert array.owners == [o for _, o in model]

