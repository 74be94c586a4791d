"""client_group: the members of one group (primary or supplementary) use a driver that runs as
another user, as a service's applications do; anyone else is refused with an error that names
the group and how to join it, and no member can plant or remove a name in the driver's
directory.  Real users and groups (made here and removed), a real driver process of its own
user and clients under theirs, from the package installed as an operator installs it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from helpers import NETWORK_SETTINGS, free_port, lacking, wait_for
from installed import INSTALL_TIMEOUT_S

from slipstream.client import control

pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT_S)

#: A client's whole program: connect, then publish or subscribe ``count`` messages on
#: ``channel`` (each carries its sequence number), or only try to connect; prints one JSON line.
CLIENT = textwrap.dedent("""
    import json, struct, sys, time
    from slipstream.client import ADMIN_ACTION, BACK_PRESSURED, NOT_CONNECTED, Client
    role, directory, channel, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    try:
        client = Client.connect(directory, timeout=5)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        sys.exit(0)
    seq = struct.Struct("<I")
    with client:
        if role == "publish":
            pub = client.add_publication(channel, 1001)
            deadline = time.monotonic() + 60
            while not pub.is_connected and time.monotonic() < deadline:
                time.sleep(0.01)
            for i in range(count):
                body = seq.pack(i) * 16
                while (position := pub.offer(body)) < 0:
                    if position not in (ADMIN_ACTION, BACK_PRESSURED, NOT_CONNECTED):
                        raise SystemExit(f"offer {i}: {position}")
                    if time.monotonic() > deadline:
                        raise SystemExit(f"offer {i}: still {position} after 60 s")
            print(json.dumps({"published": count}), flush=True)
            sys.stdin.read()  # the publication stays until the test has its subscriber's answer
        else:
            sub = client.add_subscription(channel, 1001)
            print(json.dumps({"ready": True}), flush=True)
            seen = []
            def on_message(data, header):
                seen.append(seq.unpack_from(data)[0])
            deadline = time.monotonic() + 60
            while len(seen) < count and time.monotonic() < deadline:
                sub.receive(on_message, 1000, timeout=0.1)
            print(json.dumps({"received": len(seen),
                              "in_order": seen == list(range(len(seen)))}))
""")


@attrs.frozen
class Accounts:
    """The users of one test: the driver's ``service`` user (its primary group is ``group``,
    as the unit's is), a member whose primary group it is, one with it as a supplementary
    group, and an ``outsider``."""

    group: str
    service: str
    primary: str
    supplementary: str
    outsider: str

    @property
    def gid(self) -> int:
        import grp

        return grp.getgrnam(self.group).gr_gid


def _as(user: str) -> list[str]:
    """The command prefix that runs a process as ``user`` with the groups a login of it has
    (its primary group and those the group database gives it): setpriv, which execs the
    command, so a signal reaches it alone."""
    import pwd

    entry = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def accounts() -> Iterator[Accounts]:
    """Real users and a group of this host, made for the test and removed after it."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        lacking("needs root, useradd and setpriv, to make users and run clients as them")
    tag = uuid.uuid4().hex[:6]
    made = Accounts(group=f"ssgrp{tag}", service=f"sssvc{tag}", primary=f"ssprm{tag}",
                    supplementary=f"sssup{tag}", outsider=f"ssout{tag}")
    users: list[str] = []
    _run("groupadd", made.group)
    try:
        nologin = ("--no-create-home", "--shell", "/usr/sbin/nologin")
        for user, groups in ((made.service, ("--gid", made.group)),
                             (made.primary, ("--gid", made.group)),
                             (made.supplementary, ("--user-group", "--groups", made.group)),
                             (made.outsider, ("--user-group",))):
            _run("useradd", "--system", *nologin, *groups, user)
            users.append(user)
        yield made
    finally:
        for user in users:
            subprocess.run(["userdel", user], capture_output=True, timeout=60)
        subprocess.run(["groupdel", made.group], capture_output=True, timeout=60)


@contextlib.contextmanager
def _driver_of(user: str, group: str, installed_venv, directory: Path) -> Iterator[Path]:
    """A driver of ``user`` with ``client_group`` set to ``group``, run from the installed
    package, until it is stopped (SIGTERM: it must exit 0); its directory."""
    settings = {**NETWORK_SETTINGS, "client_group": group}
    command = [*_as(user), str(installed_venv.slipstream), "driver", "--dir", str(directory),
               *(f"--set={key}={value}" for key, value in settings.items())]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (directory / control.CONDUCTOR_SOCKET).exists()
                 or process.poll() is not None, timeout=30, what=f"the driver of {user}")
        if process.poll() is not None:
            pytest.fail(f"the driver exited {process.returncode}: "
                        f"{process.stderr.read().decode()}")  # type: ignore[union-attr]
        yield directory
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.returncode == 0, process.stderr.read().decode()  # type: ignore[union-attr]


@pytest.fixture
def group_driver(accounts: Accounts, installed_venv, driver_dir: Path) -> Iterator[Path]:
    """A driver of the service user (whose own group is the client group, as under the
    unit) with ``client_group`` set; its directory."""
    with _driver_of(accounts.service, accounts.group, installed_venv, driver_dir) as directory:
        yield directory


def _client(installed_venv, user: str, *args: object,
            prefix: tuple[str, ...] | None = None) -> subprocess.Popen[str]:
    """A client program (:data:`CLIENT`) of ``user``, with the groups a login of it has
    (:func:`_as`), or under ``prefix`` instead."""
    runner = prefix if prefix is not None else _as(user)
    return subprocess.Popen([*runner, str(installed_venv.python), "-c", CLIENT,
                             *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")


def _answer(process: subprocess.Popen[str], timeout: float = 90) -> dict:
    out, err = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert process.returncode == 0 and lines, f"exit {process.returncode}: {out}{err}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("channel", ["aeron:ipc", "aeron:udp?endpoint=127.0.0.1:{port}"])
def test_members_of_the_client_group_stream_to_each_other_through_the_services_driver(
        accounts: Accounts, installed_venv, group_driver: Path, channel: str) -> None:
    """A member by supplementary group reads what a member by primary group publishes, each
    under their own uid, through a driver of a third user: 20,000 messages, about thirty
    64 KiB terms, whole and in order."""
    channel = channel.format(port=free_port())
    count = 20_000
    subscriber = _client(installed_venv, accounts.supplementary, "subscribe", group_driver,
                         channel, count)
    assert subscriber.stdout is not None
    ready = subscriber.stdout.readline()
    assert json.loads(ready or "{}").get("ready"), ready + subscriber.stderr.read()
    publisher = _client(installed_venv, accounts.primary, "publish", group_driver, channel,
                        count)
    try:
        assert _answer(subscriber) == {"received": count, "in_order": True}
    finally:
        assert _answer(publisher) == {"published": count}


def _modes_with_a_log(accounts: Accounts, installed_venv, directory: Path) -> dict:
    """``{name: (mode, gid)}`` of the directory, its entries and its IPC log, while a member
    publishes to another."""
    subscriber = _client(installed_venv, accounts.primary, "subscribe", directory,
                         "aeron:ipc", 1)
    assert subscriber.stdout is not None
    assert json.loads(subscriber.stdout.readline()).get("ready")
    publisher = _client(installed_venv, accounts.primary, "publish", directory, "aeron:ipc", 1)
    try:
        # A process that starts its interpreter first: seconds on a loaded machine (niced,
        # beside a CPU hog, over 5 s).
        wait_for(lambda: any((directory / control.PUBLICATIONS_DIR).iterdir()),
                 timeout=60, what="the IPC log")
        modes = {}
        for path in [directory, *directory.iterdir(),
                     *(directory / control.PUBLICATIONS_DIR).iterdir()]:
            info = path.lstat()
            modes[path.name] = (oct(info.st_mode & 0o7777), info.st_gid)
    finally:
        assert _answer(subscriber) == {"received": 1, "in_order": True}
        assert _answer(publisher) == {"published": 1}
    return modes


def _assert_the_groups(modes: dict, gid: int, directory_mode: int) -> None:
    """The directories ``directory_mode``; what clients write 0660, what they read 0640; all
    the group's, nothing for others."""
    for name in (next(iter(modes)), control.PUBLICATIONS_DIR, control.IMAGES_DIR):
        assert modes[name] == (oct(directory_mode), gid), name
    for name in (control.CONDUCTOR_SOCKET, control.COUNTERS_FILE, control.SENDER_DOORBELL,
                 control.RECEIVER_DOORBELL):
        assert modes[name] == ("0o660", gid), name
    for name in (control.LOCK_FILE, "loss-report.dat"):
        assert modes[name] == ("0o640", gid), name
    logs = [name for name in modes if name.endswith(".logbuffer")]
    assert logs and all(modes[name] == ("0o660", gid) for name in logs), modes


def test_the_services_directory_and_files_are_the_groups_and_no_one_elses(
        accounts: Accounts, installed_venv, group_driver: Path) -> None:
    """The driver's own group is the client group, as under the unit: no setgid bit and no
    change of group is needed (the unit refuses both)."""
    modes = _modes_with_a_log(accounts, installed_venv, group_driver)
    _assert_the_groups(modes, accounts.gid, control.SHARED_DIRECTORY_MODE)


def test_a_client_group_that_is_not_the_drivers_own_is_given_its_files_by_setgid(
        accounts: Accounts, installed_venv, driver_dir: Path) -> None:
    """A driver whose user has the group as a supplementary group only: its directories are
    setgid, so what it makes in them is the group's, not its own primary group's."""
    with _driver_of(accounts.supplementary, accounts.group, installed_venv,
                    driver_dir) as directory:
        modes = _modes_with_a_log(accounts, installed_venv, directory)
    _assert_the_groups(modes, accounts.gid, control.SHARED_DIRECTORY_MODE | stat.S_ISGID)


def test_a_member_cannot_add_remove_or_link_a_name_in_the_drivers_directory(
        accounts: Accounts, installed_venv, group_driver: Path) -> None:
    """The group may read and enter the directory, never write it: no member can plant a
    link the driver would follow or remove, or take away another member's files."""
    probe = textwrap.dedent("""
        import os, sys
        d = sys.argv[1]
        tries = {
            "link": lambda: os.symlink("/etc/shadow", os.path.join(d, "errors.json.tmp")),
            "file": lambda: open(os.path.join(d, "publications", "1.logbuffer"), "x"),
            "unlink": lambda: os.unlink(os.path.join(d, "counters.dat")),
            "rename": lambda: os.rename(os.path.join(d, "driver.lock"),
                                        os.path.join(d, "x")),
            "rmdir": lambda: os.rmdir(os.path.join(d, "images")),
        }
        for name, attempt in tries.items():
            try:
                attempt()
                print(name, "done")
            except PermissionError:
                print(name, "refused")
    """)
    result = subprocess.run([*_as(accounts.primary),
                             str(installed_venv.python), "-c", probe, str(group_driver)],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert result.stdout.split("\n")[:-1] == [
        f"{name} refused" for name in ("link", "file", "unlink", "rename", "rmdir")], (
        result.stdout + result.stderr)


def test_stat_of_a_member_reads_the_services_driver(
        accounts: Accounts, installed_venv, group_driver: Path) -> None:
    """`slipstream stat` under a member's uid: the counters, the loss report and the error
    log are the group's to read."""
    result = subprocess.run([*_as(accounts.supplementary),
                             str(installed_venv.slipstream), "stat", "--dir", str(group_driver),
                             "--once", "--json"], capture_output=True, text=True, timeout=60,
                            cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["driver_running"] is True


def test_a_user_outside_the_group_is_told_which_group_and_how_to_join(
        accounts: Accounts, installed_venv, group_driver: Path) -> None:
    answer = _answer(_client(installed_venv, accounts.outsider, "connect", group_driver,
                             "aeron:ipc", 0))
    assert answer["error"] == "DriverError", answer
    message = answer["message"]
    assert f"serves {accounts.service} " in message, message
    assert f"members of group {accounts.group} (gid {accounts.gid})" in message, message
    assert f"sudo usermod -aG {accounts.group} {accounts.outsider}" in message, message


def test_a_member_whose_process_lacks_the_group_is_told_to_log_in_again(
        accounts: Accounts, installed_venv, group_driver: Path) -> None:
    """Listed in the group database, but started without the group (before it joined): the
    error says so, not that it is no member."""
    import pwd

    user = pwd.getpwnam(accounts.supplementary)
    prefix = ("setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups")
    answer = _answer(_client(installed_venv, accounts.supplementary, "connect", group_driver,
                             "aeron:ipc", 0, prefix=prefix))
    assert answer["error"] == "DriverError", answer
    assert "is a member, but this process does not hold the group" in answer["message"], (
        answer)
    assert f"`sg {accounts.group}`" in answer["message"], answer


def test_a_driver_refuses_a_client_group_it_is_not_in_or_that_does_not_exist(
        accounts: Accounts, installed_venv, driver_dir: Path) -> None:
    """It could not give its files to the group: the error names the key, before anything
    is made."""
    for user, group, expected in (
            (accounts.outsider, accounts.group, f"not in group {accounts.group}"),
            (accounts.service, f"nosuchgroup{uuid.uuid4().hex[:6]}", "is not a group")):
        result = subprocess.run([*_as(user), str(installed_venv.slipstream),
                                 "driver", "--dir", str(driver_dir),
                                 f"--set=client_group={group}"],
                                capture_output=True, text=True, timeout=60, cwd="/")
        assert result.returncode == 2, result.stderr
        assert "client_group" in result.stderr and expected in result.stderr, result.stderr
        assert not driver_dir.exists()


def test_without_a_client_group_the_directory_stays_its_users_alone(
        accounts: Accounts, installed_venv, driver_dir: Path) -> None:
    """The setting's absence is today's driver: 0700, 0600 files, and a member of the
    service user's group is refused as any other user."""
    process = subprocess.Popen([*_as(accounts.service),
                                str(installed_venv.slipstream), "driver", "--dir",
                                str(driver_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (driver_dir / control.CONDUCTOR_SOCKET).exists(), timeout=30,
                 what="the driver")
        assert driver_dir.stat().st_mode & 0o7777 == control.PRIVATE_DIRECTORY_MODE

        def modes() -> set[str]:
            return {oct(path.lstat().st_mode & 0o777) for path in driver_dir.iterdir()
                    if path.is_file() or path.is_socket()}

        # The socket is bound, then given its mode: what it settles at.
        wait_for(lambda: modes() == {"0o600"}, what=f"0600 files (found {modes()})")
        answer = _answer(_client(installed_venv, accounts.primary, "connect", driver_dir,
                                 "aeron:ipc", 0))
        assert answer["error"] == "DriverError", answer
        assert "a driver serves only its own user's processes" in answer["message"], answer
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(30) == 0
        finally:
            process.kill()
            process.wait()
