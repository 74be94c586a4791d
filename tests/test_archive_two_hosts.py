"""Two archives, no single copy, on namespace hosts (docs/ARCHIVE.md, "Two archives"): host 1
publishes by dynamic MDC to hosts 2 and 3, each running ``slipstream-archive run`` (a real
process) beside its driver (a real process), each recording the stream.  Archive 3 is killed
(-9) mid-stream and restarted after more than a term was published: it catches up from
archive 2.  A replay merge on host 1 reading from archive 2 fails over to archive 3 when
archive 2 is killed mid-replay.  Afterwards archive 3 alone serves the whole session."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, message, wait_for
from test_archive import archive_process, publish, size_of, wait_for_recording
from test_archive_replication import (
    archive_config,
    check_whole_messages,
    checksum,
    read_pieces,
    whole_at,
)

from slipstream.archive import ArchiveClient, EndReason, MergeState, ReplayMerge, locate
from slipstream.client import Client

pytestmark = pytest.mark.timeout(300)

CONTROL_PORT = 40311  # each archive's, on its own host
MDC_CONTROL_PORT = 40312  # the publisher's, on host 1
LIVE_PORT = 40313  # each subscriber's, on its own host
MERGE_PORT = 40314  # the merging reader's live endpoint on host 1
STREAM = 60
CONTROL_STREAM = 10
TERM = 64 * 1024
#: Host 1's MDC publication: receivers join by their status messages; the slowest holds it
#: (min), a receiver silent for 1 s no longer does (an archive killed).
PUBLICATION_CHANNEL = ("aeron:udp?control={one}:" + str(MDC_CONTROL_PORT) +
                       "|control-mode=dynamic|fc=min,t:1s")


def archive_on(hosts, index: int, config: Path, log_path: Path):
    """``slipstream-archive run`` inside host ``index`` (killed, -9, if still running at the
    end)."""
    return archive_process(config, log_path, hosts[index].prefix())


def subscriber(hosts, index: int, port: int = LIVE_PORT) -> str:
    """Host ``index``'s subscription to the MDC stream of host 1."""
    return (f"aeron:udp?endpoint={hosts[index].address}:{port}"
            f"|control={hosts[1].address}:{MDC_CONTROL_PORT}")


def two_archives(hosts, tmp_path: Path, drivers: dict, peered: tuple[int, ...]
                 ) -> tuple[dict[int, Path], dict[int, Path], dict[int, Path]]:
    """The settings of archives on hosts 2 and 3, each recording its subscription to the
    stream; those in ``peered`` take the other as their peer.  Returns their settings files,
    directories and logs, by host."""
    configs = {}
    for index, other in ((2, 3), (3, 2)):
        configs[index] = archive_config(
            tmp_path / f"archive{index}.toml", tmp_path / f"archive{index}",
            drivers[index].directory, CONTROL_PORT, [(subscriber(hosts, index), STREAM,
                                                      "remote")],
            peers=[f"{hosts[other].address}:{CONTROL_PORT}"] if index in peered else [],
            address=hosts[index].address)
    return (configs, {i: tmp_path / f"archive{i}" for i in (2, 3)},
            {i: tmp_path / f"archive{i}.log" for i in (2, 3)})


def start_stream(local: Client, one: str, dirs: dict[int, Path]):
    """Host 1's publication, once both archives record it: ``(publication, session id,
    framing)``."""
    publication = local.add_publication(PUBLICATION_CHANNEL.format(one=one), STREAM)
    for index in (2, 3):
        wait_for_recording(dirs[index], timeout=30)
    return publication, publication.session_id, (publication.initial_term_id,
                                                 publication.term_length)


def kill(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_archives_on_two_hosts_catch_up_and_serve_a_reader_that_fails_over(
        hosts, tmp_path: Path) -> None:
    """MDC from host 1 (64k terms, 128k segments, fragmented messages) recorded on hosts 2
    and 3.  Archive 3 killed after 900 messages, 300 more (over a term) published, archive 3
    restarted: it records the stream again and fetches what it missed from archive 2.  A
    replay merge on host 1 from position 0, given archives 2 and 3, is 500 messages in when
    archive 2 is killed: it fails over to archive 3 and goes live, every message once, in
    order, at its position.  After the publisher's close archive 3 alone (archive 2 dead)
    holds the whole session: read piece by piece, every message once, in order,
    checksummed."""
    drivers = {i: hosts.start_driver(i, **NETWORK_SETTINGS) for i in (1, 2, 3)}
    one = hosts[1].address
    configs, dirs, logs = two_archives(hosts, tmp_path, drivers, peered=(2, 3))
    total = 1800
    with Client.connect(drivers[1].directory) as local, \
            archive_on(hosts, 2, configs[2], logs[2]) as archive2:
        archive3_run = archive_on(hosts, 3, configs[3], logs[3])
        archive3 = archive3_run.__enter__()
        try:
            publication, session_id, framing = start_stream(local, one, dirs)
            positions = publish(publication, 900)
            kill(archive3)
            archive3_run.__exit__(None, None, None)
            down_at = positions[-1]
            positions += publish(publication, 300, first=900)
            assert positions[-1] - down_at > TERM
            archive3_run = archive_on(hosts, 3, configs[3], logs[3])
            archive3 = archive3_run.__enter__()
            rejoined = wait_for_recording(dirs[3], index=1, timeout=30)
            assert rejoined.session_id == session_id and rejoined.start_position > down_at
            with ArchiveClient(local, hosts[2].address, CONTROL_PORT, CONTROL_STREAM,
                               timeout_s=2, reply_address=one) as at2, \
                    ArchiveClient(local, hosts[3].address, CONTROL_PORT, CONTROL_STREAM,
                                  timeout_s=2, reply_address=one) as at3:

                def caught_up() -> bool:
                    pieces = locate([at3], STREAM, session_id, framing, 0, None)
                    return bool(pieces) and pieces[0].start == 0 and all(
                        a.end == b.start for a, b in itertools.pairwise(pieces)) \
                        and pieces[-1].end >= rejoined.start_position
                wait_for(caught_up, timeout=60, what="archive 3 caught up from archive 2")

                # A late reader on host 1 merges from archive 2, which dies mid-replay.
                live = local.add_subscription(subscriber(hosts, 1, MERGE_PORT), STREAM)
                recording = at2.list_recordings(stream_id=STREAM, session_id=session_id)[0]
                merge = ReplayMerge([at2, at3], live, recording.recording_id, 0,
                                    stall_timeout_s=5)
                merged: list[tuple[bytes, int]] = []

                def take(data: memoryview, header) -> None:
                    merged.append((bytes(data), header.position))

                deadline = time.monotonic() + 120
                while len(merged) < 500:
                    assert time.monotonic() < deadline, f"merged {len(merged)}, {merge.state}"
                    if merge.poll(take, 20) == 0:
                        time.sleep(0.001)
                assert merge.state is MergeState.CATCHING_UP and merge.archive is at2
                kill(archive2)
                sent = len(positions)
                while len(merged) < total:
                    assert time.monotonic() < deadline, (f"merged {len(merged)} of {total}, "
                                                        f"{merge.state}")
                    while sent < total:  # on while the merge catches up: it joins live
                        result = publication.offer(message(sent, size_of(sent)))
                        if result < 0:
                            break
                        positions.append(result)
                        sent += 1
                    if merge.poll(take, 256) == 0:
                        time.sleep(0.001)
                assert merge.failovers >= 1 and merge.is_live
                merge.close()
                publication.close()
                stop = positions[-1]
                wait_for(lambda: whole_at(at3, STREAM, session_id, framing, 0, stop),
                         timeout=30, what="archive 3 holds the whole session")
                pieces = locate([at2, at3], STREAM, session_id, framing, 0, None)
                listed = {r.recording_id: r.descriptor for r in at3.list_recordings()}
                got = read_pieces(pieces, {at3.archive: at3})
        finally:
            archive3_run.__exit__(None, None, None)
    want = [(message(seq, size_of(seq)), p) for seq, p in enumerate(positions)]
    assert merged == want, "the merged reader"
    assert got == want, "archive 3 alone"
    assert checksum(got) == checksum(want)
    assert {p.archive for p in pieces} == {at3.archive}  # archive 2 no longer answers
    replicas = [listed[p.recording_id] for p in pieces
                if listed[p.recording_id].source_identity.startswith("replica of ")]
    assert replicas, pieces
    for replica in replicas:  # whole messages at the seams with archive 3's own recordings
        check_whole_messages(replica, dirs[3])
    assert listed[pieces[0].recording_id].end_reason is EndReason.RECOVERED
    assert listed[pieces[-1].recording_id].end_reason is EndReason.END_OF_STREAM


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_a_fetch_the_peers_death_cuts_keeps_what_came_and_fetches_the_rest_later(
        hosts, tmp_path: Path) -> None:
    """Archive 3 misses 1600 messages (about 2 MB); its fetch from archive 2 runs over a link
    held to 8 Mbit/s, and archive 2 is killed (-9) mid-fetch.  The replica stops where its
    replay ended, *stopped*, short of the range; archive 2 restarted (recovered), archive 3
    fetches the rest into a second replica, and then alone serves the whole session, every
    message once, in order."""
    drivers = {i: hosts.start_driver(i, **NETWORK_SETTINGS) for i in (1, 2, 3)}
    one = hosts[1].address
    configs, dirs, logs = two_archives(hosts, tmp_path, drivers, peered=(3,))
    runs = {i: archive_on(hosts, i, configs[i], logs[i]) for i in (2, 3)}
    processes = {i: runs[i].__enter__() for i in (2, 3)}
    try:
        with Client.connect(drivers[1].directory) as local:
            publication, session_id, framing = start_stream(local, one, dirs)
            positions = publish(publication, 200)
            kill(processes[3])
            positions += publish(publication, 1600, first=200)
            hosts.rate_limit(2, mbit=8)  # what host 2 sends: the fetch, about 1 MB/s
            runs[3] = archive_on(hosts, 3, configs[3], logs[3])
            processes[3] = runs[3].__enter__()
            wait_for_recording(dirs[3], index=1, timeout=30)
            with ArchiveClient(local, hosts[3].address, CONTROL_PORT, CONTROL_STREAM,
                               timeout_s=2, reply_address=one) as at3:

                def replicas() -> list:
                    return [r for r in at3.list_recordings(stream_id=STREAM)
                            if r.descriptor.source_identity.startswith("replica of ")]

                wait_for(lambda: any(r.recorded_position - r.descriptor.start_position
                                     > 256 * 1024 for r in replicas()),
                         timeout=30, what="a quarter MB fetched")
                kill(processes[2])
                cut = wait_for_recording(dirs[3], index=2, timeout=30, ended=True)
                fetching_to = rejoined_at = wait_for_recording(dirs[3], index=1).start_position
                assert cut.end_reason is EndReason.STOPPED
                assert cut.stop_position < fetching_to, "the fetch was not cut short"
                hosts[2].run("tc", "qdisc", "del", "dev", hosts[2].veth, "root")
                runs[2].__exit__(None, None, None)
                runs[2] = archive_on(hosts, 2, configs[2], logs[2])
                processes[2] = runs[2].__enter__()
                positions += publish(publication, 200, first=1800)
                publication.close()
                stop = positions[-1]
                wait_for(lambda: whole_at(at3, STREAM, session_id, framing, 0, stop),
                         timeout=60, what="archive 3 holds the whole session")
                kill(processes[2])
                pieces = locate([at3], STREAM, session_id, framing, 0, None)
                got = read_pieces(pieces, {at3.archive: at3})
                fetched = [r.descriptor for r in replicas()]
    finally:
        for run in runs.values():
            run.__exit__(None, None, None)
    assert got == [(message(seq, size_of(seq)), p) for seq, p in enumerate(positions)]
    assert len(fetched) == 2, fetched
    first, second = fetched
    # The second goes on where the first stopped (from the start of a message it cut).
    assert first.start_position < second.start_position <= first.stop_position
    assert second.stop_position >= rejoined_at
