"""The multi-host Spark harness (:mod:`spark_cluster`) on isolated namespace hosts: a real
standalone cluster whose executors run on hosts that each have their own /dev/shm, hostname
and slipstream driver, as on separate machines.

The tests share one cluster on four hosts (:func:`cluster_hosts`: it starts once, in 10-20 s
on 2 cores, more on a busy machine); each test has fresh slipstream drivers on the hosts, and
finds the cluster whole (a worker a test lost is started again first) and without the faults
an earlier test set.

Needs root (namespace hosts), nsenter and unshare, pyspark and Java 17+: without them the
tests skip, under CI=true they fail.  The first test takes 40-70 s on 2 cores, most of it
Spark's JVMs starting.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import lacking, start_holding_archive

from slipstream.client.holder import HOLDER_PORT

pytestmark = pytest.mark.timeout(300)

#: The task: where it ran, what its /dev/shm holds, and which driver (by pid) a client
#: connected to its host's default directory finds.
APPLICATION = """
    import json
    import os
    import socket
    import sys

    from pyspark.sql import SparkSession

    directory = sys.argv[1]

    def probe(index):
        from slipstream.client import Client
        from slipstream.client.counters import CountersFile

        try:
            with Client.connect(directory):
                counters = CountersFile(os.path.join(directory, "counters.dat"), writable=False)
                try:
                    driver = counters.driver_pid
                finally:
                    counters.close()
        except Exception as error:  # reported, not raised: the test says what it expected
            driver = f"{type(error).__name__}: {error}"
        return {"partition": index, "hostname": socket.gethostname(),
                "shm": sorted(os.listdir("/dev/shm")), "driver": driver}

    spark = SparkSession.builder.appName("harness-probe").getOrCreate()
    tasks = spark.sparkContext.parallelize(range(8), 8).map(probe).collect()
    print("RESULT", json.dumps({"hostname": socket.gethostname(), "tasks": tasks}))
    spark.stop()
"""


def need_a_cluster() -> None:
    """Isolated hosts and a Spark cluster can run here: skips without, fails under CI=true."""
    from spark_cluster import unavailable

    missing = [tool for tool in ("nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        lacking(f"isolated test hosts need {' and '.join(missing)} (util-linux)")
    problem = unavailable()
    if problem is not None:
        lacking(f"a Spark cluster: {problem}")


#: Every worker offers 2 cores (a cluster-mode driver needs one beside an executor); a
#: client-mode application takes 2, which the master spreads: one 1-core executor per worker.
ONE_EXECUTOR_PER_WORKER = {"spark.cores.max": "2"}


@pytest.fixture(scope="module")
def cluster_hosts(tmp_path_factory):  # -> Iterator[tuple[NamespaceHosts, SparkCluster]]
    """Four isolated hosts and the module's standalone cluster on them: the master on host 1,
    a worker of 2 cores and 2 GiB on hosts 2 and 3; host 4 has no Spark process.  Stopped
    and removed after the module's last test."""
    from spark_cluster import spark_cluster

    from slipstream.sim.real import hosts as namespace

    problem = namespace.unavailable()
    if problem is not None:
        lacking(f"test hosts: {problem}")
    need_a_cluster()
    with namespace.NamespaceHosts(4, isolated=True) as hosts, \
            spark_cluster(hosts, tmp_path_factory.mktemp("spark-cluster"), master=1,
                          workers=(2, 3), worker_cores=2, worker_memory="2g") as cluster:
        yield hosts, cluster


@pytest.fixture
def cluster(cluster_hosts):  # -> Iterator[tuple[NamespaceHosts, SparkCluster, dict]]
    """The module's hosts and cluster, with both workers registered (a worker an earlier test
    lost is started again) and no application of an earlier test left (its supervised
    drivers, executors and Python workers killed), and a fresh slipstream driver on each of
    the four hosts, in the default directory (by host): the drivers are stopped after the
    test, and the faults it set on the hosts removed."""
    hosts, spark = cluster_hosts
    spark.clear_applications()  # what an earlier test left, failed or not
    spark.restart_lost_workers()
    # The four start at once: each is a Python process importing the driver, seconds on a
    # busy machine.
    with ThreadPoolExecutor(4) as pool:
        starts = {i: pool.submit(hosts.start_driver, i, client_liveness_timeout="5s")
                  for i in (1, 2, 3, 4)}
    drivers = {i: start.result() for i, start in starts.items() if not start.exception()}
    try:
        for start in starts.values():
            start.result()  # the first that failed, after the others are in ``drivers``
        yield hosts, spark, drivers
    finally:
        def stop(driver) -> None:
            with contextlib.suppress(Exception):
                driver.stop()

        with ThreadPoolExecutor(4) as pool:
            pool.map(stop, drivers.values())
        for i in (1, 2, 3, 4):
            hosts.clear_faults(i)


def test_tasks_run_on_both_worker_hosts_each_beside_its_own_driver(cluster) -> None:
    hosts, spark, drivers = cluster
    # One path, four drivers: each host has its own /dev/shm.
    assert len({str(d.directory) for d in drivers.values()}) == 1
    directory = str(drivers[1].directory)
    for i in (1, 2, 3):
        hosts[i].run("touch", f"/dev/shm/marker-{i}")
    try:
        result = spark.run_app(APPLICATION, directory, host=1, conf=ONE_EXECUTOR_PER_WORKER,
                               timeout=240).result()
    finally:
        for i in (1, 2, 3):
            hosts[i].run("rm", "-f", f"/dev/shm/marker-{i}", check=False)

    assert result["hostname"] == hosts[1].hostname  # the application ran on host 1
    tasks = result["tasks"]
    assert sorted(t["partition"] for t in tasks) == list(range(8))
    by_host = {i: [t for t in tasks if t["hostname"] == hosts[i].hostname] for i in (1, 2, 3)}
    assert not by_host[1], f"no executor runs on the master's host: {tasks}"
    assert by_host[2] and by_host[3], f"tasks ran on both worker hosts: {tasks}"
    assert len(by_host[2]) + len(by_host[3]) == 8, f"every task on a worker host: {tasks}"
    for i in (2, 3):
        for task in by_host[i]:
            # Its own host's driver, behind the same path on every host, and in its /dev/shm
            # nothing of the other hosts' or of the machine's.
            assert task["driver"] == drivers[i].pid, task
            assert task["shm"] == sorted([f"marker-{i}", drivers[i].directory.name]), task


# -- reading on a cluster --------------------------------------------------------------------
#
# Host 1: the Spark master and a client-mode application whose streaming query reads a stream
# published to host 1 (its driver holds the query's subscription and the log: the holder);
# hosts 2 and 3: a worker each, so every read task runs on a host whose driver does not hold
# the log; host 4: the publisher, and a client receiving what the query writes.  Every host has
# its own /dev/shm, hostname and slipstream driver.

DATA_PORT = 40456
OUT_PORT = 40457
WINDOW = 128 * 1024  # the receiver window of the default settings
PAYLOAD = 1000
#: Receiver windows the stream spans: each is at least one micro-batch, about 4 s of a loaded
#: 2-core machine here, so ``make test`` runs a short length; SLIPSTREAM_CLUSTER_WINDOWS=51
#: is the full one (about 8 minutes).
WINDOWS = int(os.environ.get("SLIPSTREAM_CLUSTER_WINDOWS", "12"))
MESSAGES = WINDOWS * WINDOW // (PAYLOAD + 32 + 24)  # 1056-byte frames

#: Host 4: subscribes to the query's output, publishes MESSAGES to host 1 once the query's
#: subscription is there (message i stamped i+1 s after the epoch), then receives until every
#: input message came back (deduplicated by its input position: the writer is at least once)
#: or the time is up, and prints what it got.
HOST_4 = """
import json, sys, time
from collections import Counter
from slipstream.client import Client

data, out, progress = sys.argv[1], sys.argv[2], sys.argv[5]
count, size = int(sys.argv[3]), int(sys.argv[4])
received, firsts, keys = [], {}, set()

sources = {}

def take(payload, header):
    text = bytes(payload).decode()
    value, position, stamp, partition = text.split("|")
    if header.session_id not in sources:  # the host whose driver sent it: the task's
        sources.update((image.session_id, image.source_identity.split(":")[0])
                       for image in output.images)
    sender = sources[header.session_id]
    received.append((value, position, sender, stamp))
    if position not in keys:  # a first occurrence, by (output session, task's partition)
        keys.add(position)
        firsts.setdefault((header.session_id, partition), []).append(int(position))

with Client.connect() as client:
    output = client.add_subscription(out, 11)
    publication = client.add_publication(data, 10)
    deadline = time.monotonic() + 300
    while not publication.is_connected:
        assert time.monotonic() < deadline, "no subscriber came"
        time.sleep(0.05)
    reported = time.monotonic()
    for i in range(count):
        message = f"m{i:08d}".encode().ljust(size, b".")
        while publication.offer(message, reserved_value=(i + 1) * 1_000_000_000) < 0:
            output.poll(take, 256)
            time.sleep(0.0002)
            if time.monotonic() - reported > 0.2:
                with open(progress, "w") as f:
                    f.write(str(len(keys)))
                reported = time.monotonic()
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if not output.poll(take, 256):
            if len(keys) >= count:
                break
            with open(progress, "w") as f:
                f.write(str(len(keys)))
            time.sleep(0.05)
rows = received
expected = {f"m{i:08d}".ljust(size, ".") for i in range(count)}
got = {row[0] for row in rows}
print("RESULT", json.dumps({
    "received": len(rows), "distinct": len(keys),
    "missing": sorted(expected - got)[:5], "unexpected": sorted(got - expected)[:5],
    "hosts": Counter(row[2] for row in rows),
    "stamps": all(float(row[3]) == int(row[0][1:9]) + 1 for row in rows),
    "in_order": all(p == sorted(p) for p in firsts.values()),
    "sessions": len({session for session, _ in firsts})}))
"""

#: The query on host 1: reads with minPartitions=2 (tasks on both executors in a micro-batch),
#: writes value|position|timestamp|partition to host 4 (through the driver of the host the
#: task ran on: the output image's source address says which).  At a third of the input the
#: test kills host 3's executor (the file ``kill`` appears); at two thirds the query is stopped
#: and started again from its checkpoint; it ends once host 4 has everything.
QUERY = """
import json, os, sys, time
from pyspark.sql import SparkSession, functions as F
from slipstream.spark_bridge import register

data, out, count, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
spark = SparkSession.builder.appName("slipstream-cluster-read").getOrCreate()
register(spark)
def start():
    rows = (spark.readStream.format("slipstream").option("channel", data)
            .option("streamId", "10").option("minPartitions", "2").load())
    return (rows.select(F.concat_ws("|", F.col("value").cast("string"),
                                    F.col("position").cast("string"),
                                    F.col("timestamp").cast("double").cast("string"),
                                    F.spark_partition_id().cast("string"))
                        .alias("value"))
            .writeStream.format("slipstream").option("channel", out).option("streamId", "11")
            .option("checkpointLocation", os.path.join(work, "checkpoint")).start())

def read_so_far(query, seen):
    for progress in query.recentProgress:
        seen[(query.runId, progress["batchId"])] = progress["numInputRows"]
    return sum(seen.values())

from slipstream.client import Client

client = Client.connect()
seen, restarts, events, bystander = {}, 0, [], None
query = start()
deadline = time.monotonic() + 450
while time.monotonic() < deadline:
    if query.exception() is not None:
        raise query.exception()
    total = read_so_far(query, seen)
    if total >= count // 3 and not os.path.exists(os.path.join(work, "kill")):
        open(os.path.join(work, "kill"), "w").close()
        events.append(["kill", total])
    if total >= 2 * count // 3 and not restarts:
        # While the query is down, a subscription on this host keeps the stream's image (a
        # UDP image goes with its last subscriber, and what it held with it): docs/SPARK.md.
        bystander = client.add_subscription(data, 10)
        while not bystander.images:
            time.sleep(0.01)
        query.stop()
        events.append(["restart", total])
        restarts += 1
        query = start()
    if restarts and bystander is not None and len(query.recentProgress) > 2:
        bystander.close()  # the restarted query holds the stream from here
        bystander = None
    if os.path.exists(os.path.join(work, "done")):
        break
    print("read", total, "events", events, file=sys.stderr, flush=True)
    time.sleep(0.2)
query.stop()
client.close()
print("RESULT", json.dumps({"events": events, "read": read_so_far(query, seen)}))
spark.stop()
"""


@pytest.mark.timeout(900)
def test_a_query_reads_on_hosts_without_the_log_exactly_once_through_a_lost_worker_and_a_restart(
        cluster, tmp_path) -> None:
    """Host 4 publishes WINDOWS receiver windows to a query on host 1 (3 % of the datagrams into
    host 1 dropped) whose read tasks all run on hosts 2 and 3, which get their ranges replayed
    by the query's holder on host 1 (3 % of the replay datagrams into host 2 dropped); the
    query writes each row, with where its task ran, to a client on host 4.  Host 3's executor
    is killed a third of the way in (its tasks rerun), the query is stopped and restarted from
    its checkpoint at two thirds (a subscription on host 1 keeping the image meanwhile, as
    docs/SPARK.md says a restart needs).  Every message arrives, once per input position after
    deduplication (the writer is at least once), in order per output session, read on both
    worker hosts, with the publisher's timestamps."""
    from spark_cluster import host_processes

    hosts, spark, _drivers = cluster
    hosts.drop(1, port=DATA_PORT, probability=0.03)
    hosts.drop(2, port=40190, probability=0.03)  # replays into host 2 (replayPort)
    data = f"aeron:udp?endpoint={hosts[1].address}:{DATA_PORT}"
    out = f"aeron:udp?endpoint={hosts[4].address}:{OUT_PORT}"
    progress = tmp_path / "received"
    host_4 = hosts[4].popen(sys.executable, "-c", HOST_4, data, out, str(MESSAGES),
                            str(PAYLOAD), str(progress), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    outputs: list[tuple[str, str]] = []

    def collect_host_4() -> None:  # its output as it ends (a full pipe would block it)
        outputs.append(host_4.communicate())
        (tmp_path / "done").touch()  # the query stops

    done_watch = threading.Thread(target=collect_host_4)
    done_watch.start()
    killer_stop = threading.Event()
    killed: list[float] = []

    def kill_host_3s_executor_when_asked() -> None:
        while not killer_stop.wait(0.1):
            if (tmp_path / "kill").exists():
                for pid, command in host_processes(hosts[3]):
                    if b"CoarseGrainedExecutorBackend" in command:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                return

    killer = threading.Thread(target=kill_host_3s_executor_when_asked)
    killer.start()
    try:
        query = spark.run_app(QUERY, data, out, str(MESSAGES), str(tmp_path), host=1,
                              conf=ONE_EXECUTOR_PER_WORKER, timeout=600).result()
    finally:
        killer_stop.set()
        killer.join()
        try:
            host_4.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host_4.kill()
        done_watch.join(30)
    stdout, stderr = outputs[0] if outputs else ("", "host 4 gave no output")
    got = next((json.loads(line.removeprefix("RESULT "))
                for line in stdout.splitlines() if line.startswith("RESULT ")), None)
    assert got is not None, f"host 4: {stdout} {stderr}"
    assert [event[0] for event in query["events"]] == ["kill", "restart"], query
    assert killed, "host 3's executor was killed"
    assert got["distinct"] == MESSAGES, (got["received"], got["distinct"], query)
    assert not got["missing"] and not got["unexpected"], got
    assert got["in_order"], "each task's rows arrive in input order"
    assert set(got["hosts"]) == {hosts[2].address, hosts[3].address}, got["hosts"]
    assert got["stamps"], "timestamp is the publisher's reserved value, through the replay"


# -- cluster deploy mode: an ingest host ------------------------------------------------------
#
# Host 1: the Spark master, the submitter, the publisher (to host 4) and the client that
# receives what the query writes; hosts 2 and 3: a worker each, one of which the master picks
# for the Spark driver; host 4: the ingest host, its slipstream driver and its archive, which
# holds the stream for the query (its control stream at HOLDER_PORT: the holder option's
# default port).

#: The query, submitted in cluster deploy mode with --supervise: it reads through the ingest
#: host's holder and writes as the client-mode query does, until the file ``done`` appears.
#: Each launch prints where it runs and the first batch it ran (a launch that resumed from the
#: checkpoint starts past 0).
CLUSTER_QUERY = """
import json, os, socket, sys, time
from pyspark.sql import SparkSession, functions as F
from slipstream.spark_bridge import register

data, out, holder, work = sys.argv[1:5]
spark = SparkSession.builder.appName("slipstream-cluster-mode").getOrCreate()
register(spark)
print("LAUNCH", json.dumps({"host": socket.gethostname(),
                            "mode": spark.conf.get("spark.submit.deployMode")}), flush=True)
rows = (spark.readStream.format("slipstream").option("channel", data).option("streamId", "10")
        .option("holder", holder).option("minPartitions", "2").load())
query = (rows.select(F.concat_ws("|", F.col("value").cast("string"),
                                 F.col("position").cast("string"),
                                 F.col("timestamp").cast("double").cast("string"),
                                 F.spark_partition_id().cast("string")).alias("value"))
         .writeStream.format("slipstream").option("channel", out).option("streamId", "11")
         .option("checkpointLocation", os.path.join(work, "checkpoint")).start())
while not os.path.exists(os.path.join(work, "done")):
    if query.exception() is not None:
        raise query.exception()
    time.sleep(0.2)
batches = [progress["batchId"] for progress in query.recentProgress]
query.stop()
print("RESULT", json.dumps({"host": socket.gethostname(), "first_batch": min(batches)}),
      flush=True)
spark.stop()
"""


def ingest_archive(hosts: Any, data: str, tmp_path: Path) -> subprocess.Popen[str]:
    """The ingest host 4's archive (``slipstream-archive run``), holding stream 10 of
    ``data`` from its start for the queries' group, its control stream at host 4's address
    and the ``holder`` option's default port."""
    return start_holding_archive(
        None, hosts[4].address, HOLDER_PORT, tmp_path / "ingest-archive",
        holds=((data, 10),),
        popen=lambda *command: hosts[4].popen(*command, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))


@pytest.mark.timeout(900)
def test_cluster_deploy_mode_reads_through_the_ingest_holder_exactly_once_when_the_driver_moves(
        cluster, tmp_path) -> None:
    """Host 1 publishes WINDOWS receiver windows to the ingest host 4, whose archive holds the
    stream from its start; the query runs in cluster deploy mode with --supervise,
    its Spark driver on a worker host the master picks, and finds the holder by its
    ``holder`` option.  A third of the way in, that worker host's Spark dies (worker, driver,
    executor: SIGKILL); the master starts the driver again on the other worker host, which
    resumes from the checkpoint.  Every message reaches host 1's client, once per input
    position after deduplication, in order per output session, with the publisher's
    timestamps; the publisher never waited for more than the holder's window while the
    query was gone."""
    hosts, spark, _drivers = cluster
    data = f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}"
    out = f"aeron:udp?endpoint={hosts[1].address}:{OUT_PORT}"
    holder = ingest_archive(hosts, data, tmp_path)
    progress = tmp_path / "received"
    client = hosts[1].popen(sys.executable, "-c", HOST_4, data, out, str(MESSAGES),
                            str(PAYLOAD), str(progress), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    outputs: list[tuple[str, str]] = []

    def collect_client() -> None:
        outputs.append(client.communicate())
        (tmp_path / "done").touch()  # the query stops

    watch = threading.Thread(target=collect_client)
    watch.start()
    lost: list[int] = []
    try:
        first = spark.submit(CLUSTER_QUERY, data, out, hosts[4].address, str(tmp_path),
                             conf={"spark.cores.max": "2"})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not lost:
            received = int(progress.read_text() or 0) if progress.exists() else 0
            runs = spark.driver_outputs()
            if received >= MESSAGES // 3 and first in runs:
                lost = [runs[first][0]]  # the host of the first launch
                assert spark.lose_host(lost[0])
            time.sleep(0.2)
        assert lost, f"the first third never arrived:\n{spark.report()}"
        while time.monotonic() < deadline:
            runs = spark.driver_outputs()
            if any("RESULT " in text for _, text in runs.values()):
                break
            time.sleep(0.5)
        runs = spark.driver_outputs()
        report = spark.report()
    finally:
        try:
            client.wait(timeout=120)
        except subprocess.TimeoutExpired:
            client.kill()
        watch.join(30)
        holder.terminate()
        holder_log, _ = holder.communicate(timeout=30)
    launches = [(host, json.loads(line.removeprefix("LAUNCH ")))
                for host, text in runs.values() for line in text.splitlines()
                if line.startswith("LAUNCH ")]
    results = [json.loads(line.removeprefix("RESULT "))
               for _, text in runs.values() for line in text.splitlines()
               if line.startswith("RESULT ")]
    assert all(launch["mode"] == "cluster" for _, launch in launches), launches
    assert lost[0] in (2, 3) and {host for host, _ in launches} == {2, 3}, (launches, report)
    assert len(results) == 1 and results[0]["host"] == hosts[5 - lost[0]].hostname, results
    assert results[0]["first_batch"] > 0, "the second launch resumed from the checkpoint"
    stdout, stderr = outputs[0] if outputs else ("", "host 1's client gave no output")
    got = next((json.loads(line.removeprefix("RESULT "))
                for line in stdout.splitlines() if line.startswith("RESULT ")), None)
    assert got is not None, f"host 1's client: {stdout} {stderr}\n{report}"
    assert got["distinct"] == MESSAGES, (got, report)
    assert not got["missing"] and not got["unexpected"], got
    assert got["in_order"], "each task's rows arrive in input order"
    assert got["stamps"], "timestamp is the publisher's reserved value"
    assert "holding stream 10" in holder_log, holder_log


# -- the Spark driver on the ingest host; a publisher that ends -------------------------------
#
# Host 4: the ingest host (its driver and holding archive) and the client-mode application:
# its Spark driver beside the holder, its executors on hosts 2 and 3 (replays from host 4);
# host 1: two publishers (two sessions) sending to host 4, one of which ends normally halfway.

#: Host 1: two sessions on the stream to host 4; the first closes normally after ``count``
#: messages, the second goes on to ``2 * count`` and stays open until the query stopped.
#: Prints its sessions.
TWO_PUBLISHERS = """
import json, os, sys, time
from slipstream.client import Client

data, count, size, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Client.connect() as client:
    ending = client.add_exclusive_publication(data, 10)
    going = client.add_exclusive_publication(data, 10)
    print("RESULT", json.dumps({"ending": ending.session_id, "going": going.session_id}),
          flush=True)
    deadline = time.monotonic() + 300
    while not (ending.is_connected and going.is_connected):
        assert time.monotonic() < deadline, "no subscriber came"
        time.sleep(0.05)
    for i in range(2 * count):
        publication = ending if i < 2 * count // 2 and i % 2 == 0 else going
        message = f"m{i:08d}".encode().ljust(size, b".")
        while publication.offer(message) < 0:
            assert time.monotonic() < deadline, "held back for good"
            time.sleep(0.0002)
        if i == 2 * count // 2:
            ending.close()  # normally: the stream ends with its end-of-stream mark
    while not os.path.exists(os.path.join(work, "stopped")):
        assert time.monotonic() < deadline + 300, "the query never stopped"
        time.sleep(0.1)
"""

#: The query: reads through the holder, writes each batch's rows to a file named by its batch
#: id (written again when a batch runs again: idempotent), until ``expected`` distinct
#: messages starting with ``prefix`` are in (and, with ``gone``, that session left the
#: offsets), then reports what the last offsets name.
#: The sink of the query applications below: each batch's rows (the first 9 bytes of the
#: value, the session, the position) written to ``batches/<batch id>.json`` under ``work``,
#: replaced whole (idempotent: a batch run again writes the same file); ``seen`` reads them
#: back, ``last_offsets`` the checkpoint's last offsets line, ``print_result`` both as the
#: application's RESULT line.
SINK_HELPERS = """
def sink(frame, batch_id):
    rows = [[bytes(r.value[:9]).decode(), r.session_id, r.position] for r in frame.collect()]
    path = os.path.join(work, "batches", f"{batch_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(path + ".tmp", path)

def seen():
    values = []
    for path in glob.glob(os.path.join(work, "batches", "*.json")):
        with open(path) as f:
            values += [row[0] for row in json.load(f)]
    return values

def last_offsets():
    paths = glob.glob(os.path.join(work, "checkpoint", "offsets", "[0-9]*"))
    if not paths:
        return "{}"
    with open(max(paths, key=lambda path: int(os.path.basename(path)))) as f:
        return f.read().splitlines()[-1]

def print_result():
    values = seen()
    print("RESULT", json.dumps({"rows": len(values), "distinct": len(set(values)),
                                "last_offsets": last_offsets()}), flush=True)
"""


INGEST_QUERY = """
import glob, json, os, sys, time
from pyspark.sql import SparkSession
from slipstream.spark_bridge import register

data, holder, expected, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prefix, fail_on_data_loss = sys.argv[5], sys.argv[6]
gone = sys.argv[7] if len(sys.argv) > 7 else None  # a session to see leave the offsets
spark = SparkSession.builder.appName("slipstream-ingest-host").getOrCreate()
register(spark)
os.makedirs(os.path.join(work, "batches"), exist_ok=True)

""" + SINK_HELPERS + """
query = (spark.readStream.format("slipstream").option("channel", data)
         .option("streamId", "10").option("holder", holder).option("minPartitions", "2")
         .option("failOnDataLoss", fail_on_data_loss)
         .load().writeStream.foreachBatch(sink)
         .option("checkpointLocation", os.path.join(work, "checkpoint")).start())
deadline = time.monotonic() + 400
while time.monotonic() < deadline and \
        len({v for v in seen() if v.startswith(prefix)}) < expected:
    if query.exception() is not None:
        raise query.exception()
    time.sleep(0.5)

while gone is not None and f'"{gone}"' in last_offsets() and time.monotonic() < deadline:
    time.sleep(0.5)
if query.exception() is not None:
    raise query.exception()
query.stop()
open(os.path.join(work, "stopped"), "w").close()
print_result()
spark.stop()
"""


@pytest.mark.timeout(900)
def test_a_query_beside_the_ingest_holder_reads_every_message_once_as_a_publisher_ends(
        cluster, tmp_path) -> None:
    """The Spark driver on the ingest host (client mode, beside the holding archive), its read
    tasks on hosts 2 and 3; host 1 publishes two sessions to host 4, and one of them ends
    normally halfway.  The planner reaches its own host's holder, the query never fails, every
    message is read once into an idempotent sink, and the ended session leaves the offsets."""
    hosts, spark, _drivers = cluster
    data = f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}"
    holder = ingest_archive(hosts, data, tmp_path)
    count = MESSAGES // 2
    publisher = hosts[1].popen(sys.executable, "-c", TWO_PUBLISHERS, data, str(count),
                               str(PAYLOAD), str(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    published = ""
    try:
        assert publisher.stdout is not None
        published = publisher.stdout.readline()  # its sessions, printed as they are added
        assert published.startswith("RESULT "), f"host 1's publisher printed {published!r}"
        sessions = json.loads(published.removeprefix("RESULT "))
        run = spark.run_app(INGEST_QUERY, data, hosts[4].address, str(2 * count),
                            str(tmp_path), "m", "true", str(sessions["ending"]), host=4,
                            conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
        query = run.result()
    finally:
        (tmp_path / "stopped").touch()
        try:
            rest, errors = publisher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            publisher.kill()
            rest, errors = publisher.communicate()
        published += rest
        holder.terminate()
        holder_log, _ = holder.communicate(timeout=30)
    assert publisher.returncode == 0, (published, errors)
    assert query["distinct"] == query["rows"] == 2 * count, query
    last = json.loads(query["last_offsets"])
    assert str(sessions["ending"]) not in last and str(sessions["going"]) in last, query
    assert "holding stream 10" in holder_log, holder_log


#: Host 1: publishes ``prefix``-numbered messages to the ingest host until ``count`` went or
#: its driver goes (then it reports how many ``offer`` accepted), and stays open until the
#: file ``stopped``.  Writes how many went so far to ``progress``.
PUBLISHER = """
import json, os, sys, time
from slipstream.client import Client, SlipstreamError

data, count, size, work, prefix = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4], sys.argv[5])
accepted = 0
try:
    with Client.connect() as client:
        publication = client.add_exclusive_publication(data, 10)
        print("SESSION", publication.session_id, flush=True)
        while not publication.is_connected:
            time.sleep(0.05)
        for i in range(count):
            message = f"{prefix}{i:08d}".encode().ljust(size, b".")
            while publication.offer(message) < 0:
                error = client.cut_off_error()
                if error is not None:  # its driver went
                    raise error
                time.sleep(0.0002)
            accepted += 1
            if accepted % 50 == 0:
                with open(os.path.join(work, f"progress-{prefix}"), "w") as f:
                    f.write(str(accepted))
        while not os.path.exists(os.path.join(work, "stopped")):
            time.sleep(0.1)
except SlipstreamError as e:
    print("ENDED", repr(e), flush=True)
print("RESULT", json.dumps({"accepted": accepted}), flush=True)
"""


@pytest.mark.timeout(900)
def test_a_publishing_host_restarted_while_the_query_was_down_is_reported_never_silent(
        cluster, tmp_path) -> None:
    """The stream is held by the ingest host's holder; the query (client mode, on host 1)
    reads some and stops.  Host 1's publisher goes on until held back, then host 1's
    slipstream driver is killed (what its log held past the holder's window goes with it)
    and started again, and a new publisher there sends a new session.  The query, restarted
    from its checkpoint with failOnDataLoss=false, reads what the holder received of the old
    session once and in order, reports the old session as ended without its end-of-stream
    mark (a warning and a 'data loss skips' count, not silence), and reads the new session
    once."""
    from slipstream.client.counters import SystemCounter, read_system_counters

    hosts, spark, drivers = cluster
    data = f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}"
    holder = ingest_archive(hosts, data, tmp_path)
    first = hosts[1].popen(sys.executable, "-c", PUBLISHER, data, str(10 * MESSAGES),
                           str(PAYLOAD), str(tmp_path), "m", stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    second = None
    restarted = None
    first_out = first_err = ""
    try:
        spark.run_app(INGEST_QUERY, data, hosts[4].address, str(MESSAGES // 4),
                      str(tmp_path), "m", "false", host=1, conf=ONE_EXECUTOR_PER_WORKER,
                      timeout=600)
        progress = tmp_path / "progress-m"
        before, deadline = -1, time.monotonic() + 60
        while time.monotonic() < deadline:  # held back: the holder's window is full
            time.sleep(1.0)
            now = int(progress.read_text() or 0)
            if now == before:
                break
            before = now
        drivers[1].kill()
        first_out, first_err = first.communicate(timeout=60)
        restarted = hosts.start_driver(1, client_liveness_timeout="5s")
        old_session = next(line.split()[1] for line in first_out.splitlines()
                           if line.startswith("SESSION "))
        (tmp_path / "stopped").unlink()  # the first run's
        second = hosts[1].popen(sys.executable, "-c", PUBLISHER, data, str(MESSAGES // 2),
                                str(PAYLOAD), str(tmp_path), "n", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        run = spark.run_app(INGEST_QUERY, data, hosts[4].address, str(MESSAGES // 2),
                            str(tmp_path), "n", "false", old_session, host=1,
                            conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
        skips = read_system_counters(hosts[1].outside(restarted.directory))[
            SystemCounter.DATA_LOSS_SKIPS]
    finally:
        (tmp_path / "stopped").touch()
        for process in (first, second):
            if process is not None and process.poll() is None:
                try:
                    process.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
        holder.terminate()
        holder.communicate(timeout=30)
        if restarted is not None:
            restarted.stop()
    accepted = json.loads(next(line for line in first_out.splitlines()
                               if line.startswith("RESULT "))[7:])["accepted"]
    rows = []
    for path in (tmp_path / "batches").glob("*.json"):
        rows += [row[0] for row in json.loads(path.read_text())]
    old = sorted(int(v[1:]) for v in rows if v.startswith("m"))
    new = sorted(int(v[1:]) for v in rows if v.startswith("n"))
    assert old == list(range(len(old))), "the old session's rows once, none missing"
    assert MESSAGES // 4 <= len(old) < accepted, (len(old), accepted, first_err)
    assert new == list(range(MESSAGES // 2)), "the new session's rows once"
    assert "without the stream's end-of-stream mark" in run.stderr, run.stderr[-3000:]
    assert old_session not in json.loads(run.result()["last_offsets"])
    assert skips >= 1


#: Host 1: publishes ``prefix``-numbered messages with ``durable=7/1`` on its channel at about
#: 400 messages/s, waiting (pipelined: once per 50 messages) until the archive's tagged
#: receiver has them; writes how many are durable to ``durable-<prefix>``.  Runs until its
#: driver goes or the file ``stopped``, then reports how many ``offer`` accepted and how many
#: it knew durable.
DURABLE_PUBLISHER = """
import json, os, sys, time
from slipstream.client import Client, SlipstreamError

data, work, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
accepted = durable = 0
try:
    with Client.connect() as client:
        publication = client.add_exclusive_publication(data + "|durable=7/1", 10)
        print("SESSION", publication.session_id, flush=True)
        while not publication.is_connected:
            time.sleep(0.05)
        while not os.path.exists(os.path.join(work, "stopped")):
            message = f"{prefix}{accepted:08d}".encode().ljust(100, b".")
            while (position := publication.offer(message)) < 0:
                error = client.cut_off_error()
                if error is not None:  # its driver went
                    raise error
                time.sleep(0.0002)
            accepted += 1
            if accepted % 50 == 0:
                if not publication.wait_durable(position, 120):
                    raise RuntimeError(f"not durable: {publication.why_not_durable(position)}")
                durable = accepted
                with open(os.path.join(work, f"durable-{prefix}.tmp"), "w") as f:
                    f.write(str(durable))
                os.replace(os.path.join(work, f"durable-{prefix}.tmp"),
                           os.path.join(work, f"durable-{prefix}"))
            time.sleep(0.0025)
except (SlipstreamError, RuntimeError) as e:
    print("ENDED", repr(e), flush=True)
print("RESULT", json.dumps({"accepted": accepted, "durable": durable}), flush=True)
"""

#: The Spark driver on the archive host, holding the stream itself (no standing holder):
#: reads ``expected`` rows with ``prefix`` from the earliest the archive holds into an
#: idempotent sink, ranges its log no longer holds from the archive; with ``gone``, also waits
#: until that session is finished in the offsets.
ARCHIVE_QUERY = """
import glob, json, os, sys, time
from pyspark.sql import SparkSession
from slipstream.spark_bridge import register

data, archive, expected, work = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
prefix, gone = sys.argv[5], (sys.argv[6] if len(sys.argv) > 6 else None)
# "+N": N more than the publisher had made durable when the first batch was written
relative, expected = expected.startswith("+"), int(expected.lstrip("+"))
spark = SparkSession.builder.appName("slipstream-archive-host").getOrCreate()
register(spark)
os.makedirs(os.path.join(work, "batches"), exist_ok=True)

""" + SINK_HELPERS + """

def finished():
    entry = json.loads(last_offsets()).get(gone)
    return isinstance(entry, dict) and entry.get("finished") is True

query = (spark.readStream.format("slipstream").option("channel", data)
         .option("streamId", "10").option("archive", archive)
         .option("startingPosition", "earliest")
         .option("failOnDataLoss", "false").option("replayTimeoutMs", "10000")
         .load().writeStream.foreachBatch(sink)
         .option("checkpointLocation", os.path.join(work, "checkpoint")).start())
deadline = time.monotonic() + 400
while relative and time.monotonic() < deadline:
    if seen():
        with open(os.path.join(work, f"durable-{prefix}")) as f:
            expected += int(f.read())
        break
    time.sleep(0.2)
while time.monotonic() < deadline and (
        len({v for v in seen() if v.startswith(prefix)}) < expected or
        (gone is not None and not finished())):
    if query.exception() is not None:
        raise query.exception()
    time.sleep(0.5)
if query.exception() is not None:
    raise query.exception()
query.stop()
print_result()
spark.stop()
"""


@pytest.mark.timeout(900)
def test_durable_messages_are_read_once_through_downtime_and_the_publishing_host_s_crash(
        cluster, tmp_path) -> None:
    """The archive records the stream on host 4, where it arrives, as the durable publisher's
    tagged receiver (``gtag=7``); the Spark driver runs on host 4 too, holding the stream
    itself, its read tasks on hosts 2 and 3.  The query reads some and stops; the archive
    keeps the stream flowing for several terms (64 KiB) while it is down; then host 1's
    slipstream driver is killed mid-stream.  The restarted query reads what its log no
    longer holds from the archive (replayed to the executors' hosts): every message once and
    in order, every one the publisher was told was durable among them; and the session,
    whose recording ended without the end-of-stream mark, is reported as loss past the
    recorded position, then finished in the offsets.  Mid-way through the first run, host 2's
    slipstream driver is killed and started again: its tasks fail and run again."""
    hosts, spark, drivers = cluster
    data = f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}|gtag=7"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text(
        f'dir = "{archive_dir}"\nsegment_length = "256k"\n'
        f'control_address = "{hosts[4].address}"\ncontrol_port = 8010\n'
        f'[[record]]\nchannel = "{data}"\nstream_id = 10\nsource = "remote"\n')
    archive_log = open(tmp_path / "archive.log", "wb")
    archive = hosts[4].popen(sys.executable, "-m", "slipstream.archive.cli", "run",
                             "--config", str(config), stdout=archive_log,
                             stderr=subprocess.STDOUT)
    publisher = hosts[1].popen(sys.executable, "-c", DURABLE_PUBLISHER,
                               f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}"
                               f"|term-length=64k", str(tmp_path), "d",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    published = errors = ""
    worker_driver: list = []

    def kill_a_worker_s_driver() -> None:
        """Once the query has committed a few batches: host 2's driver killed, restarted."""
        deadline = time.monotonic() + 300
        while len(list((tmp_path / "batches").glob("*.json"))) < 2:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        drivers.pop(2).kill()
        time.sleep(1.0)
        worker_driver.append(hosts.start_driver(2, client_liveness_timeout="5s"))

    killer = threading.Thread(target=kill_a_worker_s_driver, daemon=True)
    killer.start()
    try:
        spark.run_app(ARCHIVE_QUERY, data, f"{hosts[4].address}:8010", "+3000", str(tmp_path),
                      "d", host=4, conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
        killer.join(timeout=60)
        assert worker_driver, "the worker's driver was not killed mid-query"
        progress = tmp_path / "durable-d"
        at_stop = int(progress.read_text())
        deadline = time.monotonic() + 300
        while int(progress.read_text()) < at_stop + 3 * (64 * 1024 // 160):  # 3 terms
            assert time.monotonic() < deadline, "the publisher did not go on while down"
            time.sleep(0.2)
        drivers[1].kill()
        published, errors = publisher.communicate(timeout=60)
        session = next(line.split()[1] for line in published.splitlines()
                       if line.startswith("SESSION "))
        run = spark.run_app(ARCHIVE_QUERY, data, f"{hosts[4].address}:8010", "300",
                            str(tmp_path), "d", session, host=4,
                            conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
        query = run.result()
    finally:
        (tmp_path / "stopped").touch()
        if publisher.poll() is None:
            publisher.kill()
            publisher.communicate()
        archive.terminate()
        archive.wait(timeout=30)
        archive_log.close()
        for driver in worker_driver:
            driver.stop()
    told = json.loads(next(line for line in published.splitlines()
                           if line.startswith("RESULT "))[7:])
    rows = []
    for path in (tmp_path / "batches").glob("*.json"):
        rows += [row[0] for row in json.loads(path.read_text())]
    numbers = sorted(int(v[1:]) for v in rows)
    assert numbers == list(range(len(numbers))), "every row once, none missing"
    assert told["durable"] <= len(numbers) <= told["accepted"], (told, len(numbers), errors)
    assert query["distinct"] == query["rows"] == len(numbers), query
    assert "whatever its publisher accepted after position" in run.stderr, run.stderr[-3000:]
    replays = (tmp_path / "archive.log").read_text()
    assert "replay " in replays, "nothing was read from the archive: " + replays[-2000:]

# -- a pipeline written for Kafka ---------------------------------------------------------
#
# Host 1: the Spark driver (client mode) and an archive recording both streams where they
# arrive; hosts 2 and 3: the workers, whose tasks write the rows and read them back (replays
# from host 1's archive, or the live log replayed by the query's hold); host 4 is idle.

KAFKA_STREAMS = (21, 22)
#: Rows per stream: about 12 terms of 64 KiB each, so the live log on host 1 (three terms)
#: holds only the last few when the query starts.
KAFKA_ROWS = 3000

#: The application: a writer that sends rows with keys and headers to two streams by their
#: stream_id column, then, with the writer's sessions still live, a query as a Kafka user
#: writes it (only format and the stream options differ) started at a time older than the
#: live log holds, read once to the end (Trigger.AvailableNow), its rows and progress kept.
KAFKA_PIPELINE = """
import json, os, sys, time
from pyspark.sql import SparkSession
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, StringType, StructField,
                               StructType)
from slipstream.spark_bridge import register

channel, writer_channel, archive, work = sys.argv[1:5]
rows_per_stream = int(sys.argv[5])
spark = SparkSession.builder.appName("kafka-style-pipeline").getOrCreate()
register(spark)

schema = StructType([
    StructField("key", StringType()), StructField("value", StringType()),
    StructField("headers", ArrayType(StructType([StructField("key", StringType()),
                                                 StructField("value", BinaryType())]))),
    StructField("stream_id", IntegerType())])
rows = [(f"k{s}-{i}" if i % 7 else None, f"v{s}-{i}-" + "x" * 150,
         [("seq", str(i).encode()), ("from", b"\\x00\\xff" + bytes([s]))] if i % 5 else [],
         s)
        for s in (21, 22) for i in range(rows_per_stream)]
since_ms = int(time.time() * 1000) - 1
(spark.createDataFrame(rows, schema).repartition(4)
 .write.format("slipstream").option("channel", writer_channel).mode("append").save())

got = os.path.join(work, "rows")
os.makedirs(got, exist_ok=True)

def sink(batch, batch_id):
    out = [{"stream": r.stream_id, "session": r.session_id, "position": r.position,
            "key": r.key, "value": r.value, "type": r.timestampType,
            "headers": None if r.headers is None else
                       [[h.key, h["value"].hex()] for h in r.headers]}
           for r in batch.collect()]
    with open(os.path.join(got, f"{batch_id}.json"), "w") as f:
        json.dump(out, f)

events = (spark.readStream.format("slipstream")            # Kafka: format("kafka")
          .option("channel", channel)                      # Kafka: kafka.bootstrap.servers
          .option("streamId", "21,22")                     # Kafka: subscribe
          .option("archive", archive)
          .option("startingTimestamp", str(since_ms))
          .option("maxOffsetsPerTrigger", "1500")
          .option("includeHeaders", "true")
          .option("failOnDataLoss", "true")
          .load())
query = (events.selectExpr("CAST(key AS STRING) AS key", "CAST(value AS STRING) AS value",
                           "headers", "timestampType", "stream_id", "session_id", "position")
         .writeStream.foreachBatch(sink).trigger(availableNow=True)
         .option("checkpointLocation", os.path.join(work, "checkpoint")).start())
query.awaitTermination(400)
if query.exception() is not None:
    raise query.exception()
lags = []
for progress in query.recentProgress:
    latest = progress["sources"][0].get("latestOffset")
    if latest:
        lags.append(json.loads(latest).get("@lag", {}).get("offsetsBehindLatest"))
query.stop()
print("RESULT", json.dumps({"lags": lags}), flush=True)
spark.stop()
"""

#: The batch read, in an application of its own once the writer's sessions ended (their
#: recordings stopped): no holder, every session the archive recorded.
KAFKA_BATCH = """
import json, sys
from pyspark.sql import SparkSession
from slipstream.spark_bridge import register

channel, archive = sys.argv[1:3]
spark = SparkSession.builder.appName("kafka-style-batch").getOrCreate()
register(spark)
df = (spark.read.format("slipstream").option("channel", channel)
      .option("streamId", "21,22").option("archive", archive)
      .option("startingOffsets", "earliest").option("endingOffsets", "latest")
      .option("includeHeaders", "true").load())
rows = [{"stream": r.stream_id, "key": None if r.key is None else bytes(r.key).decode(),
         "value": bytes(r.value).decode(), "headers": None if r.headers is None else
         [[h.key, bytes(h["value"]).hex()] for h in r.headers]} for r in df.collect()]
print("RESULT", json.dumps(rows), flush=True)
spark.stop()
"""

#: On host 1: waits until every recording of both streams has stopped (its session ended
#: with its end-of-stream mark) and prints them.
RECORDINGS_STOPPED = """
import json, sys, time
from slipstream.archive.client import ArchiveClient
from slipstream.client import Client

address = sys.argv[1]
with Client.connect() as client, ArchiveClient(client, address, 8010) as archive:
    deadline = time.monotonic() + 120
    while True:
        listed = [r for s in (21, 22) for r in archive.list_all_recordings(stream_id=s)]
        if listed and not any(r.is_active for r in listed):
            break
        assert time.monotonic() < deadline, [(r.recording_id, r.is_active) for r in listed]
        time.sleep(0.5)
    print(json.dumps([[r.descriptor.stream_id, r.descriptor.session_id,
                       int(r.descriptor.end_reason)] for r in listed]))
"""


def expected_kafka_rows() -> dict[tuple[int, str], tuple[str | None, list | None]]:
    """What the writer sent: per (stream, value), its key and headers (hex values), as
    KAFKA_PIPELINE makes them."""
    rows = {}
    for s in KAFKA_STREAMS:
        for i in range(KAFKA_ROWS):
            headers = [["seq", str(i).encode().hex()], ["from", (b"\x00\xff" + bytes([s])).hex()]]
            rows[(s, f"v{s}-{i}-" + "x" * 150)] = (f"k{s}-{i}" if i % 7 else None,
                                                    headers if i % 5 else [])
    return rows


@pytest.mark.timeout(900)
def test_a_kafka_pipeline_reads_keys_and_headers_of_two_streams_from_a_time_older_than_the_log(
        cluster, tmp_path) -> None:
    """A pipeline as a Kafka user writes it, on the cluster: executors on hosts 2 and 3 write
    6,000 rows with keys and headers to two streams by their ``stream_id`` column, to host 1,
    where an archive records both.  With the writer's sessions still live, a query started
    at a time before the write (about 12 terms back: the live log holds three) reads every
    row once, keys and headers intact, its lag in the progress falling to 0.  Once the
    writer's sessions ended, a batch read with no holder returns every row once from the
    archive."""
    hosts, spark, _drivers = cluster
    h1 = hosts[1].address
    channel = f"aeron:udp?endpoint={h1}:{DATA_PORT}"
    archive_dir = tmp_path / "archive"
    config = tmp_path / "archive.toml"
    config.write_text(
        f'dir = "{archive_dir}"\nsegment_length = "256k"\n'
        f'control_address = "{h1}"\ncontrol_port = 8010\n' +
        "".join(f'[[record]]\nchannel = "{channel}"\nstream_id = {s}\nsource = "remote"\n'
                for s in KAFKA_STREAMS))
    archive_log = open(tmp_path / "archive.log", "wb")
    archive = hosts[1].popen(sys.executable, "-m", "slipstream.archive.cli", "run",
                             "--config", str(config), stdout=archive_log,
                             stderr=subprocess.STDOUT)
    try:
        run = spark.run_app(KAFKA_PIPELINE, channel, f"{channel}|term-length=64k",
                            f"{h1}:8010", str(tmp_path), str(KAFKA_ROWS), host=1,
                            conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
        lags = run.result()["lags"]
        read = []
        for path in sorted((tmp_path / "rows").glob("*.json"), key=lambda p: int(p.stem)):
            read += json.loads(path.read_text())  # in batch order
        stopped = json.loads(hosts[1].run(sys.executable, "-c", RECORDINGS_STOPPED, h1,
                                          timeout=180).stdout)
        batch = spark.run_app(KAFKA_BATCH, channel, f"{h1}:8010", host=1,
                              conf=ONE_EXECUTOR_PER_WORKER, timeout=300).result()
    finally:
        archive.terminate()
        archive.wait(timeout=30)
        archive_log.close()

    expected = expected_kafka_rows()
    for rows, what in ((read, "the query"), (batch, "the batch read")):
        got = {(r["stream"], r["value"]): (r["key"], r["headers"]) for r in rows}
        assert len(rows) == len(got) == len(expected), \
            f"{what}: {len(rows)} rows, {len(got)} distinct, of {len(expected)}"
        assert got == expected, f"{what}: keys and headers as written"
    assert {r["type"] for r in read} == {0}, "every timestamp is the writer's (CreateTime)"
    sessions = {(r["stream"], r["session"]) for r in read}
    assert {s for s, _ in sessions} == set(KAFKA_STREAMS)
    # Each session's positions increase: read once, in order.
    for stream, session in sessions:
        positions = [r["position"] for r in read
                     if (r["stream"], r["session"]) == (stream, session)]
        assert positions == sorted(set(positions))
    assert len(lags) >= 3 and lags[0] > 0 and lags[-1] == 0, lags
    assert all(later <= earlier for earlier, later in itertools.pairwise(lags)), lags
    # The recordings ended with their sessions' end-of-stream marks, and were read from.
    assert {s for s, _, _ in stopped} == set(KAFKA_STREAMS), stopped
    assert "replay " in (tmp_path / "archive.log").read_text()


# -- a keyed stream, read through an archive whose calls are keyed ----------------------------

#: Host 4: publishes ``count`` messages on the keyed stream, then waits for ``stopped``.
KEYED_PUBLISHER = """
import os, sys, time
from slipstream.client import Client

data, count, size, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with Client.connect() as client:
    publication = client.add_exclusive_publication(data, 10)
    deadline = time.monotonic() + 300
    while not publication.is_connected:
        assert time.monotonic() < deadline, "no subscriber came"
        time.sleep(0.05)
    for i in range(count):
        message = f"k{i:08d}".encode().ljust(size, b".")
        while publication.offer(message) < 0:
            assert time.monotonic() < deadline, "held back for good"
            time.sleep(0.0002)
    while not os.path.exists(os.path.join(work, "stopped")):
        assert time.monotonic() < deadline + 300, "the query never stopped"
        time.sleep(0.1)
"""


@pytest.mark.timeout(900)
def test_a_keyed_stream_is_read_once_through_keyed_calls_and_a_host_without_the_key_gets_nothing(
        cluster, tmp_path) -> None:
    """Hosts 2, 3 and 4 hold key k1, host 1 none.  Host 4 publishes on ``key=k1`` to its own
    endpoint, where its archive holds the stream for the query's group and takes calls on a
    plain endpoint and, at the holder port, one keyed k1.  The query (client mode, beside the
    holder, its read tasks on hosts 2 and 3) reads every message once: its calls and the
    replays to its tasks are sealed under k1 (the channel's key).  Host 1, with its own
    driver and no key, calls the archive as any caller does: every call about the stream is
    refused, and nothing of it reaches host 1."""
    from test_encrypted_streams import KEY_A, write_keys

    from slipstream.archive.control import UNAUTHORIZED

    hosts, spark, drivers = cluster
    keys = tmp_path / "keys"
    write_keys(keys, "k1", [(1, KEY_A)])
    for i in (2, 3, 4):  # again, with the key
        drivers[i].stop()
        drivers[i] = hosts.start_driver(i, client_liveness_timeout="5s", keys_dir=str(keys))
    try:
        data = f"aeron:udp?endpoint={hosts[4].address}:{DATA_PORT}|key=k1"
        plain_port = HOLDER_PORT + 2
        archive_dir = tmp_path / "keyed-archive"
        archive_dir.mkdir()
        config = archive_dir / "archive.toml"
        config.write_text("\n".join([
            f"dir = {json.dumps(str(archive_dir))}", 'driver_dir = ""',
            f'control_address = "{hosts[4].address}"', f"control_port = {plain_port}",
            f"control_keys = {{ k1 = {HOLDER_PORT} }}",
            "[[hold]]", f"channel = {json.dumps(data)}", "stream_id = 10"]) + "\n")
        holder = hosts[4].popen(str(Path(sys.executable).parent / "slipstream-archive"), "run",
                                "--config", str(config), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        count = MESSAGES // 2
        publisher = hosts[4].popen(sys.executable, "-c", KEYED_PUBLISHER, data, str(count),
                                   str(PAYLOAD), str(tmp_path), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            run = spark.run_app(INGEST_QUERY, data, hosts[4].address, str(count),
                                str(tmp_path), "k", "true", host=4,
                                conf=ONE_EXECUTOR_PER_WORKER, timeout=600)
            query = run.result()
            outsider = hosts[1].run(
                sys.executable, str(Path(__file__).with_name("archive_outsider.py")),
                str(drivers[1].directory), hosts[4].address, str(plain_port),
                str(HOLDER_PORT), "10", data, "10", timeout=120)
        finally:
            (tmp_path / "stopped").touch()
            try:
                published, errors = publisher.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                publisher.kill()
                published, errors = publisher.communicate()
            holder.terminate()
            holder_log, _ = holder.communicate(timeout=30)
        assert publisher.returncode == 0, (published, errors)
        assert query["distinct"] == query["rows"] == count, query
        seen = json.loads(outsider.stdout.strip().splitlines()[-1])
        assert seen["received"] == 0, seen
        assert seen["list"] == {"status": "ok", "result": "[]"}, seen
        for op in ("state", "ended", "release", "held_view", "replay_held"):
            assert seen[op]["reason"] == UNAUTHORIZED and \
                seen[op]["cause"] == "call-without-key", (op, seen[op])
        assert "did not take the call" in seen["keyed_port_in_plain"]["message"], seen
        assert "holding stream 10" in holder_log, holder_log
    finally:
        for i in (2, 3, 4):
            with contextlib.suppress(Exception):
                drivers[i].stop()
