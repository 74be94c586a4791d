"""The outcome of a simulation run: counts per subscriber, protocol counters, timings, plots."""

from __future__ import annotations

import itertools
import json
from typing import Any, Final

import attrs

#: The keys of ``slipstream sim --json``, in order.
JSON_KEYS: Final = ("sent", "delivered", "duplicates", "out_of_order", "missing", "naks",
                    "retransmits", "virtual_seconds", "wall_seconds", "goodput", "clock")


@attrs.define
class Report:
    """What happened.  Lists have one entry per subscriber (hosts 2..N in order).

    * ``sent``: messages the publisher(s) appended to their logs;
    * ``delivered``: distinct messages each subscriber's handler received;
    * ``duplicates``: messages received again (must be 0: the log dedups retransmits);
    * ``out_of_order``: messages received after a higher sequence number of the same publisher;
    * ``missing``: messages not received of those appended since the subscriber's host first
      came up (a late joiner does not miss what was published before it started; one that
      joins the stream later than that, e.g. after a lost SETUP, or that crashed, does);
    * ``naks``: NAKs sent by all receivers; ``retransmits``: retransmissions sent;
    * ``virtual_seconds``: simulated time until everything was delivered (or the limit);
    * ``wall_seconds``: real time the run took;
    * ``goodput``: delivered payload bytes per virtual second, mean over subscribers (B/s);
      None (JSON null, "n/a" in the text) when no virtual time passed (a run with no delay
      and no rate limit happens at one instant), not measurable rather than 0.
    """

    sent: int
    delivered: list[int]
    duplicates: list[int]
    out_of_order: list[int]
    missing: list[int]
    naks: int
    retransmits: int
    virtual_seconds: float
    wall_seconds: float
    goodput: float | None
    # -- beyond the JSON -------------------------------------------------------------------
    completed: bool = False
    subscribers: list[str] = attrs.field(factory=list)
    corrupt: list[int] = attrs.field(factory=list)
    images_lost: list[int] = attrs.field(factory=list)
    network: dict[str, int] = attrs.field(factory=dict)  # trace events by kind
    counters: dict[str, dict[str, int]] = attrs.field(factory=dict)  # per host
    trace_digest: str = ""
    events: int = 0  # event-loop actions executed
    #: ``(t_ns, sender position, [subscriber position or None, ...])``, bytes.
    samples: list[tuple[int, int | None, list[int | None]]] = attrs.field(factory=list)
    #: ``(t_ns, stream position)`` of DATA datagrams from the publisher that were dropped.
    drops: list[tuple[int, int]] = attrs.field(factory=list)
    #: ``(t_ns, snd-lmt, send-rate limit in bytes/s or 0)``, sampled with the positions.
    limits: list[tuple[int, int, int]] = attrs.field(factory=list)
    #: ``(t_ns, destinations)`` of the publisher's multi-destination-cast endpoint (its
    #: ``mdc-destinations`` counter), sampled with the positions (``transport = "mdc"``).
    destinations: list[tuple[int, int]] = attrs.field(factory=list)
    #: Per subscriber: the longest virtual time between two deliveries (ns).
    longest_gaps_ns: list[int] = attrs.field(factory=list)
    #: Per subscriber: of ``missing``, the messages before the first it got (it joined late),
    #: and the stream ranges its images lost because they were left behind.
    joined_late: list[int] = attrs.field(factory=list)
    lost_ranges: list[list[tuple[int, int]]] = attrs.field(factory=list)
    #: Per subscriber, per entry of ``lost_ranges``: the join position of the image its
    #: driver made next and the seconds until it came, or None.
    #: What the sender sent from the range's end to that join is missed and not told as lost
    #: (docs/FLOW.md).
    rejoins: list[list[tuple[int, float] | None]] = attrs.field(factory=list)
    #: Whose seconds the times are: the simulator's ``"virtual"`` ones, or ``"real"`` ones
    #: from a run on namespace hosts (:mod:`slipstream.sim.real.on_hosts`).
    clock: str = "virtual"
    #: What the run could not give as the scenario asked (one line each).
    notes: list[str] = attrs.field(factory=list)

    @property
    def exactly_once_in_order(self) -> bool:
        """The run completed and every subscriber got, once each, in order and intact, every
        message it was owed: those appended since its host first came up (``missing`` is 0).

        A subscriber that came up late is owed nothing from before: its image starts where
        the stream was when it joined, so its ``delivered`` may be below ``sent`` (or above
        what it was owed, by messages still in flight when it came up) and the run is still
        exactly once.  The CLI's exit status is 0 exactly when this is true, and
        :meth:`problems` names each reason when it is not."""
        return not self.problems()

    def problems(self) -> list[str]:
        """Why the run is not exactly once and in order, one reason each (empty: it is)."""
        problems = []
        if not self.completed:
            problems.append("the virtual-time limit came before everything was delivered")
        count = max(len(self.subscribers), len(self.missing), len(self.duplicates),
                    len(self.out_of_order), len(self.corrupt))
        crashed_or_late = False
        for i in range(count):
            ip = self.subscribers[i] if i < len(self.subscribers) else f"subscriber {i + 1}"
            missing = _at(self.missing, i)
            late = _at(self.joined_late, i)
            left = self.lost_ranges[i] if i < len(self.lost_ranges) else []
            rejoined = self.rejoins[i] if i < len(self.rejoins) else []
            rest = sum(rejoin[0] - end for (_, end), rejoin in zip(left, rejoined, strict=False)
                       if rejoin is not None)
            if missing and (late or left):
                problems.append(
                    f"{ip} missed {missing}: {late} before it joined, {missing - late} after"
                    + (f" (left behind {len(left)} time(s), told of "
                       f"{sum(b - a for a, b in left):,} bytes lost"
                       + (f", {rest:,} more while it joined again" if rest else "") + ")"
                       if left else ""))
            elif missing:
                problems.append(f"{ip} missed {missing}")
            crashed_or_late = crashed_or_late or bool(missing and not left)
            for what, counts in (("duplicated", self.duplicates),
                                 ("got out of order", self.out_of_order),
                                 ("got corrupt", self.corrupt)):
                if _at(counts, i):
                    problems.append(f"{ip} {what} {_at(counts, i)}")
        if crashed_or_late:
            problems.append("a host that crashed, or joined late, misses what was published "
                            "while it was not there")
        return problems

    def verdict(self) -> str:
        """One line: exactly once and in order, or every reason it was not, with the exit
        status ``slipstream sim`` gives (0 or 1)."""
        problems = self.problems()
        if not problems:
            return ("every subscriber got every message since it came up exactly once, "
                    "in order (exit status 0)")
        return "not exactly once: " + "; ".join(problems) + " (exit status 1)"

    def to_json_dict(self) -> dict[str, Any]:
        """The ``--json`` object (snake_case keys, :data:`JSON_KEYS`)."""
        return {key: getattr(self, key) for key in JSON_KEYS}

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict())

    def format_text(self) -> str:
        """A human-readable summary."""
        lines = [
            f"sent          {self.sent} messages",
            "subscriber    delivered  duplicates  out_of_order  missing",
        ]
        for i, ip in enumerate(self.subscribers):
            lines.append(f"{ip:<13} {self.delivered[i]:>9}  {self.duplicates[i]:>10}  "
                         f"{self.out_of_order[i]:>12}  {self.missing[i]:>7}")
        if self.longest_gaps_ns:
            lines.append("longest gap   " + "  ".join(
                f"{gap / 1e6:.1f}" for gap in self.longest_gaps_ns)
                + " ms between deliveries, per subscriber")
        dropped = {k: v for k, v in self.network.items() if k.startswith("drop")}
        if any(self.corrupt):
            lines.append(f"corrupt       {self.corrupt} (payload did not match its header)")
        lines += [f"naks          {self.naks}", f"retransmits   {self.retransmits}"]
        if self.network:  # the simulator's network saw every datagram; real links do not say
            lines.append(f"datagrams     {self.network.get('deliver', 0)} delivered, " + (
                ", ".join(f"{v} {k[5:]}" for k, v in sorted(dropped.items())) or "none dropped"))
        lines += [
            f"{self.clock + ' time':<13} {self.virtual_seconds:.3f} s"
            + ("" if self.completed else "  (limit reached before everything was delivered)"),
            f"wall time     {self.wall_seconds:.2f} s",
            f"goodput       {self.goodput / 1e6:.2f} MB/s per subscriber "
            f"(delivered payload bytes per {self.clock} second)" if self.goodput is not None
            else f"goodput       n/a (no {self.clock} time passed: everything happened at one "
                 f"instant)",
        ]
        lines += [f"note          {note}" for note in self.notes]
        if self.trace_digest:
            lines.append(f"trace sha256  {self.trace_digest}")
        lines.append(f"result        {self.verdict()}")
        return "\n".join(lines)


def _at(counts: list[int], i: int) -> int:
    """``counts[i]``, 0 when the list stops short (a report built with fewer lists)."""
    return counts[i] if i < len(counts) else 0


def rejoins(left: list[tuple[Any, int, float]],
            joins: dict[Any, tuple[int, int, float]]) -> list[tuple[int, float] | None]:
    """A subscriber's :attr:`Report.rejoins`: for each image that went left behind
    (``left``: its key, its session id, when it went, s) the join position of the next image
    of that session (``joins``: key -> session id, join position, when it came, s; keys
    ordered as the driver made the images) and the seconds between, or None when none came."""
    found: list[tuple[int, float] | None] = []
    for key, session, went_s in left:
        following = [k for k, (s, _, _) in joins.items() if k > key and s == session]
        if following:
            _, join, came_s = joins[min(following)]
            found.append((join, came_s - went_s))
        else:
            found.append(None)
    return found


def subscriber_fields(stats: list[Any], ranges: list[tuple[int, int, int]]) -> dict[str, list]:
    """A :class:`Report`'s per-subscriber lists from each subscriber's
    :class:`~slipstream.sim.host.SubscriberStats` and the publishers' ``(id, first, end)``
    sequence ranges (the simulator's and a host run's alike)."""
    return {
        "delivered": [s.delivered for s in stats],
        "duplicates": [s.duplicates for s in stats],
        "out_of_order": [s.out_of_order for s in stats],
        "missing": [s.missing(ranges) for s in stats],
        "joined_late": [s.joined_late(ranges) for s in stats],
        "corrupt": [s.corrupt for s in stats],
        "longest_gaps_ns": [s.longest_gap_ns for s in stats],
    }


def plot_report(report: Report, path: str) -> None:
    """Draw stream positions over time and the dropped DATA datagrams to a PNG; below
    them the publisher's send rate, and its send-rate limit when it has one (``rc=``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rate_ax) = plt.subplots(2, 1, figsize=(10, 7.5), dpi=100, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.4]})
    mib = 1024 * 1024
    times = [t / 1e9 for t, _, _ in report.samples]
    sender = [None if p is None else p / mib for _, p, _ in report.samples]
    ax.plot(times, [float("nan") if p is None else p for p in sender],
            label="publisher sender position", color="black", linewidth=1.5)
    for i, ip in enumerate(report.subscribers):
        values = [float("nan") if subs[i] is None else subs[i] / mib
                  for _, _, subs in report.samples]
        ax.plot(times, values, label=f"subscriber {ip} position", linewidth=1, alpha=0.85)
    if report.limits:
        ax.plot([t / 1e9 for t, _, _ in report.limits],
                [limit / mib for _, limit, _ in report.limits], label="sender limit (snd-lmt)",
                color="grey", linewidth=0.8, linestyle="--")
    if report.drops:
        ax.scatter([t / 1e9 for t, _ in report.drops], [p / mib for _, p in report.drops],
                   marker="x", s=12, color="red", linewidths=0.8, alpha=0.6,
                   label=f"dropped DATA datagram ({len(report.drops)})")
    ax.set_ylabel("stream position (MiB)")
    where = "on namespace hosts" if report.clock == "real" else "sim"
    ax.set_title(f"slipstream {where}: {report.sent} messages, {report.naks} NAKs, "
                 f"{report.retransmits} retransmits")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    # The send rate between samples, and the limit NAK-strength signals set.
    sent = [(t, p) for t, p, _ in report.samples if p is not None]
    rate_ax.plot([b[0] / 1e9 for b in sent[1:]],
                 [(b[1] - a[1]) / (b[0] - a[0]) * 1e9 / 1e6 if b[0] > a[0] else 0.0
                  for a, b in itertools.pairwise(sent)],
                 label="send rate", color="black", linewidth=1)
    if any(rate for _, _, rate in report.limits):
        rate_ax.plot([t / 1e9 for t, _, _ in report.limits],
                     [rate / 1e6 if rate else float("nan") for _, _, rate in report.limits],
                     label="send-rate limit (rc=nak-strength; gaps: none)", color="tab:red",
                     linewidth=1)
    rate_ax.set_xlabel(f"{report.clock} time (s)")
    rate_ax.set_ylabel("MB/s")
    rate_ax.grid(True, alpha=0.3)
    rate_ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
