"""A real Spark standalone cluster on isolated namespace hosts, for tests (a helper module).

Each host of ``NamespaceHosts(n, isolated=True)`` (:mod:`slipstream.sim.real.hosts`) is a
machine of its own to the processes in it: its own network address, /dev/shm and hostname,
the machine's file system otherwise.  :func:`spark_cluster` starts a standalone master on one
host and a worker on each of the others it names, and waits until every worker is registered;
:meth:`SparkCluster.run_app` runs a client-mode PySpark application (``python script.py``) on
a host, its Spark driver there, its executors on the workers' hosts, so a task runs beside
that host's slipstream driver (:meth:`NamespaceHosts.start_driver`) and nobody else's::

    with namespace_hosts(3, isolated=True) as hosts:
        for i in (1, 2, 3):
            hosts.start_driver(i)                   # /dev/shm/slipstream-<user> in each host
        with spark_cluster(hosts, tmp_path, master=1, workers=(2, 3)) as cluster:
            run = cluster.run_app('''
                import json
                from pyspark.sql import SparkSession
                spark = SparkSession.builder.getOrCreate()   # joins the cluster
                print("RESULT", json.dumps(spark.range(8, numPartitions=8).count()))
            ''', host=1, timeout=180)
            assert run.result() == 8

An application script is plain PySpark: ``SparkSession.builder.getOrCreate()`` (or
``slipstream.spark_bridge.session(master=os.environ["SPARK_CLUSTER_MASTER"])``) joins the
cluster with the harness's settings, which arrive as ``PYSPARK_SUBMIT_ARGS`` (master URL,
``spark.driver.host``, executor memory and cores, the UI off).  Everything the cluster writes
(logs, work directories, Spark's scratch space, the scripts) is under the ``directory`` given,
``tmp_path`` in a test.  The master's web UI and the hosts' addresses are not reachable from
the test's own process (the hosts' bridge is in a namespace of its own): readiness is read
from the logs.

Costs, 2 cores: the cluster starts in 10-20 s, an application with one small job runs in 25-30 s
(its driver, two executors and their Python workers start), ~1.6 GiB in all; more when the
machine is busy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.sim.real.hosts import Host, NamespaceHosts

MASTER_PORT: Final = 7077
#: A line an application prints as ``RESULT <json>`` on stdout is its result
#: (:meth:`AppRun.result`): Spark's own logging goes to stderr.
RESULT_PREFIX: Final = "RESULT "
#: The environment variable that gives an application script the master URL (the same URL is
#: in ``PYSPARK_SUBMIT_ARGS``, which ``SparkSession.builder`` reads by itself).
MASTER_ENV: Final = "SPARK_CLUSTER_MASTER"
#: Heaps: a master and a worker need little; the worker offers ``worker_memory`` to executors,
#: each of which takes ``executor_memory`` (one executor of 700m fits in a 1g worker).
DAEMON_MEMORY: Final = "512m"
#: JVM options of every process of the cluster: C1 only (the tests' JVMs are short-lived, and
#: C2 compiling on 2 busy cores delays them more than it gains), no hsperfdata files in /tmp.
JAVA_OPTIONS: Final = "-XX:TieredStopAtLevel=1 -XX:-UsePerfData"


class SparkClusterError(RuntimeError):
    """The cluster did not start, or an application failed: the message carries the logs."""


def unavailable() -> str | None:
    """Why a Spark cluster cannot run here (no pyspark, no Java 17+), or None when it can.
    Namespace hosts have their own check (:func:`slipstream.sim.real.hosts.unavailable`)."""
    try:
        spark_home()
    except ImportError:
        return "pyspark is not installed (pip install 'slipstream[spark]')"
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False) \
        if shutil.which("java") else None
    if java is None or java.returncode != 0:
        return "Java 17+ is missing (scripts/ensure-java; make java)"
    match = re.search(r'version "(\d+)', java.stderr)
    if match is None or int(match.group(1)) < 17:
        return f"Java 17+ is needed: {java.stderr.splitlines()[0] if java.stderr else '?'}"
    return None


def spark_home() -> Path:
    """The pyspark package folder: the wheel carries Spark's jars and ``bin/spark-class``."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@attrs.frozen
class AppRun:
    """What one application run gave: its exit code (negative: killed by that signal), its
    stdout and stderr, how long it ran, and whether it was killed at its timeout."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def result(self) -> Any:
        """The JSON value of the last ``RESULT <json>`` line of stdout; ValueError if none."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])
        raise ValueError(f"the application printed no {RESULT_PREFIX.strip()} line; stdout:\n"
                         f"{_tail(self.stdout)}")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return _tail(path.read_text(errors="replace"), lines)
    except FileNotFoundError:
        return "(no log)"


class SparkCluster:
    """A running standalone cluster (made by :func:`spark_cluster`, which also stops it).

    ``master_url`` is ``spark://<master host's address>:7077``; ``directory`` holds
    ``master.log``, ``worker-<i>.log`` and ``work-<i>/`` (each executor's stdout and stderr
    under ``work-<i>/<app id>/<executor id>/``), and ``apps/``.
    """

    def __init__(self, hosts: NamespaceHosts, directory: Path, *, master: int,
                 workers: Sequence[int], worker_cores: int, worker_memory: str,
                 executor_memory: str) -> None:
        if master in workers:
            raise ValueError(f"host {master} is the master's: a worker needs a host of its own")
        if not workers:
            raise ValueError("a cluster needs at least one worker")
        if not all(hosts[i].isolated for i in (master, *workers)):
            raise ValueError("the cluster's hosts must be isolated: "
                             "NamespaceHosts(n, isolated=True)")
        self.hosts = hosts
        self.directory = Path(directory)
        self.master_host = hosts[master]
        self.worker_hosts = [hosts[i] for i in workers]
        self.master_url = f"spark://{self.master_host.address}:{MASTER_PORT}"
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.executor_memory = executor_memory
        self._daemons: list[tuple[str, Host, subprocess.Popen[bytes]]] = []
        self._apps = 0
        self._submitted: list[str] = []  # cluster-mode driver ids since the last clearing
        self._forgotten: set[str] = set()  # driver ids an earlier test ran
        (self.directory / "apps").mkdir(parents=True, exist_ok=True)
        self._conf_dir = self.directory / "conf"  # empty: no machine-wide Spark settings
        self._conf_dir.mkdir(exist_ok=True)

    # -- environment -----------------------------------------------------------------------
    def environment(self, host: Host) -> dict[str, str]:
        """The environment of a Spark process on ``host``: this process's, without its
        Spark, PySpark and slipstream variables, plus Spark's home, the host's address as its
        name and bind address, and scratch space under the cluster's directory."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_", "SLIPSTREAM_"))}
        scratch = self.directory / f"scratch-{host.index}"
        scratch.mkdir(exist_ok=True)
        env.update({
            "SPARK_HOME": str(spark_home()),
            "SPARK_CONF_DIR": str(self._conf_dir),
            # Addresses everywhere, never the host's name: it resolves nowhere (nothing is
            # written to /etc/hosts), and every host must reach every other by what it says.
            "SPARK_LOCAL_IP": host.address,
            "SPARK_LOCAL_HOSTNAME": host.address,
            "SPARK_LOCAL_DIRS": str(scratch),
            "TMPDIR": str(scratch),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        })
        return env

    # -- daemons ---------------------------------------------------------------------------
    def _start_daemon(self, name: str, host: Host, *args: str) -> subprocess.Popen[bytes]:
        env = self.environment(host)
        env["SPARK_DAEMON_MEMORY"] = DAEMON_MEMORY
        env["SPARK_DAEMON_JAVA_OPTS"] = JAVA_OPTIONS
        log = (self.directory / f"{name}.log").open("wb")
        with log:
            # Its own session: a Ctrl-C reaches this process only, whose cleanup stops it.
            process = host.popen(str(spark_home() / "bin" / "spark-class"), *args, env=env,
                                 stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, cwd=self.directory,
                                 start_new_session=True)
        self._daemons.append((name, host, process))
        return process

    def _wait_for_log(self, name: str, process: subprocess.Popen[bytes], pattern: str,
                      deadline: float) -> None:
        path = self.directory / f"{name}.log"
        while True:
            with contextlib.suppress(FileNotFoundError):
                if re.search(pattern, path.read_text(errors="replace")):
                    return
            if process.poll() is not None:
                raise SparkClusterError(f"the {name} exited with {process.returncode}:\n"
                                        f"{_log_tail(path)}")
            if time.monotonic() > deadline:
                raise SparkClusterError(f"the {name} did not log /{pattern}/ in time:\n"
                                        f"{_log_tail(path)}")
            time.sleep(0.1)

    def start(self, timeout: float) -> None:
        """Start the master, then the workers; return once every worker says it is
        registered.  SparkClusterError (with the log) if one exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        master = self._start_daemon(
            "master", self.master_host, "org.apache.spark.deploy.master.Master",
            "--host", self.master_host.address, "--port", str(MASTER_PORT),
            "--webui-port", "8080")
        # Workers after the master listens: one that finds no master retries only after
        # 5-15 s.
        self._wait_for_log("master", master, r"New state: ALIVE", deadline)
        workers = [self._start_worker(host, f"worker-{host.index}")
                   for host in self.worker_hosts]
        for name, process in workers:
            self._wait_for_log(name, process, r"Successfully registered with master", deadline)

    def _start_worker(self, host: Host, name: str) -> tuple[str, subprocess.Popen[bytes]]:
        work_dir = self.directory / f"work-{host.index}"
        work_dir.mkdir(exist_ok=True)
        return name, self._start_daemon(
            name, host, "org.apache.spark.deploy.worker.Worker", self.master_url,
            "--host", host.address, "--cores", str(self.worker_cores),
            "--memory", self.worker_memory, "--work-dir", str(work_dir))

    def restart_lost_workers(self, timeout: float = 120.0) -> list[int]:
        """Start a worker again on each worker host whose worker has ended (:meth:`lose_host`),
        each logging to ``worker-<i>.<n>.log``; return once every one is registered, with the
        hosts' indices (none: the cluster was whole).  SparkClusterError as :meth:`start`."""
        deadline = time.monotonic() + timeout
        started = []
        for entry in list(self._daemons):
            name, host, process = entry
            if name == "master" or process.poll() is None:
                continue
            self._daemons.remove(entry)
            again = 2 + sum(1 for _ in self.directory.glob(f"worker-{host.index}.*.log"))
            started.append((host.index, self._start_worker(host,
                                                           f"worker-{host.index}.{again}")))
        for _index, (name, process) in started:
            self._wait_for_log(name, process, r"Successfully registered with master", deadline)
        return [index for index, _ in started]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the workers (whose shutdown kills their executors), then the master: SIGTERM,
        SIGKILL after ``timeout`` s; then kill any Spark process left on the cluster's hosts
        (an executor or Python worker orphaned by a worker that died first)."""
        workers = [process for name, _host, process in self._daemons if name != "master"]
        masters = [process for name, _host, process in self._daemons if name == "master"]
        for group in (workers, masters):
            for process in group:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for process in group:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        hosts = {host.index: host for _name, host, _process in self._daemons}
        self._daemons.clear()
        for host in hosts.values():
            _kill_spark_processes(host, grace=5.0)

    # -- applications ----------------------------------------------------------------------
    def submit_args(self, host: Host, conf: Mapping[str, str] | None = None) -> str:
        """``PYSPARK_SUBMIT_ARGS`` of an application on ``host``: the master, the driver on
        the host's address, ``executor_memory`` and one core per executor, every core of the
        cluster, registered before the first job runs, the UI and its progress bar off, C1
        JVMs; ``conf`` adds to or overrides these."""
        settings = {
            "spark.driver.host": host.address,
            "spark.driver.bindAddress": host.address,
            "spark.executor.memory": self.executor_memory,
            "spark.executor.cores": "1",
            # Jobs wait until every worker's executor is registered (up to 60 s): without
            # spark.cores.max a standalone application starts with whichever came first,
            # and a short job may never reach the others.
            "spark.cores.max": str(len(self.worker_hosts) * self.worker_cores),
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",  # a progress bar in stderr, redrawn
            "spark.driver.extraJavaOptions": JAVA_OPTIONS,
            "spark.executor.extraJavaOptions": JAVA_OPTIONS,
            **(conf or {}),
        }
        args = ["--master", self.master_url]
        for key, value in settings.items():
            args += ["--conf", f"{key}={value}"]
        return shlex.join([*args, "pyspark-shell"])

    def run_app(self, script: str | Path, *args: str, host: int | None = None,
                conf: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
                timeout: float = 180.0, check: bool = True) -> AppRun:
        """Run a client-mode PySpark application on host ``host`` (default: the master's):
        ``python script args...`` inside the host, where ``script`` is a path, or, as a
        ``str``, the script's source (dedented, written under ``apps/``).  Its environment:
        :meth:`environment`, ``PYSPARK_SUBMIT_ARGS`` (:meth:`submit_args` with ``conf``),
        :data:`MASTER_ENV`, then ``env``.

        Waits for it, up to ``timeout`` s, then kills it and its Spark driver JVM.  With
        ``check``, an application that fails or times out raises SparkClusterError with its
        output and the cluster's logs; otherwise the :class:`AppRun` says so.
        """
        on = self.master_host if host is None else self.hosts[host]
        self._apps += 1
        if isinstance(script, str):
            path = self.directory / "apps" / f"app-{self._apps}.py"
            path.write_text(textwrap.dedent(script))
        else:
            path = Path(script)
        environment = self.environment(on)
        environment["PYSPARK_SUBMIT_ARGS"] = self.submit_args(on, conf)
        environment[MASTER_ENV] = self.master_url
        environment.update(env or {})
        started = time.monotonic()
        # Its own process group, which its Spark driver JVM (pyspark's child) shares: a
        # timeout kills both.
        process = on.popen(sys.executable, str(path), *args, env=environment,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=self.directory / "apps",
                           start_new_session=True)
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        run = AppRun(process.returncode, stdout, stderr, time.monotonic() - started, timed_out)
        if check and not run.ok:
            what = f"timed out after {timeout} s" if timed_out else \
                f"exited with {run.returncode}"
            raise SparkClusterError(f"the application {path.name} on host {on.index} {what}\n"
                                    f"{self.report(run)}")
        return run

    def submit(self, script: str, *args: str, conf: Mapping[str, str] | None = None,
               supervise: bool = True, timeout: float = 120.0) -> str:
        """Submit a PySpark application in **cluster deploy mode** from the master's host:
        the master starts its driver on a worker (1 core, 512 MiB of it), and with
        ``supervise`` starts it again when it dies (on the same worker; on another, under a
        new driver id, when the worker is lost).  Returns the driver id.

        ``spark-submit app.py`` refuses cluster mode for Python on a standalone cluster
        (SparkSubmit: "Cluster deploy mode is currently not supported for python
        applications on standalone clusters"); the same machinery runs it when the main
        resource is a jar every host has (Spark's own spark-tags) and the main class is
        Spark's PythonRunner, whose arguments are the script, its py-files ("" for none) and
        the application's.  The driver's environment is its worker's (:meth:`environment`:
        PYSPARK_PYTHON, SPARK_LOCAL_IP); its output goes to
        ``work-<i>/<driver id>/stdout`` and ``stderr`` (:meth:`driver_outputs`).
        """
        self._apps += 1
        path = self.directory / "apps" / f"app-{self._apps}.py"
        path.write_text(textwrap.dedent(script))
        settings = {
            "spark.pyspark.python": sys.executable,
            "spark.executor.memory": self.executor_memory,
            "spark.executor.cores": "1",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": JAVA_OPTIONS,
            "spark.executor.extraJavaOptions": JAVA_OPTIONS,
            **(conf or {}),
        }
        jar = next((spark_home() / "jars").glob("spark-tags_*.jar"))
        command = [str(spark_home() / "bin" / "spark-submit"), "--master", self.master_url,
                   "--deploy-mode", "cluster", *(["--supervise"] if supervise else []),
                   "--class", "org.apache.spark.deploy.PythonRunner",
                   "--driver-memory", "512m", "--driver-cores", "1"]
        for key, value in settings.items():
            command += ["--conf", f"{key}={value}"]
        command += [f"file://{jar}", str(path), "", *args]
        result = self.master_host.run(*command, env=self.environment(self.master_host),
                                      timeout=timeout, check=False)
        found = re.search(r"Driver successfully submitted as (driver-\S+)",
                          result.stdout + result.stderr)
        if found is None:
            raise SparkClusterError(f"spark-submit --deploy-mode cluster failed "
                                    f"({result.returncode}):\n{_tail(result.stderr)}\n"
                                    f"{self.report()}")
        self._submitted.append(found.group(1))
        return found.group(1)

    def clear_applications(self) -> None:
        """Between tests on one cluster: the cluster-mode drivers submitted so far are killed
        through the master (which then starts no supervised one again), and every Spark
        process of the hosts but the master and the workers (applications, executors, Python
        workers an earlier test left) is killed; :meth:`driver_outputs` forgets the drivers
        run so far."""
        for driver_id in self._submitted:  # one that ended already is refused: no matter
            # The kill client is a JVM: on a loaded host its start alone takes over a minute.
            # It must finish: a supervised driver killed only as a process is started again.
            self.master_host.run(str(spark_home() / "bin" / "spark-class"),
                                 "org.apache.spark.deploy.Client", "kill", self.master_url,
                                 driver_id, env=self.environment(self.master_host),
                                 timeout=300, check=False)
        self._submitted.clear()
        for host in {self.master_host.index: self.master_host,
                     **{h.index: h for h in self.worker_hosts}}.values():
            for pid, command in host_processes(host):
                if (b"org.apache.spark" in command or b"pyspark." in command) \
                        and b"deploy.master.Master" not in command \
                        and b"deploy.worker.Worker" not in command:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self._forgotten |= {stdout.parent.name
                            for stdout in self.directory.glob("work-*/driver-*/stdout")}

    def driver_outputs(self) -> dict[str, tuple[int, str]]:
        """Every cluster-mode driver run since the last :meth:`clear_applications`: driver
        id -> (the worker host's index, its stdout, all its launches appended)."""
        found = {}
        for stdout in sorted(self.directory.glob("work-*/driver-*/stdout")):
            if stdout.parent.name in self._forgotten:
                continue
            host = int(stdout.parent.parent.name.removeprefix("work-"))
            found[stdout.parent.name] = (host, stdout.read_text(errors="replace"))
        return found

    def lose_host(self, index: int) -> list[int]:
        """The Spark side of worker host ``index`` dies at once (SIGKILL): its worker, and
        every process of its network that is not a slipstream driver or archive (executors,
        Python workers, cluster-mode drivers and their applications), nor the process that
        holds the host's namespaces (which the host's next process joins: the host lives on,
        and :meth:`restart_lost_workers` can start its worker again).  Returns the pids."""
        host = self.hosts[index]
        keep = {host.holder.pid} if host.holder is not None else set()
        killed = []
        for pid, command in host_processes(host):
            if b"slipstream.daemon.cli driver" in command or \
                    b"/slipstream-archive run " in command or pid in keep:
                continue  # the host's slipstream side, and the host itself, live on
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def report(self, run: AppRun | None = None) -> str:
        """The tails of an application's output (``run``), the master's and workers' logs and
        every executor's stderr: what a failure message should carry."""
        parts = []
        if run is not None:
            parts += [f"--- stdout\n{_tail(run.stdout)}", f"--- stderr\n{_tail(run.stderr)}"]
        for log in sorted(self.directory.glob("*.log")):
            parts.append(f"--- {log.name}\n{_log_tail(log, 20)}")
        for stderr in sorted(self.directory.glob("work-*/*/*/stderr")):
            parts.append(f"--- {stderr.relative_to(self.directory)}\n{_log_tail(stderr, 20)}")
        for stderr in sorted(self.directory.glob("work-*/driver-*/stderr")):
            parts.append(f"--- {stderr.relative_to(self.directory)}\n{_log_tail(stderr, 30)}")
        return "\n".join(parts)


def host_processes(host: Host) -> Iterator[tuple[int, bytes]]:
    """``(pid, command line)`` of every process in ``host``'s network namespace (the hosts
    share one pid namespace: its network says which are the host's)."""
    listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                            text=True, check=False).stdout.split()
    for pid in (int(p) for p in listed if p.isdigit()):
        try:
            yield pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # it ended meanwhile


def _spark_processes(host: Host) -> list[int]:
    """The processes of ``host`` that are Spark's: JVMs of org.apache.spark, and PySpark's
    Python workers (``pyspark.daemon``, ``pyspark.worker``)."""
    return [pid for pid, command in host_processes(host)
            if b"org.apache.spark" in command or b"pyspark." in command]


def _kill_spark_processes(host: Host, grace: float) -> None:
    deadline = time.monotonic() + grace
    while (pids := _spark_processes(host)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def spark_cluster(hosts: NamespaceHosts, directory: str | os.PathLike[str], *, master: int = 1,
                  workers: Sequence[int] = (2, 3), worker_cores: int = 1,
                  worker_memory: str = "1g", executor_memory: str = "700m",
                  start_timeout: float = 120.0) -> Iterator[SparkCluster]:
    """A standalone cluster on isolated ``hosts``: the master on host ``master``, one worker
    (``worker_cores``, ``worker_memory``) on each host of ``workers``; yielded once every
    worker is registered, stopped afterwards, whatever happened (no Spark process of it
    survives).  Its files are under ``directory``, which the caller removes (``tmp_path``).
    Raises SparkClusterError, with the logs, when it does not start within
    ``start_timeout`` s."""
    cluster = SparkCluster(hosts, Path(directory), master=master, workers=workers,
                           worker_cores=worker_cores, worker_memory=worker_memory,
                           executor_memory=executor_memory)
    try:
        cluster.start(start_timeout)
        yield cluster
    finally:
        cluster.stop()
