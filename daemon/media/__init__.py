"""The channel endpoints, under the agents: their dispatchers (control frames to publications;
data, SETUP and RTTM to images, or a request for one), the UDP sockets and transports
(unicast, multicast, the C receive and send paths bound to real sockets) and host-name
resolution for channel endpoints."""
