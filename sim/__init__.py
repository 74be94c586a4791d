"""slipstream's deterministic network simulator (``slipstream sim``; docs/SIMULATOR.md).

It runs the *real* sans-I/O protocol core (``daemon/streams/publication.py``,
``daemon/media/receive_channel.py``, ``daemon/streams/image.py``, flow control, loss detection,
retransmits) with real log buffers, the C appender and the client's Image reader, over a
virtual network in virtual time: faster than real time, and the same seed gives the same run
byte for byte.

Modules:

* :mod:`~slipstream.sim.events`: the discrete-event loop (virtual ns clock, heap of actions);
* :mod:`~slipstream.sim.network`: hosts, per-direction links with loss, Gilbert-Elliott
  bursts, delay, jitter, reordering, duplication, bandwidth + tail-drop queue; partitions,
  crashes, multicast groups; the trace and its SHA-256 digest;
* :mod:`~slipstream.sim.host`: the adapter between the network and the protocol core (a
  publisher host and subscriber hosts, crash/restart);
* :mod:`~slipstream.sim.scenario`: what to run (code or TOML), with errors naming the key;
* :mod:`~slipstream.sim.runner`: :class:`~slipstream.sim.runner.Simulation` and
  :func:`~slipstream.sim.runner.run_scenario`;
* :mod:`~slipstream.sim.report`: the report (``--json``) and the position plot;
* :mod:`~slipstream.sim.capture`: a decoded packet capture of a run, for timing checks;
* :mod:`~slipstream.sim.cli`: the ``slipstream sim`` command.

Apart from the virtual network, :mod:`slipstream.sim.real` holds the tools for real machines:
namespace hosts and the relay (``slipstream sim hosts|relay``), the chaos run and the fuzzers.
"""

from slipstream.sim.network import LinkFaults
from slipstream.sim.report import Report
from slipstream.sim.runner import Simulation, run_scenario
from slipstream.sim.scenario import Event, Scenario, ScenarioError, load_scenario

__all__ = ["Event", "LinkFaults", "Report", "Scenario", "ScenarioError", "Simulation",
           "load_scenario", "run_scenario"]
