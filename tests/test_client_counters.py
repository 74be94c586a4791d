"""Counters a client adds (Client.add_counter, Aeron's addCounter), with real driver processes.

The driver allocates them in its counters file and owns their lifetime: freed when the client
closes one, when the client closes, and when a killed client's liveness runs out.  Another
process finds one by type and key, and a reader that kept its id sees when it was freed and
its slot went to another counter.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, free_tcp_port, run_stat, scrape, value, wait_for

from slipstream.client import (
    ClosedError,
    Counter,
    InvalidArgumentError,
    RegistrationError,
    control,
)
from slipstream.client.client import Client
from slipstream.client.counters import (
    FREE_TO_REUSE_TIMEOUT_NS,
    KEY_MAX_LENGTH,
    LABEL_MAX_LENGTH,
    CountersFile,
    CounterType,
    SystemCounter,
    read_system_counters,
)
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver

RECORDING = CounterType.RECORDING_POSITION

# A client in a process of its own: it adds one counter, says its ids, then runs the commands
# it reads ("set N", "add N", "close"), answering each with "ok".
_OWNER = """
import sys
from slipstream.client import Client
client = Client.connect(sys.argv[1])
counter = client.add_counter(int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4]))
print(counter.counter_id, counter.registration_id, flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "set":
        counter.set(int(args[0]))
    elif command == "add":
        counter.add(int(args[0]))
    elif command == "close":
        counter.close()
    print("ok", flush=True)
"""


class Owner:
    """A process that owns one counter (:data:`_OWNER`)."""

    def __init__(self, directory: Path, type_id: int, label: str, key: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(directory), str(type_id), label, key.hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, "the owner process ended before it added its counter"
        self.counter_id, self.registration_id = map(int, line.split())

    def run(self, command: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "ok\n"

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.kill()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def owner_of(driver: MediaDriver) -> Iterator:
    owners: list[Owner] = []

    def start(type_id: int, label: str, key: bytes) -> Owner:
        owners.append(Owner(driver.directory, type_id, label, key))
        return owners[-1]

    yield start
    for owner in owners:
        owner.close()


@pytest.fixture
def reader(driver: MediaDriver) -> Iterator[CountersFile]:
    """The driver's counters file, mapped read-only as another process's tool maps it."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    yield counters
    counters.close()


def _recording_key(recording_id: int, session_id: int, source: str) -> bytes:
    """A key as a recording's counter has it: recording id, session id, source identity."""
    encoded = source.encode()
    return (recording_id.to_bytes(8, "little") + session_id.to_bytes(4, "little", signed=True)
            + len(encoded).to_bytes(4, "little") + encoded)


def test_a_counter_of_one_process_is_found_by_type_and_key_and_read_and_written_across(
        owner_of, reader: CountersFile) -> None:
    key = _recording_key(7, -5, "127.0.0.1:40123")
    owner = owner_of(RECORDING, "rec-pos: 7 session=-5", key)
    owner.run("set 4096")
    found = reader.find(RECORDING, key)
    assert found is not None
    assert (found.counter_id, found.registration_id) == (owner.counter_id, owner.registration_id)
    assert (found.label, found.key, found.value) == ("rec-pos: 7 session=-5", key, 4096)
    # Another recording's key, or another type with this key, is not it.
    assert reader.find(RECORDING, _recording_key(8, -5, "127.0.0.1:40123")) is None
    assert reader.find(RECORDING + 1, key) is None
    assert reader.find(RECORDING, registration_id=owner.registration_id) == found
    kept = reader.reader(found.counter_id, found.registration_id)
    owner.run("add 100")
    assert kept.get() == 4196 and kept.is_allocated


def test_stat_and_the_metrics_exporter_show_a_client_counter_with_its_owner(
        driver_dir: Path) -> None:
    port = free_tcp_port()
    key = _recording_key(3, 11, "ipc")
    with MediaDriver.launch(directory=driver_dir, metrics_address=f"127.0.0.1:{port}",
                            **FAST_DRIVER_SETTINGS) as driver:
        owner = Owner(driver_dir, RECORDING, "rec-pos: 3", key)
        try:
            owner.run("set 123456")
            custom = Owner(driver_dir, 4242, "orders handled", b"")
            try:
                custom.run("add 9")
                text = run_stat(driver).stdout
                snapshot = json.loads(run_stat(driver, "--json").stdout)
                scraped = scrape(port)
                client_of = {row["registration_id"]: row["owner_id"]
                             for row in snapshot["client_counters"]}
            finally:
                custom.close()
        finally:
            owner.close()
    assert "client counters (2)" in text
    row = next(line for line in text.splitlines() if "rec-pos: 3" in line)
    assert "recording_position" in row and "123,456" in row
    assert f"pid {owner.process.pid}" in row and f"key={key.hex()}" in row
    rows = {r["label"]: r for r in snapshot["client_counters"]}
    assert rows["rec-pos: 3"]["owner_pid"] == owner.process.pid
    assert rows["rec-pos: 3"]["key"] == key.hex() and rows["rec-pos: 3"]["value"] == 123456
    assert (rows["orders handled"]["type_id"], rows["orders handled"]["value"]) == (4242, 9)
    # One family per type: the archive's named, an application's by its number.
    recording = (f'slipstream_recording_position{{client="{client_of[owner.registration_id]}",'
                 f'key="{key.hex()}",label="rec-pos: 3",'
                 f'registration="{owner.registration_id}"}}')
    assert value(scraped, recording) == 123456
    assert "# TYPE slipstream_client_counter_4242 gauge" in scraped
    assert value(scraped, f'slipstream_client_counter_4242{{client="'
                          f'{client_of[custom.registration_id]}",key="",label="orders handled",'
                          f'registration="{custom.registration_id}"}}') == 9


def test_closing_a_counter_frees_it_and_its_readers_see_so(
        client: Client, reader: CountersFile) -> None:
    with client.add_counter(1100, "open for a while") as counter:
        kept = reader.reader(counter.counter_id, counter.registration_id)
        counter.set(5)
        assert (counter.get(), kept.get(), kept.is_allocated) == (5, 5, True)
    assert counter.is_closed and not kept.is_allocated
    assert reader.find(1100) is None
    for call in (lambda: counter.set(1), lambda: counter.add(), counter.get):
        with pytest.raises(ClosedError):
            call()
    counter.close()  # again: nothing


def test_closing_the_client_frees_its_counters(driver: MediaDriver,
                                               reader: CountersFile) -> None:
    client = Client.connect(driver.directory)
    counters = [client.add_counter(1100 + i, f"counter {i}") for i in range(3)]
    kept = [reader.reader(c.counter_id, c.registration_id) for c in counters]
    assert all(k.is_allocated for k in kept)
    client.close()
    assert all(c.is_closed for c in counters)
    assert not any(k.is_allocated for k in kept)
    assert [info for info in reader if info.owner_id == client.client_id] == []


def test_a_killed_clients_counter_is_freed_after_its_liveness_timeout(
        driver: MediaDriver, owner_of, reader: CountersFile) -> None:
    owner = owner_of(RECORDING, "rec-pos: 1", _recording_key(1, 1, "ipc"))
    kept = reader.reader(owner.counter_id, owner.registration_id)
    timeouts = read_system_counters(driver.directory)[SystemCounter.CLIENT_TIMEOUTS]
    owner.kill()
    assert kept.is_allocated  # the driver does not know yet
    # Freed by the liveness timeout, checked on the timer; a driver that does not time the
    # client out holds the counter for good.  Three timeouts are a loaded machine's room.
    settings = load_settings(env={}, overrides=FAST_DRIVER_SETTINGS)
    liveness_s = settings.client_liveness_timeout / 1e9
    wait_for(lambda: not kept.is_allocated, timeout=3 * liveness_s + settings.timer_interval / 1e9,
             what="the killed client's counter freed within its liveness timeout")
    assert reader.find(RECORDING) is None
    assert read_system_counters(driver.directory)[SystemCounter.CLIENT_TIMEOUTS] == timeouts + 1


def test_a_full_counters_file_refuses_a_counter_by_name_and_takes_new_ones_once_some_close(
        driver_dir: Path) -> None:
    """Across the limit: every free slot taken, the next refused; five closed, five new ones
    fit (in the slots the closed ones left, once the reuse delay passed) and a sixth not.
    Readers that kept a closed counter's id see that their counter is gone although the slot
    is allocated again."""
    with MediaDriver.launch(directory=driver_dir, counters_capacity=256,
                            **FAST_DRIVER_SETTINGS) as driver, \
            Client.connect(driver.directory) as client:
        reader = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
        try:
            counters: list[Counter] = []
            with pytest.raises(RegistrationError) as full:
                while True:
                    counters.append(client.add_counter(1100, f"c{len(counters)}"))
            assert full.value.code == control.ERR_RESOURCE
            assert "all 256 counters are in use" in str(full.value)
            assert "counters_capacity" in str(full.value)
            # The driver's own (its system counters and one a capacity), this client's
            # heartbeat, and these fill the file.
            capacities = sum(info.type_id == CounterType.CAPACITY for info in reader)
            assert capacities > 0
            assert len(counters) == 256 - len(SystemCounter) - capacities - 1
            closed = counters[10:15]
            kept = [reader.reader(c.counter_id, c.registration_id) for c in closed]
            for counter in closed:
                counter.close()
            with pytest.raises(RegistrationError, match="freed less than 1 s ago"):
                client.add_counter(1100, "too soon")
            time.sleep(FREE_TO_REUSE_TIMEOUT_NS / 1e9 + 0.1)
            again = [client.add_counter(1101, f"again {i}") for i in range(5)]
            with pytest.raises(RegistrationError, match="all 256 counters are in use"):
                client.add_counter(1101, "one more")
            assert ({c.counter_id for c in again} == {c.counter_id for c in closed})
            assert not any(k.is_allocated for k in kept)
            assert all(reader.reader(c.counter_id, c.registration_id).is_allocated
                       for c in again)
            again[0].set(77)
            reused = next(k for k in kept if k.counter_id == again[0].counter_id)
            assert reused.get() == 77 and not reused.is_allocated  # the value is another's
        finally:
            reader.close()


@pytest.mark.parametrize("type_id", [0, 1, 99, 1000, 1050, 1099])
def test_a_type_id_of_the_drivers_is_refused_by_name(client: Client, type_id: int) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        client.add_counter(type_id, "mine")
    assert refused.value.field == "type_id"
    assert "reserved for the driver's own counters (0..99 and 1000..1099)" in str(refused.value)


@pytest.mark.parametrize("type_id", [100, 999, 1100, 2**31 - 1])
def test_a_type_id_next_to_the_drivers_is_a_clients(client: Client, type_id: int) -> None:
    with client.add_counter(type_id, "mine") as counter:
        assert counter.type_id == type_id


@pytest.mark.parametrize(("type_id", "problem"), [(-1, "outside 0..2147483647"),
                                                  (2**31, "outside 0..2147483647"),
                                                  ("1100", "is not an integer"),
                                                  (True, "is not an integer")])
def test_a_type_id_that_is_no_int32_is_refused_by_name(client: Client, type_id: object,
                                                       problem: str) -> None:
    with pytest.raises(InvalidArgumentError, match=problem) as refused:
        client.add_counter(type_id, "mine")  # type: ignore[arg-type]
    assert refused.value.field == "type_id"


def test_a_label_longer_than_the_record_is_refused_by_name(client: Client,
                                                           reader: CountersFile) -> None:
    with client.add_counter(1100, "x" * LABEL_MAX_LENGTH) as longest:
        assert reader.find(1100, registration_id=longest.registration_id).label == (
            "x" * LABEL_MAX_LENGTH)
    with pytest.raises(InvalidArgumentError) as refused:
        client.add_counter(1100, "x" * (LABEL_MAX_LENGTH + 1))
    assert refused.value.field == "label"
    assert f"{LABEL_MAX_LENGTH + 1} bytes of UTF-8 exceed the counters file's " \
           f"{LABEL_MAX_LENGTH}-byte label" in str(refused.value)
    # Bytes, not characters: half as many two-byte characters and one more.
    with pytest.raises(InvalidArgumentError, match="label"):
        client.add_counter(1100, "é" * (LABEL_MAX_LENGTH // 2 + 1))


def test_a_key_longer_than_the_record_is_refused_by_name(client: Client,
                                                         reader: CountersFile) -> None:
    key = bytes(range(KEY_MAX_LENGTH))
    with client.add_counter(1100, "longest key", key):
        assert reader.find(1100, key).label == "longest key"
    with pytest.raises(InvalidArgumentError) as refused:
        client.add_counter(1100, "too long a key", bytes(KEY_MAX_LENGTH + 1))
    assert refused.value.field == "key"
    assert f"{KEY_MAX_LENGTH + 1} bytes exceed the counters file's {KEY_MAX_LENGTH}-byte key" \
        in str(refused.value)
    with pytest.raises(InvalidArgumentError, match="key: str is not bytes"):
        client.add_counter(1100, "a text key", "abc")  # type: ignore[arg-type]


def test_removing_another_clients_counter_is_refused(driver: MediaDriver, client: Client,
                                                     reader: CountersFile) -> None:
    """A counter is its owner's to close: another client's REMOVE_COUNTER of its registration
    is an unknown counter, and the counter stays."""
    with client.add_counter(1100, "mine") as counter, \
            Client.connect(driver.directory) as other:
        with pytest.raises(RegistrationError) as refused:
            conductor = other._conductor
            conductor._request(control.REMOVE_COUNTER, lambda: conductor._proxy.remove(
                control.REMOVE_COUNTER, counter.registration_id))
        assert refused.value.code == control.ERR_UNKNOWN_COUNTER
        assert reader.holds(counter.counter_id, counter.registration_id)
