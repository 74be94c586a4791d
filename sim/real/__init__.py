"""The simulator's tools for real machines: the same faults and hostile input, applied to real
driver processes, sockets and network namespaces instead of the virtual network
(docs/SIMULATOR.md, "The same faults on real sockets").

Modules:

* :mod:`~slipstream.sim.real.hosts`: test hosts, network namespaces on a bridge with a driver
  in each, and the kernel's faults between them (``slipstream sim hosts``);
* :mod:`~slipstream.sim.real.relay`: a UDP relay whose directions are simulator links driven
  by the real clock: delay, jitter, reordering, duplication (``slipstream sim relay``);
* :mod:`~slipstream.sim.real.chaos`: publishers, subscribers and the driver killed and
  replaced at random through a long run on one host;
* :mod:`~slipstream.sim.real.fuzz`: malformed and mutated datagrams and control commands for a
  running driver.
"""
