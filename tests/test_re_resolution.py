"""When host names in channels are resolved again (docs/CHANNELS.md §7.2): the schedule of
:class:`~slipstream.daemon.media.names.NameWatch`, with time as an argument.  Its users are
the conductor's unicast send endpoints whose ``endpoint=`` is a name; the driver's runner
resolves what it asks for off the conductor's loop (tests/test_names.py: a resolver that
sleeps; tests/test_re_resolution_hosts.py: the whole path on namespace hosts)."""

from __future__ import annotations

import attrs
import pytest

from slipstream.client.channel import parse_channel
from slipstream.client.errors import ChannelError
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media import names
from slipstream.daemon.media.names import NameWatch

S = 1_000_000_000


@attrs.define(eq=False)
class Peer:
    """A watched user: whether it hears its peer now."""

    in_contact: bool = False


def _watch(interval_ns: int = S) -> tuple[NameWatch[Peer], Peer]:
    watch: NameWatch[Peer] = NameWatch(interval_ns)
    peer = Peer()
    watch.watch(peer, "rcv.test", "10.0.0.2", lambda: peer.in_contact, now_ns=0)
    return watch, peer


def test_the_default_interval_is_aerons_check_interval() -> None:
    assert DriverSettings().name_re_resolution_interval == S
    assert NameWatch(S).next_check_ns is None  # nothing watched: no wake-up


def test_a_silent_peers_name_is_resolved_again_once_per_interval() -> None:
    watch, _ = _watch()
    assert watch.next_check_ns == S
    assert watch.due(S - 1) == []
    assert watch.due(S) == ["rcv.test"]
    assert watch.next_check_ns == 2 * S
    # Not asked again while the resolver works on it, however long it takes.
    assert watch.due(2 * S) == [] and watch.due(3 * S) == []
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.0.2"}) == []  # the same address
    assert watch.due(3 * S + 1) == []  # the next check is an interval after the last
    assert watch.due(4 * S) == ["rcv.test"]


def test_a_changed_address_moves_the_user_and_only_once() -> None:
    watch, peer = _watch()
    assert watch.due(S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.0.3"}) == [
        (peer, "10.0.0.2", "10.0.0.3")]
    assert watch.address_of(peer) == "10.0.0.3"
    assert watch.due(2 * S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.0.3"}) == []


def test_a_peer_in_contact_keeps_its_address() -> None:
    """A name with several records (a round-robin service) must not move a stream that
    flows: only users out of contact are resolved again, and moved."""
    watch, peer = _watch()
    peer.in_contact = True
    assert [watch.due(t * S) for t in range(1, 5)] == [[], [], [], []]
    peer.in_contact = False
    assert watch.due(5 * S) == ["rcv.test"]
    peer.in_contact = True  # heard again while the resolver worked
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.0.9"}) == []
    assert watch.address_of(peer) == "10.0.0.2"


def test_a_name_that_does_not_resolve_keeps_the_address_and_is_asked_again() -> None:
    watch, peer = _watch()
    assert watch.due(S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": None}) == []
    assert watch.answered([], {}) == []  # a resolver that gave up answers nothing
    assert watch.address_of(peer) == "10.0.0.2"
    assert watch.due(2 * S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {}) == []  # gave up on it: asked again next time
    assert watch.due(3 * S) == ["rcv.test"]


def test_one_name_of_several_users_is_resolved_once_and_moves_the_silent_ones() -> None:
    watch, silent = _watch()
    flowing, other = Peer(in_contact=True), Peer()
    watch.watch(flowing, "rcv.test", "10.0.0.2", lambda: flowing.in_contact, now_ns=0)
    watch.watch(other, "other.test", "10.0.0.7", lambda: other.in_contact, now_ns=0)
    assert watch.due(S) == ["rcv.test", "other.test"]
    changes = watch.answered(["rcv.test", "other.test"],
                             {"rcv.test": "10.0.0.3", "other.test": "10.0.0.7"})
    assert changes == [(silent, "10.0.0.2", "10.0.0.3")]
    assert watch.address_of(flowing) == "10.0.0.2"


def test_an_unwatched_user_is_never_resolved_nor_moved() -> None:
    watch, peer = _watch()
    assert watch.due(S) == ["rcv.test"]
    watch.unwatch(peer)
    assert watch.next_check_ns is None and watch.due(10 * S) == []
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.0.3"}) == []
    assert watch.address_of(peer) is None


def test_an_interval_of_zero_never_resolves_again() -> None:
    watch, _ = _watch(interval_ns=0)
    assert watch.next_check_ns is None
    assert watch.due(100 * S) == []


def test_a_manual_destination_is_silent_until_it_is_heard_within_the_timeout() -> None:
    """What the sender tells the conductor of a manual endpoint's destinations (its
    ``DestinationsSilent`` answer), which decides whether a named one is resolved again."""
    from slipstream.daemon.media.destinations import ControlMode, DestinationTable

    table = DestinationTable(ControlMode.MANUAL)
    here, there = ("10.0.0.2", 40_000), ("10.0.0.3", 40_000)
    table.add(here, 0)
    table.add(there, 0)
    assert table.silent(S - 1, S) == frozenset()  # just added: given the timeout
    table.heard(here, S // 2)
    table.heard(("10.0.0.9", 1), S // 2)  # no destination there: nothing changes
    assert table.silent(S, S) == {there}
    assert table.silent(2 * S, S) == {here, there}


def test_a_name_that_moves_to_another_ip_version_is_not_followed_and_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint's socket is of one IP version.  The warning comes once per such answer,
    not at every check: again when the answer changes, or after the name came back."""
    watch, peer = _watch()
    said = []
    for t, answer in enumerate(["fd00::3", "fd00::3", "fd00::3", "fd00::4", "10.0.0.2",
                                "fd00::4"], start=1):
        caplog.clear()
        assert watch.due(t * S) == ["rcv.test"]
        assert watch.answered(["rcv.test"], {"rcv.test": answer}) == []
        said.append(sum("another IP version" in r.getMessage() for r in caplog.records))
    assert said == [1, 0, 0, 1, 0, 1]
    assert watch.address_of(peer) == "10.0.0.2"


def test_a_move_that_did_not_take_is_asked_for_again_and_applied() -> None:
    """The sender could not connect its socket to the new address (no route there yet): the
    conductor hears it (``RetargetFailed``), and the next check applies the same answer
    again, until one takes."""
    watch, peer = _watch()
    assert watch.due(S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.1.2"}) == [
        (peer, "10.0.0.2", "10.0.1.2")]
    watch.retry(peer, "10.0.1.2")
    assert watch.due(2 * S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.1.2"}) == [
        (peer, "10.0.1.2", "10.0.1.2")]
    # That one took: the same answer is no change any more.
    assert watch.due(3 * S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.1.2"}) == []


def test_a_failure_to_move_that_comes_after_a_later_move_changes_nothing() -> None:
    """The move to 10.0.1.2 failed, but the failure is heard only after the peer moved on to
    10.0.2.2 and the endpoint went there: that address is not asked for again."""
    watch, peer = _watch()
    for t, answer in enumerate(["10.0.1.2", "10.0.2.2"], start=1):
        assert watch.due(t * S) == ["rcv.test"]
        assert watch.answered(["rcv.test"], {"rcv.test": answer})
    watch.retry(peer, "10.0.1.2")
    assert watch.due(3 * S) == ["rcv.test"]
    assert watch.answered(["rcv.test"], {"rcv.test": "10.0.2.2"}) == []


def test_a_failed_re_resolution_is_not_kept_for_channels_added_meanwhile(monkeypatch) -> None:
    """A transient failure while a name is resolved again refuses no channel added after it
    (the next command that names it asks the resolver); a failure of a channel's own lookup
    is kept for the cache's TTL, and refuses the channel naming the host and why."""
    def unreachable(host: str) -> str:
        raise OSError(f"{host}: temporary failure in name resolution")

    monkeypatch.setattr(names, "resolve_host", unreachable)
    channel = parse_channel("aeron:udp?endpoint=peer.test:40456")
    answers = names.resolve(["peer.test"])
    assert answers["peer.test"].address is None
    cache = names.NameCache()
    cache.store(answers, now_s=0.0, remember_failures=False)  # a re-resolution's
    assert cache.unresolved(channel, 0.0) == ["peer.test"]
    cache.store(answers, now_s=0.0)  # a channel's own
    assert cache.unresolved(channel, names.TTL_S) == []
    assert cache.unresolved(channel, names.TTL_S + 1.0) == ["peer.test"]
    with pytest.raises(ChannelError) as refused:
        cache.lookup(channel, "endpoint", "peer.test")
    assert refused.value.part == "endpoint"
    assert "peer.test" in refused.value.problem and "temporary failure" in refused.value.problem
