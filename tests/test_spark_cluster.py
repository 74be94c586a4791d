"""The multi-host Spark harness (:mod:`spark_cluster`) on isolated namespace hosts: a real
standalone cluster whose executors run on hosts that each have their own /dev/shm, hostname
and slipstream driver, as on separate machines.

Needs root (namespace hosts), nsenter and unshare, pyspark and Java 17+: without them the test
skips, under CI=true it fails.  40-70 s on 2 cores, most of it Spark's JVMs starting.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import lacking

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


@pytest.fixture
def isolated_hosts(needs_hosts):  # -> Iterator[tuple[NamespaceHosts, dict[int, HostDriver]]]
    """Three isolated hosts, each with a slipstream driver in the default directory (by host)
    and a marker file ``/dev/shm/marker-<i>``; removed afterwards."""
    from spark_cluster import unavailable

    from slipstream.sim.real.hosts import NamespaceHosts

    missing = [tool for tool in ("nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        lacking(f"isolated test hosts need {' and '.join(missing)} (util-linux)")
    problem = unavailable()
    if problem is not None:
        lacking(f"a Spark cluster: {problem}")
    with NamespaceHosts(3, isolated=True) as hosts:
        drivers = {i: hosts.start_driver(i) for i in (1, 2, 3)}
        for i in (1, 2, 3):
            hosts[i].run("touch", f"/dev/shm/marker-{i}")
        yield hosts, drivers


def test_tasks_run_on_both_worker_hosts_each_beside_its_own_driver(isolated_hosts,
                                                                   tmp_path) -> None:
    from spark_cluster import spark_cluster

    hosts, drivers = isolated_hosts
    # One path, three drivers: each host has its own /dev/shm.
    assert len({str(d.directory) for d in drivers.values()}) == 1
    directory = str(drivers[1].directory)
    with spark_cluster(hosts, tmp_path, master=1, workers=(2, 3)) as cluster:
        result = cluster.run_app(APPLICATION, directory, host=1, timeout=240).result()

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
