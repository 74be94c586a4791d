"""The driver conductor: client commands, resources (logs, counters), IPC publications, the
network side's endpoints, streams and images, timers and liveness.  It hands the agents their
work by commands and hears their events."""
