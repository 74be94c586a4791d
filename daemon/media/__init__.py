"""The media under the agents: UDP sockets and transports (unicast, multicast, the C receive
and send paths bound to real sockets) and host-name resolution for channel endpoints."""
