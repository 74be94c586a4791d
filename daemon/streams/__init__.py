"""One stream's state machines: the network publication (sender side: SETUP, heartbeats, flow
control, retransmits) and the publication image (receiver side: rebuild, loss, status
messages), built from :mod:`~slipstream.daemon.protocol` and :mod:`~slipstream.daemon.flow`."""
