"""A stock Aeron 1.15.1 media driver (Java) and its sample programs, run as subprocesses: the
peer for slipstream's interop tests and benchmarks.

The tests import it as ``aeron_peer`` (pytest puts tests/ on sys.path); the benchmarks, run
from the repository root, as ``tests.aeron_peer``.  Install the Java pieces with
``scripts/ensure-aeron`` (``make aeron``); :func:`aeron_available` says whether they are there.

    with AeronDriver(receive_data_loss_rate=0.05) as driver:
        with basic_subscriber(driver.directory, CHANNEL, 10) as sub:
            basic_publisher(driver.directory, CHANNEL, 10, messages=5)
            sub.wait_for_messages(5)
            assert sub.hello_world_numbers() == [0, 1, 2, 3, 4]

Every Java process runs in its own process group, ended with the ``with`` block, an error or
the interpreter's exit.  One module per job:

* ``install.py``: finding the Aeron jar and a Java 11 runtime;
* ``process.py``: running a Java process of the jar and reading its output;
* ``cnc.py``: reading the driver's CnC file (heartbeat, counters) and log buffer metadata;
* ``driver.py``: ``AeronDriver``, the Java media driver with its loss, flow-control and
  congestion-control settings;
* ``samples.py``: Aeron's sample programs and what they print, parsed;
* ``mdc.py``: ``MdcPublisher``, our own Java program (``java/MdcPublisher.java``) adding and
  removing multi-destination-cast destinations and offering messages on command, and
  ``MdsSubscriber`` (``java/MdsSubscriber.java``), a multi-destination subscription's;
* ``errors.py``: the errors, all ``AeronError``.
"""

from .cnc import Counter, read_counters
from .driver import DEFAULT_LIVENESS_NS, FAST_TIMEOUTS, AeronDriver
from .errors import AeronError, AeronNotInstalled, SampleFailed
from .install import aeron_available, peer_available
from .mdc import MdcPublisher, MdsStatus, MdsSubscriber
from .samples import (
    BasicSubscriber,
    ImageEvent,
    PingResult,
    Pong,
    PublisherResult,
    RateReport,
    RateSubscriber,
    ReceivedMessage,
    StreamingResult,
    basic_publisher,
    basic_subscriber,
    hold_connected_publication,
    ping,
    pong,
    rate_subscriber,
    streaming_publisher,
)

__all__ = [
    "DEFAULT_LIVENESS_NS",
    "FAST_TIMEOUTS",
    "AeronDriver",
    "AeronError",
    "AeronNotInstalled",
    "BasicSubscriber",
    "Counter",
    "ImageEvent",
    "MdcPublisher",
    "MdsStatus",
    "MdsSubscriber",
    "PingResult",
    "Pong",
    "PublisherResult",
    "RateReport",
    "RateSubscriber",
    "ReceivedMessage",
    "SampleFailed",
    "StreamingResult",
    "aeron_available",
    "basic_publisher",
    "basic_subscriber",
    "hold_connected_publication",
    "peer_available",
    "ping",
    "pong",
    "rate_subscriber",
    "read_counters",
    "streaming_publisher",
]
