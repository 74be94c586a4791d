"""Prometheus metrics from the counters file, which is the interface (docs/ARCHITECTURE.md).

The exporter reads ``counters.dat`` on every scrape and touches nothing else, so it runs inside
the driver (``metrics_address = "127.0.0.1:9100"``) or as its own process beside a driver it
does not disturb (``slipstream metrics --dir DIR --address 127.0.0.1:9100``).

Series (names and units as Prometheus expects):

* every system counter: ``slipstream_<name>_total`` (``slipstream_sent_bytes_total``,
  ``slipstream_nak_messages_sent_total``, ...), and the conductor's longest duty cycle as the
  gauge ``slipstream_conductor_max_cycle_seconds``;
* every position counter as ``slipstream_position_bytes{kind, channel, stream, session}``, kind
  one of ``pub-lmt``, ``pub-pos``, ``snd-pos``, ``snd-lmt``, ``rcv-hwm``, ``rcv-pos``,
  ``sub-pos`` (a subscriber's also labelled with its ``subscription``);
* ``slipstream_send_rate_limit_bytes_per_second{channel, stream, session}``: the send-rate
  limit of each ``rc=`` publication (0: none);
* ``slipstream_flow_control_receivers{channel, stream, session}``: the receivers min or
  tagged flow control holds each publication to (``fc-receivers``);
* each publication's back-pressure episodes (docs/BACKPRESSURE.md), labelled ``{channel, stream,
  session}``: ``slipstream_backpressure_episodes_total``,
  ``slipstream_backpressure_seconds_total`` (time in them), the gauges
  ``slipstream_backpressure_depth_bytes`` and ``slipstream_backpressure_peak_bytes``, and
  ``slipstream_publication_drops_total`` (offers ``policy=drop-newest`` dropped);
* each image's congestion-control counters, ``{channel, stream, session, source}``, under
  the names and types their strategy declares (``counters`` on its class,
  daemon/flow/strategy.py), for every strategy registered (daemon/flow/registry.py);
* each counter a client added (``Client.add_counter``) as a gauge of its type,
  ``slipstream_<type name>`` for a type :class:`CounterType` names
  (``slipstream_recording_position``), else ``slipstream_client_counter_<type id>``, labelled
  ``{label, client, registration, key}`` (the owner's client id, the key in hex): one series
  per counter, one family per type, so that a sum over a family adds like things;
* every capacity a user can reach (:func:`~slipstream.client.counters.capacities`:
  ``counters_capacity``, ``log_buffer_memory_limit``, the image bounds), labelled
  ``{setting}`` by the setting that bounds it: ``slipstream_capacity_used`` (its use now) and
  ``slipstream_capacity_limit`` (the setting's value) for counts, ``..._bytes`` for bytes;
* ``slipstream_clients``: clients connected; ``slipstream_driver_heartbeat_age_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from slipstream.client import control
from slipstream.client.counters import (
    DROP_CAUSES,
    POSITION_TYPES,
    CountersFile,
    CounterType,
    SystemCounter,
    capacities,
    is_driver_type,
    parse_position_label,
)
from slipstream.client.errors import ConfigurationError
from slipstream.daemon.flow.registry import CONGESTION_CONTROLS

#: System counters that hold a value now rather than a count: Prometheus gauges.
_SYSTEM_GAUGES = (SystemCounter.GOVERNOR_PRESSURE, SystemCounter.GOVERNOR_STEP,
                  SystemCounter.RELEASED_LOG_BYTES, SystemCounter.RELEASED_LOGS_READY)


def metric_name(counter: SystemCounter) -> str:
    """The Prometheus name of a system counter (units last, as the conventions ask)."""
    if counter is SystemCounter.BYTES_SENT:
        return "slipstream_sent_bytes"
    if counter is SystemCounter.BYTES_RECEIVED:
        return "slipstream_received_bytes"
    return f"slipstream_{counter.name.lower()}"


def client_counter_metric_name(type_id: int) -> str:
    """The Prometheus family of the counters clients added of ``type_id``."""
    try:
        return f"slipstream_{CounterType(type_id).name.lower()}"
    except ValueError:
        return f"slipstream_client_counter_{type_id}"


def metrics_url(server: Any) -> str:
    """The URL an exporter serves at: the address it is bound to (the port the kernel gave
    for port 0), an IPv6 host in brackets."""
    host, port = server.server_address[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


class CountersCollector(Collector):
    """Reads the counters file of the driver in ``directory`` at each scrape."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / control.COUNTERS_FILE

    def collect(self) -> Iterator[Any]:
        try:
            counters = CountersFile(self.path, writable=False)
        except (OSError, ValueError):
            return  # no driver (yet): no series
        try:
            yield from self._families(counters)
        finally:
            counters.close()

    def _families(self, counters: CountersFile) -> Iterator[Any]:
        positions = GaugeMetricFamily(
            "slipstream_position_bytes", "Stream positions (bytes) by kind",
            labels=["kind", "channel", "stream", "session", "subscription"])
        rate_limits = GaugeMetricFamily(
            "slipstream_send_rate_limit_bytes_per_second",
            "Send-rate limits of rc= publications (0: none)",
            labels=["channel", "stream", "session"])
        receivers = GaugeMetricFamily(
            "slipstream_flow_control_receivers",
            "Receivers min / tagged flow control holds each publication to",
            labels=["channel", "stream", "session"])
        destinations = GaugeMetricFamily(
            "slipstream_mdc_destinations",
            "Destinations of each multi-destination-cast send endpoint", labels=["channel"])
        receive_destinations = GaugeMetricFamily(
            "slipstream_mds_destinations",
            "Destinations of each multi-destination subscription's receive endpoint",
            labels=["channel"])
        image_labels = ["channel", "stream", "session", "source"]
        # An image's congestion-control counters by label kind, as their strategies declare
        # them: (family, scale to its unit).
        congestion = {
            counter.label: ((GaugeMetricFamily if counter.type == "gauge"
                             else CounterMetricFamily)(counter.metric, counter.help,
                                                       labels=image_labels), counter.scale)
            for strategy in CONGESTION_CONTROLS.values() for counter in strategy.counters}
        labels = ["channel", "stream", "session"]
        pressure = {
            CounterType.BP_EPISODES: CounterMetricFamily(
                "slipstream_backpressure_episodes", "Back-pressure episodes that began",
                labels=labels),
            CounterType.BP_TIME: CounterMetricFamily(
                "slipstream_backpressure_seconds", "Time spent in back-pressure episodes",
                labels=labels),
            CounterType.BP_DEPTH: GaugeMetricFamily(
                "slipstream_backpressure_depth_bytes",
                "Bytes of the publication's window in use", labels=labels),
            CounterType.BP_PEAK: GaugeMetricFamily(
                "slipstream_backpressure_peak_bytes",
                "The most bytes of the publication's window ever in use", labels=labels),
            CounterType.PUBLISHER_DROPS: CounterMetricFamily(
                "slipstream_publication_drops", "Offers policy=drop-newest dropped",
                labels=labels),
        }
        drops = CounterMetricFamily(
            "slipstream_drops", "What the driver received and dropped, by cause "
            "(docs/SECURITY.md)", labels=["cause"])
        clients = 0
        every = list(counters)
        owned: dict[int, GaugeMetricFamily] = {}  # the counters clients added, by type id
        for info in every:
            if not is_driver_type(info.type_id):
                family = owned.get(info.type_id)
                if family is None:
                    family = owned[info.type_id] = GaugeMetricFamily(
                        client_counter_metric_name(info.type_id),
                        f"Counters of type {info.type_id} that clients added",
                        labels=["label", "client", "registration", "key"])
                family.add_metric([info.label, str(info.owner_id), str(info.registration_id),
                                   info.key.hex()], info.value)
            elif info.type_id == CounterType.SYSTEM:
                try:
                    counter = SystemCounter(info.counter_id)
                except ValueError:
                    continue
                if counter in DROP_CAUSES:
                    drops.add_metric([DROP_CAUSES[counter]], info.value)
                if counter is SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS:
                    yield GaugeMetricFamily("slipstream_conductor_max_cycle_seconds",
                                            "The conductor's longest duty cycle",
                                            value=info.value / 1e9)
                elif counter in _SYSTEM_GAUGES:  # a value now, which may go down
                    yield GaugeMetricFamily(f"slipstream_{counter.name.lower()}",
                                            counter.label, value=info.value)
                elif counter is SystemCounter.NETWORK_BUSY_NS:
                    yield CounterMetricFamily("slipstream_network_busy_seconds",
                                              "Time the network threads spent in duty cycles "
                                              "that did work", value=info.value / 1e9)
                else:
                    yield CounterMetricFamily(metric_name(counter), counter.label,
                                              value=info.value)
            elif info.type_id == CounterType.CLIENT_HEARTBEAT:
                clients += 1
            elif info.type_id in POSITION_TYPES:
                parsed = parse_position_label(info.label)
                if parsed is not None:
                    sub = parsed.subscription_id
                    positions.add_metric([parsed.kind, parsed.channel, str(parsed.stream_id),
                                          str(parsed.session_id), "" if sub is None else str(sub)],
                                         info.value)
            elif info.type_id in (CounterType.SENDER_RATE_LIMIT, CounterType.FC_RECEIVERS):
                parsed = parse_position_label(info.label)
                if parsed is not None:
                    family = (rate_limits if info.type_id == CounterType.SENDER_RATE_LIMIT
                              else receivers)
                    family.add_metric([parsed.channel, str(parsed.stream_id),
                                       str(parsed.session_id)], info.value)
            elif info.type_id == CounterType.MDC_DESTINATIONS:
                destinations.add_metric([info.label.partition(": ")[2]], info.value)
            elif info.type_id == CounterType.MDS_DESTINATIONS:
                receive_destinations.add_metric([info.label.partition(": ")[2]], info.value)
            elif info.type_id == CounterType.PER_IMAGE_INDICATOR:
                parsed = parse_position_label(info.label)
                if parsed is not None and parsed.kind in congestion:
                    family, scale = congestion[parsed.kind]
                    family.add_metric([parsed.channel, str(parsed.stream_id),
                                       str(parsed.session_id), parsed.source or ""],
                                      info.value * scale)
            elif info.type_id in pressure:
                parsed = parse_position_label(info.label)
                if parsed is not None:
                    value = (info.value / 1e9 if info.type_id == CounterType.BP_TIME
                             else info.value)
                    pressure[CounterType(info.type_id)].add_metric(
                        [parsed.channel, str(parsed.stream_id), str(parsed.session_id)], value)
        yield drops
        yield positions
        yield from pressure.values()
        yield rate_limits
        yield receivers
        yield destinations
        yield receive_destinations
        for family, _ in congestion.values():
            yield family
        yield from owned.values()
        yield GaugeMetricFamily("slipstream_clients", "Clients connected to the driver",
                                value=clients)
        yield GaugeMetricFamily("slipstream_counters_allocated",
                                "Counters in use in the driver's counters file",
                                value=len(every))
        yield GaugeMetricFamily(
            "slipstream_counters_capacity",
            "Counters the driver's counters file holds (the setting counters_capacity)",
            value=counters.capacity)
        # One family per unit, its name saying it, so that a sum over a family adds like
        # things: counts in slipstream_capacity_used, bytes in slipstream_capacity_used_bytes.
        families: dict[str, tuple[GaugeMetricFamily, GaugeMetricFamily]] = {}
        for capacity in capacities(counters, every):
            if capacity.unit not in families:
                suffix = "" if capacity.unit == "count" else f"_{capacity.unit}"
                families[capacity.unit] = (
                    GaugeMetricFamily(
                        f"slipstream_capacity_used{suffix}", "What each capacity a user can "
                        f"reach holds now ({capacity.unit}), by the setting that bounds it",
                        labels=["setting"]),
                    GaugeMetricFamily(
                        f"slipstream_capacity_limit{suffix}",
                        f"Each capacity's bound ({capacity.unit}): its setting's value",
                        labels=["setting"]))
            used, limit = families[capacity.unit]
            used.add_metric([capacity.setting], capacity.used)
            limit.add_metric([capacity.setting], capacity.limit)
        for used, limit in families.values():
            yield used
            yield limit
        yield GaugeMetricFamily(
            "slipstream_driver_heartbeat_age_seconds", "Time since the driver's last duty cycle",
            value=max(0.0, (time.time_ns() - counters.driver_heartbeat_ns) / 1e9))


def start_exporter(directory: str | Path, host: str, port: int, *,
                   key: str = "metrics_address") -> tuple[Any, Any]:
    """Serve the driver's metrics at ``http://host:port/metrics`` from a daemon thread;
    returns ``(server, thread)`` (``server.shutdown()`` stops it).  Port 0 picks a free one:
    ``server.server_address`` says which.  An address it cannot listen on (a port in use, an
    address not of this host) is a ConfigurationError naming ``key``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CountersCollector(directory))
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigurationError(key, f"cannot listen on {host}:{port}: "
                                      f"{e.strerror or e}") from e


def run_metrics(directory: str | None, address: str) -> int:
    """``slipstream metrics``: serve until interrupted."""
    from slipstream.client.client import default_directory
    from slipstream.daemon.config import parse_host_port

    host, port = parse_host_port(address, "--address")
    server, _thread = start_exporter(directory or default_directory(), host, port,
                                     key="--address")
    print(f"slipstream metrics: {metrics_url(server)}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
