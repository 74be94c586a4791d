"""The control plane refuses what it cannot serve and never dies of it (docs/RELIABILITY.md).

A hostile or buggy client talks to a real driver over its real control socket; after every
bad command the driver must still serve a well-behaved client end to end.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import zmq
from helpers import RawClient, as_another_user, lacking, wait_for

from slipstream.client import Client, InvalidArgumentError, control
from slipstream.client.counters import CountersFile, SystemCounter, read_system_counters
from slipstream.daemon.conductor.conductor import DriverConductor
from slipstream.daemon.config import DriverSettings
from slipstream.sim.real.fuzz import CommandFuzzer


def _still_serves(directory: Path) -> None:
    with Client.connect(directory) as client:
        publication = client.add_publication("aeron:ipc", 4242)
        subscription = client.add_subscription("aeron:ipc", 4242)
        wait_for(lambda: publication.is_connected, what="the publication connected")
        assert publication.offer(b"still here") > 0
        received: list[bytes] = []
        subscription.receive(lambda data, _h: received.append(bytes(data)), 10, timeout=5)
        assert received == [b"still here"]


def _errors(directory: Path) -> int:
    return read_system_counters(directory)[SystemCounter.ERRORS]


@pytest.mark.parametrize(("field", "value"), [
    ("stream_id", 2**31),
    ("stream_id", -(2**31) - 1),
    ("stream_id", "1001"),
    ("stream_id", True),
    ("stream_id", 1.5),
    ("stream_id", None),
    ("channel", 42),
    ("channel", "aeron:ipc?" + "x" * 5000),
    ("correlation_id", 2**70),
])
def test_a_field_out_of_range_is_refused_by_name_and_the_driver_serves_on(
        driver, field: str, value: object) -> None:
    raw = RawClient(driver.directory)
    try:
        reply = raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                             "pid": 1, "process": 1, "correlation_id": 1})
        assert reply["type"] == control.CONNECTED
        command = {"type": control.ADD_PUBLICATION, "channel": "aeron:ipc", "stream_id": 7,
                   "correlation_id": 2}
        command[field] = value
        reply = raw.request(command)
        assert reply["type"] == control.ERROR
        assert reply["code"] == control.ERR_INVALID_ARGUMENT
        assert field in reply["message"]
    finally:
        raw.close()
    _still_serves(driver.directory)


@pytest.mark.parametrize("frames", [
    [b"{"],                                       # not JSON
    [b"\xff\xfe\x00"],                            # not UTF-8
    [b"[" * 100_000 + b"]" * 100_000],            # too large
    [b"[" * 5000 + b"]" * 5000],                  # too deep
    [json.dumps({"type": "ADD_PUBLICATION", "channel": {"nested": [1]}}).encode()],
    [b"[1, 2, 3]"],                               # not an object
    [b'{"type": 7}'],                             # type not a string
    [b"one", b"two"],                             # several frames
    [b""],                                        # empty
])
def test_a_malformed_frame_is_counted_and_dropped(driver, frames: list[bytes]) -> None:
    before = _errors(driver.directory)
    raw = RawClient(driver.directory)
    try:
        raw.send_raw(*frames)
        assert raw.silent()  # nothing to answer: no correlation id could be trusted
    finally:
        raw.close()
    assert _errors(driver.directory) > before
    _still_serves(driver.directory)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("type_id", 0, "reserved for the driver's own counters"),
    ("type_id", 1001, "reserved for the driver's own counters"),
    ("type_id", "1100", "is not an integer"),
    ("type_id", -1, "outside 0..2147483647"),
    ("label", "x" * 361, "361 bytes of UTF-8 exceed the counters file's 360-byte label"),
    ("label", "\ud800", "not valid Unicode text"),
    ("label", 7, "is not a string"),
    ("key", "ab" * 113, "113 bytes exceed the counters file's 112-byte key"),
    ("key", "not hex", "not hex"),
    ("key", "abc", "not hex"),
    ("key", 12, "is not a hex string"),
])
def test_a_malformed_add_counter_is_refused_by_field_and_counted(
        driver, field: str, value: object, problem: str) -> None:
    """What Client.add_counter checks, the driver checks again: a raw client's command with a
    reserved type, or a label or key the record cannot hold, takes no counter."""
    raw = RawClient(driver.directory)
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        reply = raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                             "pid": 1, "process": 1, "correlation_id": 1})
        assert reply["type"] == control.CONNECTED
        command = {"type": control.ADD_COUNTER, "type_id": 1100, "label": "ok", "key": "07",
                   "correlation_id": 2}
        assert raw.request(command)["type"] == control.COUNTER_READY  # the well-formed one
        allocated = len(list(counters))
        before = _errors(driver.directory)
        reply = raw.request({**command, field: value, "correlation_id": 3})
        assert (reply["type"], reply["code"]) == (control.ERROR, control.ERR_INVALID_ARGUMENT)
        assert reply["message"].startswith(f"malformed ADD_COUNTER command: {field}: ")
        assert problem in reply["message"]
        assert _errors(driver.directory) == before + 1
        assert len(list(counters)) == allocated
    finally:
        counters.close()
        raw.close()
    _still_serves(driver.directory)


def test_unknown_and_incomplete_commands_are_answered_with_an_error(driver) -> None:
    raw = RawClient(driver.directory)
    try:
        reply = raw.request({"type": "FORMAT_DISK", "correlation_id": 3})
        assert (reply["type"], reply["code"]) == (control.ERROR, control.ERR_UNSUPPORTED)
        reply = raw.request({"type": control.REMOVE_PUBLICATION, "correlation_id": 4})
        assert reply["code"] == control.ERR_INVALID_ARGUMENT
        assert "registration_id" in reply["message"]
        reply = raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                             "pid": -5, "process": 1, "correlation_id": 5})
        assert reply["code"] == control.ERR_INVALID_ARGUMENT and "pid" in reply["message"]
        reply = raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                             "pid": 1, "correlation_id": 6})
        assert reply["code"] == control.ERR_INVALID_ARGUMENT and "process" in reply["message"]
    finally:
        raw.close()
    _still_serves(driver.directory)


def test_a_client_of_an_older_protocol_is_told_to_upgrade_not_which_field_it_lacks(
        driver) -> None:
    """Version 3 clients sent no ``process``: the answer names the versions, the fix."""
    raw = RawClient(driver.directory)
    try:
        reply = raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION - 1,
                             "pid": 1, "correlation_id": 7})
        assert reply["code"] == control.ERR_UNSUPPORTED
        assert (f"version {control.PROTOCOL_VERSION - 1} is not {control.PROTOCOL_VERSION}: "
                f"upgrade the client or driver") in reply["message"]
    finally:
        raw.close()
    _still_serves(driver.directory)


@pytest.mark.parametrize(("frame", "named"), [
    (b'{"correlation_id": 9, "channel": "aeron:ipc"}', "type"),
    (b'{"type": "ADD_PUBLICATION", "channel": ["aeron:ipc"], "correlation_id": 9}', "channel"),
    (b'{"type": 5, "correlation_id": 9}', "type"),
])
def test_a_malformed_command_that_names_its_correlation_id_is_answered_by_field(
        driver, frame: bytes, named: str) -> None:
    raw = RawClient(driver.directory)
    try:
        raw.send_raw(frame)
        reply = raw.reply()
        assert (reply["type"], reply["correlation_id"]) == (control.ERROR, 9)
        assert reply["code"] == control.ERR_INVALID_ARGUMENT
        assert reply["message"].startswith(f"malformed command: {named}: ")
    finally:
        raw.close()
    _still_serves(driver.directory)


def test_a_fuzz_of_commands_is_answered_or_counted_and_the_driver_serves_on(driver) -> None:
    """3,000 hostile frames (bench/fuzz.py runs more): every one that names a correlation id
    is answered, the rest are counted, and a well-behaved client is served afterwards."""
    fuzzer = CommandFuzzer(seed=11)
    raw = RawClient(driver.directory)
    owed: set[int] = set()
    answered: set[int] = set()
    before = _errors(driver.directory)
    dropped = 0
    try:
        for _ in range(3_000):
            frames, answer = fuzzer.next()
            raw.send_raw(*frames)
            if answer:
                owed.add(json.loads(frames[0])["correlation_id"])
            else:
                dropped += 1
            while not raw.silent(0):
                answered.add(raw.reply()["correlation_id"])
        while owed - answered and not raw.silent(5_000):
            answered.add(raw.reply()["correlation_id"])
    finally:
        raw.close()
    assert owed <= answered
    assert _errors(driver.directory) - before >= dropped
    _still_serves(driver.directory)


def test_a_second_connect_on_one_connection_is_refused_and_takes_no_counter(driver) -> None:
    raw = RawClient(driver.directory)
    connect = {"type": control.CONNECT, "version": control.PROTOCOL_VERSION, "pid": 1,
               "process": 1}
    try:
        first = raw.request({**connect, "correlation_id": 1})
        assert first["type"] == control.CONNECTED
        counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
        try:
            before = len(list(counters))
            for i in range(50):
                reply = raw.request({**connect, "correlation_id": 2 + i})
                assert reply["type"] == control.ERROR
                assert f"client {first['client_id']} already" in reply["message"]
            assert len(list(counters)) == before
        finally:
            counters.close()
    finally:
        raw.close()
    _still_serves(driver.directory)


def test_the_client_checks_stream_ids_before_asking_the_driver(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        client.add_publication("aeron:ipc", 2**31)
    assert raised.value.field == "stream_id"
    with pytest.raises(InvalidArgumentError) as raised:
        client.add_subscription("aeron:ipc", "1001")  # type: ignore[arg-type]
    assert raised.value.field == "stream_id"
    assert client.add_publication("aeron:ipc", 2**31 - 1).stream_id == 2**31 - 1


def test_an_unexpected_failure_in_a_command_is_answered_and_counted(shm: Path) -> None:
    counters = CountersFile.create(shm / "counters.dat", 256)
    conductor = DriverConductor(DriverSettings(dir=str(shm)), shm, counters)
    try:
        (_key, reply), = conductor.on_command(b"k", {
            "type": control.CONNECT, "version": control.PROTOCOL_VERSION, "pid": 1,
            "process": 1, "correlation_id": 1}, 0)
        assert reply["type"] == control.CONNECTED

        def broken(*_args: object) -> None:
            raise RuntimeError("a bug")

        conductor._on_add_subscription = broken  # type: ignore[method-assign]
        (_, reply), = conductor.on_command(b"k", {
            "type": control.ADD_SUBSCRIPTION, "channel": "aeron:ipc", "stream_id": 1,
            "correlation_id": 2}, 0)
        assert (reply["type"], reply["code"]) == (control.ERROR, control.ERR_GENERIC)
        assert "a bug" in reply["message"]
        assert counters.get(SystemCounter.ERRORS) == 1
        (_, reply), = conductor.on_command(b"k", {
            "type": control.REMOVE_SUBSCRIPTION, "registration_id": 99, "correlation_id": 3},
            0)
        assert reply["code"] == control.ERR_UNKNOWN_SUBSCRIPTION
    finally:
        conductor.close(0)
        counters.close()


def _ask_conductor(directory: Path) -> str:
    """CONNECT over a raw zmq socket: "answered" or "no answer" within 2 s."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control.conductor_endpoint(directory))
        sock.send(control.encode({"type": control.CONNECT, "correlation_id": 1,
                                  "version": control.PROTOCOL_VERSION, "pid": os.getpid(),
                                  "process": control.process_token()}))
        return "answered" if sock.poll(2000) else "no answer"
    finally:
        sock.close()


def _ask_conductor_as(uid: int, directory: Path) -> str:
    """:func:`_ask_conductor` from a forked child that became ``uid`` (the modules it needs
    are loaded already: that user cannot read this venv)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            zmq.Context.instance = classmethod(lambda cls, io_threads=1: zmq.Context())
            os.write(write, _ask_conductor(directory).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as answer:
        result = answer.read()
    os.waitpid(pid, 0)
    return result


def test_the_control_socket_refuses_another_user_even_through_an_open_directory(
        driver) -> None:
    """SO_PEERCRED: a process of another user that reaches the socket (here the directory is
    opened up on purpose) gets no answer; one of the driver's user does."""
    if os.geteuid() != 0:
        lacking("needs root, to start a process as another user")
    directory = Path(driver.directory)
    directory.chmod(0o755)
    (directory / control.CONDUCTOR_SOCKET).chmod(0o777)
    assert _ask_conductor_as(65534, directory) == "no answer"
    assert _ask_conductor(directory) == "answered"
    _still_serves(directory)


def _governor_samples(shm: Path, *, timer_interval: str, busy_share: float,
                      seconds: float) -> list[tuple[int, bool]]:
    """When a conductor with one UDP publication sampled its pressure governor (virtual ns,
    and whether on a cycle its timer was due too), driven by its own deadlines over
    ``seconds``, with the network threads reported busy that share of the time
    (NETWORK_BUSY_NS, as their C loop counts it)."""
    from slipstream.daemon.media.udp import UdpTransports

    settings = DriverSettings(dir=str(shm), timer_interval=timer_interval)
    for folder in (control.PUBLICATIONS_DIR, control.IMAGES_DIR):
        (shm / folder).mkdir()
    counters = CountersFile.create(shm / "counters.dat", 256)
    conductor = DriverConductor(settings, shm, counters, transports=UdpTransports(settings,
                                                                                   counters))
    samples: list[tuple[int, bool]] = []
    govern = conductor._govern

    def counted(now_ns: int) -> None:
        samples.append((now_ns, now_ns >= conductor._next_timer_ns))
        govern(now_ns)

    conductor._govern = counted  # type: ignore[method-assign]
    now = start = 10**12
    try:
        (_, connected), = conductor.on_command(b"k", {
            "type": control.CONNECT, "version": control.PROTOCOL_VERSION, "pid": 1,
            "process": 1, "correlation_id": 1}, now)
        replies = conductor.on_command(b"k", {
            "type": control.ADD_PUBLICATION,
            "channel": "aeron:udp?endpoint=127.0.0.1:40999|term-length=64k", "stream_id": 7,
            "correlation_id": 2}, now)
        assert replies[0][1]["type"] == control.PUBLICATION_READY, replies
        heartbeat = connected["heartbeat_counter_id"]
        while now < start + seconds * 1e9:
            now = max(now + 1_000_000, conductor.next_deadline_ns())
            counters.set(heartbeat, now)  # the client's keepalive
            counters.set(SystemCounter.NETWORK_BUSY_NS, int((now - start) * busy_share))
            conductor.do_work(now)
    finally:
        conductor.close(now)
        counters.close()
    return [(t - start, on_timer) for t, on_timer in samples]


def test_a_calm_governor_samples_on_the_timers_cycles_once_a_second(shm: Path) -> None:
    """A driver with a stream and no pressure: its conductor (Python, whose every wake-up
    takes a core from a busy data path on two vCPUs) samples the governor with the timer's
    cycle (1 s by default) instead of every 100 ms."""
    samples = _governor_samples(shm, timer_interval="1s", busy_share=0.0, seconds=10)
    assert 9 <= len(samples) <= 12, samples
    times = [t for t, _ in samples]
    assert all(b - a >= 900_000_000 for a, b in itertools.pairwise(times[1:])), samples


def test_a_calm_governor_shares_the_timers_wake_ups(shm: Path) -> None:
    """With a timer of 300 ms, every calm sample is taken on a timer cycle: one wake-up for
    both, not a second one of its own."""
    samples = _governor_samples(shm, timer_interval="300ms", busy_share=0.0, seconds=6)
    times = [t for t, _ in samples]
    assert all(290_000_000 <= b - a <= 310_000_000
               for a, b in itertools.pairwise(times[1:])), samples
    assert all(on_timer for _, on_timer in samples[1:]), samples


def test_a_governor_under_pressure_samples_every_100_ms(shm: Path) -> None:
    samples = _governor_samples(shm, timer_interval="1s", busy_share=0.5, seconds=5)
    # Busy 0.5 reads as pressure 0.25, from the second sample on (the first has no interval
    # to measure): watched from then on, and it climbs.
    times = [t for t, _ in samples]
    assert all(b - a <= 101_000_000 for a, b in itertools.pairwise(times[1:])), samples
    assert len(samples) >= 38, samples


def test_a_calm_governor_never_samples_more_often_than_every_100_ms(shm: Path) -> None:
    """Even with a timer of a few milliseconds: a short window would read a blip as busy."""
    samples = _governor_samples(shm, timer_interval="5ms", busy_share=0.0, seconds=3)
    times = [t for t, _ in samples]
    assert all(b - a >= 100_000_000 for a, b in itertools.pairwise(times)), samples
    assert len(samples) >= 25, samples


def test_a_key_only_the_other_side_acts_on_is_accepted_with_a_warning(client) -> None:
    """One URI may serve a publication and a subscription (as in Aeron applications), so a
    key of the other side is accepted; the client says it does nothing here (fc=min on a
    subscription had silently given the publication max flow control)."""
    from slipstream.client import ChannelWarning

    uri = "aeron:udp?endpoint=127.0.0.1:40731"
    with pytest.warns(ChannelWarning, match=r"fc, policy are publication keys and do nothing "
                                            r"on a subscription"):
        client.add_subscription(uri + "|fc=min|policy=block", 7)
    with pytest.warns(ChannelWarning, match=r"cc is a subscription key and does nothing on a "
                                            r"publication"):
        client.add_publication(uri + "|cc=cubic", 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keys both sides act on: no warning
        client.add_publication(uri + "|term-length=64k|mtu=1408", 8)
        client.add_subscription(uri + "|term-length=64k|mtu=1408", 8)


# -- the default directory, and drivers this process may not use ----------------------------

def test_the_default_directory_is_the_effective_users_whatever_user_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The effective uid's name, not $USER (a driver answers only its effective uid), and the
    uid itself when the password database has no entry for it (a container's uid): getpass
    raised KeyError there."""
    monkeypatch.setenv("USER", "alice")
    monkeypatch.setenv("LOGNAME", "alice")
    name = pwd.getpwuid(os.geteuid()).pw_name
    assert control.default_driver_directory() == Path(f"/dev/shm/slipstream-{name}")

    def no_entry(uid: int) -> None:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    assert control.default_driver_directory() == Path(f"/dev/shm/slipstream-{os.geteuid()}")


def test_commands_run_by_a_uid_without_a_passwd_entry_find_their_directory() -> None:
    uid = 54321
    result = subprocess.run(
        [*as_another_user(uid), sys.executable, "-m", "slipstream.daemon.cli", "driver",
         "--print-config"], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")})
    assert result.returncode == 0, result.stderr
    assert f"/dev/shm/slipstream-{uid}" in result.stdout


def test_a_client_of_another_user_is_told_whose_directory_it_is(driver) -> None:
    """The driver's directory is 0700: opening its lock was a raw PermissionError."""
    script = ("from slipstream.client import Client\n"
              "try:\n"
              f"    Client.connect({str(driver.directory)!r}, timeout=2)\n"
              "except Exception as e:\n"
              "    print(type(e).__name__, e)\n")
    result = subprocess.run([*as_another_user(65534), sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("DriverError the driver directory "
                                    f"{driver.directory} belongs to root (uid 0)"), (
        result.stdout + result.stderr)


def test_a_driver_of_another_user_refuses_the_client_and_the_error_says_so(
        driver_dir: Path) -> None:
    """Its control socket drops another uid's connection unread (IPC_FILTER_UID): the
    client said the driver was stopped, stuck or overloaded."""
    from slipstream.client import DriverError, DriverTimeoutError

    prefix = as_another_user(65534)
    process = subprocess.Popen([*prefix, sys.executable, "-m", "slipstream.daemon.cli",
                                "driver", "--dir", str(driver_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (driver_dir / control.CONDUCTOR_SOCKET).exists()
                 and (driver_dir / control.COUNTERS_FILE).exists(), timeout=20,
                 what="the other user's driver")
        with pytest.raises(DriverError, match=r"belongs to nobody \(uid 65534\) and this "
                                              r"process runs as root") as raised:
            Client.connect(driver_dir, timeout=1)
        assert not isinstance(raised.value, DriverTimeoutError)
    finally:
        process.terminate()
        process.wait(30)


def test_connecting_to_an_embedded_driver_without_its_invoker_names_the_cause(
        driver_dir: Path) -> None:
    from slipstream.client import DriverTimeoutError
    from slipstream.daemon.driver import MediaDriver

    embedded = MediaDriver.embedded(driver_dir)
    try:
        with pytest.raises(DriverTimeoutError, match=r"embedded in this process .* answers "
                                                     r"only while its application calls its "
                                                     r"do_work\(\): connect with "
                                                     r"invoker=driver.do_work"):
            Client.connect(driver_dir, timeout=0.5)
    finally:
        embedded.close()
