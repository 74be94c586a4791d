"""The stock Aeron 1.15.1 media driver (Java), run as a subprocess: :class:`AeronDriver`.

Driver readiness
----------------
``AeronDriver`` is ready when ``<dir>/cnc.dat`` exists, has CnC version 15, names the pid of the
java process just started (PID field at offset 40) and the driver conductor's heartbeat (the
consumer-heartbeat word of the to-driver ring buffer's trailer, epoch ms) is fresh and not older
than the launch.  A stale cnc.dat of an earlier driver fails the pid and age checks; a driver
that dies while starting fails at once with its output.  The CnC layout is in ``cnc.py``.

Driver -D properties used (names checked with ``javap -constants`` against the 1.15.1 jar)
-------------------------------------------------------------------------------------------
- ``aeron.dir``; ``aeron.threading.mode`` (DEDICATED, SHARED_NETWORK, SHARED);
  ``aeron.term.buffer.length``; ``aeron.shared.idle.strategy`` (a class name).
- timeouts, ns or with a unit suffix (``2s``, ``500ms``): ``aeron.client.liveness.timeout``,
  ``aeron.image.liveness.timeout``, ``aeron.publication.linger.timeout``,
  ``aeron.timer.interval`` (the conductor's check period, 1 s by default).
- loss on the receive side: ``aeron.ReceiveChannelEndpoint.supplier`` =
  ``io.aeron.driver.ext.DebugReceiveChannelEndpointSupplier`` with
  ``aeron.debug.receive.data.loss.rate`` / ``.seed`` (drops received DATA, SETUP and RTT
  frames) and ``aeron.debug.receive.control.loss.rate`` / ``.seed`` (drops the SMs, NAKs and
  RTTs it sends).
- loss on the send side: ``aeron.SendChannelEndpoint.supplier`` =
  ``io.aeron.driver.ext.DebugSendChannelEndpointSupplier`` with
  ``aeron.debug.send.data.loss.rate`` / ``.seed`` (drops DATA it sends) and
  ``aeron.debug.send.control.loss.rate`` / ``.seed`` (drops SMs, NAKs, RTTs it receives).
  Rates are fractions; seeds are longs, -1 (the default) for a random one.
- ``aeron.multicast.FlowControl.supplier`` =
  ``io.aeron.driver.{Max,Min,Preferred}MulticastFlowControlSupplier`` (the default is
  ``DefaultMulticastFlowControlSupplier``, i.e. max), with
  ``aeron.MinMulticastFlowControl.receiverTimeout``,
  ``aeron.PreferredMulticastFlowControl.receiverTimeout`` / ``.asf``; receivers send the
  application-specific SM bytes of ``aeron.flow.control.sm.applicationSpecificFeedback``.
- ``aeron.CongestionControl.supplier`` = ``io.aeron.driver.ext.CubicCongestionControlSupplier``
  (``aeron.CubicCongestionControl.measureRtt`` / ``.initialRtt`` / ``.tcpMode``).
- ``aeron.socket.so_rcvbuf`` (bytes; capped by the kernel's ``net.core.rmem_max``, of which
  Aeron only warns).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from .cnc import CncInfo, Counter, read_cnc, read_counters
from .errors import AeronError
from .process import JavaProcess, Properties, PropertyValue

FlowControl = Literal["max", "min", "preferred"]

_FLOW_CONTROL_SUPPLIERS: dict[str, str] = {
    "max": "io.aeron.driver.MaxMulticastFlowControlSupplier",
    "min": "io.aeron.driver.MinMulticastFlowControlSupplier",
    "preferred": "io.aeron.driver.PreferredMulticastFlowControlSupplier",
}
_CUBIC_SUPPLIER = "io.aeron.driver.ext.CubicCongestionControlSupplier"
_DEBUG_RECEIVE_SUPPLIER = "io.aeron.driver.ext.DebugReceiveChannelEndpointSupplier"
_DEBUG_SEND_SUPPLIER = "io.aeron.driver.ext.DebugSendChannelEndpointSupplier"

#: Aeron's default client and image liveness timeouts (ns), which FAST_TIMEOUTS shortens.
DEFAULT_LIVENESS_NS = 10_000_000_000

# Short timers so that resources of killed clients and finished streams go away quickly.
FAST_TIMEOUTS: dict[str, PropertyValue] = {
    "aeron.client.liveness.timeout": 2_000_000_000,  # ns; clients keep alive every 500 ms
    "aeron.image.liveness.timeout": 2_000_000_000,
    "aeron.publication.linger.timeout": 1_000_000_000,
    "aeron.timer.interval": 100_000_000,
}


class AeronDriver:
    """The Java MediaDriver in ``directory`` (default: a fresh /dev/shm/aeron-peer-*).

    A context manager: entering starts it and waits until it is ready (see the module
    docstring), leaving stops it (SIGTERM, SIGKILL after ``stop_timeout``) and removes the
    directory if it named it (a ``directory`` the caller gives is the caller's, but Aeron's
    driver itself recreates an existing directory that no driver is using: give it one that
    is only for Aeron).  Loss rates
    are fractions (0.05 = 5 %) of frames dropped by the debug channel endpoints;
    ``multicast_flow_control`` picks the driver's multicast flow-control strategy, ``cubic``
    its congestion control; ``fast_timeouts`` applies ``FAST_TIMEOUTS``; ``properties`` adds
    or overrides any -D property.
    """

    def __init__(self, directory: Path | str | None = None, *,
                 threading_mode: Literal["SHARED", "SHARED_NETWORK", "DEDICATED"] = "SHARED",
                 receive_data_loss_rate: float = 0.0, receive_data_loss_seed: int | None = None,
                 receive_control_loss_rate: float = 0.0,
                 receive_control_loss_seed: int | None = None,
                 send_data_loss_rate: float = 0.0, send_data_loss_seed: int | None = None,
                 send_control_loss_rate: float = 0.0, send_control_loss_seed: int | None = None,
                 multicast_flow_control: FlowControl | None = None,
                 cubic: bool = False,
                 term_buffer_length: int | None = None,
                 fast_timeouts: bool = True,
                 properties: Properties | None = None,
                 jvm_args: Sequence[str] = (),
                 start_timeout: float = 20.0,
                 stop_timeout: float = 5.0) -> None:
        self._names_directory = directory is None  # only a directory named here is removed
        self.directory = Path(directory) if directory is not None else (
            Path("/dev/shm") / f"aeron-peer-{uuid.uuid4().hex[:12]}")
        props: dict[str, PropertyValue] = {
            "aeron.dir": str(self.directory), "aeron.threading.mode": threading_mode}
        if fast_timeouts:
            props.update(FAST_TIMEOUTS)
        if term_buffer_length is not None:
            props["aeron.term.buffer.length"] = term_buffer_length

        def loss(side: str, kind: str, rate: float, seed: int | None) -> bool:
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{side} {kind} loss rate {rate} is not within 0..1")
            if rate == 0.0:
                return False
            props[f"aeron.debug.{side}.{kind}.loss.rate"] = rate
            if seed is not None:
                props[f"aeron.debug.{side}.{kind}.loss.seed"] = seed
            return True

        if any([loss("receive", "data", receive_data_loss_rate, receive_data_loss_seed),
                loss("receive", "control", receive_control_loss_rate,
                     receive_control_loss_seed)]):
            props["aeron.ReceiveChannelEndpoint.supplier"] = _DEBUG_RECEIVE_SUPPLIER
        if any([loss("send", "data", send_data_loss_rate, send_data_loss_seed),
                loss("send", "control", send_control_loss_rate, send_control_loss_seed)]):
            props["aeron.SendChannelEndpoint.supplier"] = _DEBUG_SEND_SUPPLIER
        if multicast_flow_control is not None:
            props["aeron.multicast.FlowControl.supplier"] = (
                _FLOW_CONTROL_SUPPLIERS[multicast_flow_control])
        if cubic:
            props["aeron.CongestionControl.supplier"] = _CUBIC_SUPPLIER
        props.update(properties or {})
        self.properties: dict[str, PropertyValue] = props
        self.jvm_args = tuple(jvm_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.process: JavaProcess | None = None

    def __repr__(self) -> str:
        pid = self.process.pid if self.process else None
        return f"AeronDriver({str(self.directory)!r}, pid={pid})"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, *, wait: bool = True) -> AeronDriver:
        """Start the driver and wait until it is ready; ``wait=False`` returns once the java
        process runs (to start several drivers side by side), and :meth:`wait_ready` waits."""
        if self.process is not None:
            raise AeronError(f"{self!r} already started")
        existing = read_cnc(self.directory)
        if existing is not None and time.time() * 1000 - existing.heartbeat_ms < 5000:
            raise AeronError(f"a driver (pid {existing.pid}) is active in {self.directory}")
        self.process = JavaProcess(f"MediaDriver[{self.directory.name}]",
                                   "io.aeron.driver.MediaDriver", self.properties,
                                   jvm_args=self.jvm_args)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Wait until the started driver is ready (see the module docstring); stop it and
        raise if it does not get there within ``start_timeout``."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.process is not None
        launched_ms = self.process.started * 1000 - 1000  # a second of clock slack
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.process.alive():
                self.process.wait_exit(5.0, check=False)
                raise self.process.fail("the Aeron driver exited while starting")
            info = read_cnc(self.directory)
            if info is not None:
                now_ms = time.time() * 1000
                if (info.pid == self.process.pid and info.heartbeat_ms >= launched_ms
                        and now_ms - info.heartbeat_ms < 2000):
                    return
            if time.monotonic() > deadline:
                raise self.process.fail(
                    f"the Aeron driver was not ready within {self.start_timeout:g} s "
                    f"(cnc.dat: {info or 'absent or incomplete'})")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the driver (if running) and remove its directory if it named it; safe to call
        twice."""
        try:
            if self.process is not None:
                self.process.stop(self.stop_timeout)
        finally:
            if self._names_directory:
                shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> AeronDriver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inspection --------------------------------------------------------------------------
    def cnc(self) -> CncInfo:
        info = read_cnc(self.directory)
        if info is None:
            raise AeronError(f"no readable cnc.dat in {self.directory}")
        return info

    def heartbeat_age(self) -> float:
        """Seconds since the driver conductor last stamped its heartbeat."""
        return time.time() - self.cnc().heartbeat_ms / 1000

    def counters(self) -> list[Counter]:
        return read_counters(self.directory)

    def counter(self, label: str) -> int:
        """The value of the counter labelled exactly ``label`` (e.g. "NAKs sent")."""
        values = [c.value for c in self.counters() if c.label == label]
        if not values:
            raise KeyError(label)
        return values[0]

    def wait_for_counter(self, label_prefix: str, timeout: float = 10.0) -> Counter:
        """Block until a counter whose label starts with ``label_prefix`` exists, e.g.
        ``"rcv-channel: " + channel`` once a subscription to that UDP channel is in place."""
        deadline = time.monotonic() + timeout
        while True:
            for counter in self.counters():
                if counter.label.startswith(label_prefix):
                    return counter
            if self.process is None or not self.process.alive():
                raise AeronError(f"the driver is not running\n{self.output}")
            if time.monotonic() > deadline:
                raise AeronError(f"no counter {label_prefix!r} within {timeout:g} s")
            time.sleep(0.01)

    @property
    def output(self) -> str:
        return self.process.describe() if self.process else "(not started)"
