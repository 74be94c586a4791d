"""Operator tools around a running driver: ``slipstream stat``, the Prometheus exporter and the
systemd notify protocol and watchdog."""
