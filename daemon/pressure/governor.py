"""The pressure governor (docs/BACKPRESSURE.md): under load the driver degrades latency along
a fixed ladder, never correctness.

Every :data:`SAMPLE_INTERVAL_NS` (every :data:`CALM_SAMPLE_INTERVAL_NS` while calm: see there)
the conductor samples three signals into one pressure in [0, 1], the largest of:

* **send backlog**: of each network publication, the data its flow control lets it send but
  the sender has not sent yet, as a share of what flow control lets it send (the largest
  share; a publication whose data waits on purpose does not count: one the governor defers,
  one paced by its send-rate limit);
* **duty-cycle lag**: how late the network threads' timed wake-ups (a park that ends on its
  timer) come beyond :data:`LAG_FLOOR_NS`, as a share of the rest of :data:`LAG_CEILING_NS`
  (a smoothed average, the latest thread's; none once its last sample is
  :data:`LAG_MAX_AGE_NS` old, :func:`recent_lag_ns`).  A machine too busy to run a woken
  thread makes them late; a conductor slow in Python (the GIL) does not, and neither does it
  show in the data path, whose loops are C.  A thread that never parks on its timer (busy, or
  woken by its sockets) shows in the other two signals instead.  An embedded driver has no
  network thread: its lag is 0;
* **busy ratio**: the share of the time the network threads spent in the C halves of duty
  cycles that did work (a thread that yields or parks is not busy, however many short idle
  cycles it ran or did not run; the Python halves are not counted), halved, so that a busy
  thread alone climbs no higher than the lossless second step.  An embedded driver's cycles
  are the application's and do not count.

The ladder, one step per sample, each with hysteresis (a step is left only when the pressure
falls well below what entered it):

====  ==================================  ==========  ==========  =======================
step  what the driver does                enter at    leave at    loses anything?
====  ==================================  ==========  ==========  =======================
1     coalesce: new data short of a       > 0.2       < 0.1       no (latency)
      datagram waits up to COALESCE_NS
2     widen the status-message interval   > 0.4       < 0.3       no
      (status_message_timeout x 4, at
      most a fifth of a sender timeout:
      widest_status_interval_ns)
3     defer the lowest band (priority <   > 0.8 for   < 0.6       no: its data waits in
      0): it gets no turn in the sender   3 samples               the log
4     refuse its offers: its pub-lmt      > 0.95 for  < 0.8       no: offers see
      stays where the producer is         3 samples               BACK_PRESSURED
====  ==================================  ==========  ==========  =======================

Each step's entries, the climbs and descents (and of the climbs, those the lag led), the step
and the pressure (per mille) are system counters.  Sans-I/O: :meth:`PressureGovernor.sample`
takes the signals and ``now``.
"""

from __future__ import annotations

import attrs

#: How often the conductor samples the signals, unless the governor is calm.
SAMPLE_INTERVAL_NS = 100_000_000
#: How often while calm (:attr:`PressureGovernor.is_calm`), at the latest; the conductor also
#: takes a calm sample on its timer's cycles (timer_interval), at most every
#: SAMPLE_INTERVAL_NS, so that the two share a wake-up.  Each wake-up of the conductor runs
#: 0.4-0.6 ms of Python on these VMs, and on a machine whose cores the data path's threads
#: keep busy it takes one of them for that long (docs/BACKPRESSURE.md, Why it waits as it
#: does).  A calm sample averages the busy ratio over its whole interval, so a load that comes
#: shows in the first or second sample after it began (within about 1-2 s), and is sampled
#: every SAMPLE_INTERVAL_NS from then on.  The lag signal is only as recent as LAG_MAX_AGE_NS.
CALM_SAMPLE_INTERVAL_NS = 1_000_000_000
#: The duty-cycle lag that counts as full pressure, and the lag that counts as none (a wake-up
#: late by less is the scheduler's ordinary latency on a VM, or the grain of a kernel whose
#: epoll counts whole milliseconds).
LAG_CEILING_NS = 5_000_000
LAG_FLOOR_NS = 1_000_000
#: A thread's lag is news for this long after its last timed wake-up; then it counts as none
#: (an old stall must not hold the ladder up).  Two watched samples' worth: a calm sample
#: sees only the lag of the last fifth of its interval, which a lasting lag still shows.
LAG_MAX_AGE_NS = 200_000_000
#: How long step 1 lets new data short of a datagram wait for more.
COALESCE_NS = 200_000
#: Step 2: the status-message interval is multiplied by this, up to
#: :func:`widest_status_interval_ns`.
STATUS_INTERVAL_FACTOR = 4
#: How many keepalive status messages step 2 still lets a receiver send within the shortest
#: sender timeout it is configured with: the number the defaults give at step 0 against a
#: sender with one-second timeouts (200 ms against 1 s); never fewer than step 0 sends.  A
#: keepalive is what keeps a receiver in its sender's min or tagged flow control and the
#: publication connected; one lost or late among keepalives widened past this, and a
#: receiver that has not read since it joined (a replay merge's live image) is dropped from
#: min flow control, the sender runs on, and it is left behind: a loss, which no step of the
#: ladder may cost.
KEEPALIVES_PER_SENDER_TIMEOUT = 5
TOP_STEP = 4


def widest_status_interval_ns(status_message_timeout_ns: int,
                              sender_timeouts_ns: tuple[int, ...]) -> int:
    """The longest interval between a receiver's keepalive status messages that step 2 may
    widen to, ns: a :data:`KEEPALIVES_PER_SENDER_TIMEOUT`-th of the shortest of
    ``sender_timeouts_ns`` (the receiving driver's own ``publication_connection_timeout`` and
    ``flow_control_receiver_timeout``: a sender configured as its receivers are hears from
    each often enough), never below ``status_message_timeout_ns``.  A sender whose channel
    sets a shorter ``t:`` than its receivers' drivers know of is not covered: the receiver
    cannot see it.  ``receiver_rebind_timeout`` (1 s) is not counted: it guards a receiver's
    binding against a host that forges its id, and loses no data; counting it would leave
    step 2 nothing to widen at the defaults.  At step 2 a receiver one of whose keepalives
    is lost may lose its binding to such a forger for a while (docs/DRIVER.md §5.7), which
    an encrypted channel rules out."""
    return max(status_message_timeout_ns,
               min(sender_timeouts_ns) // KEEPALIVES_PER_SENDER_TIMEOUT)


@attrs.frozen
class Rung:
    """One step of the ladder: entered above ``enter`` for ``samples`` samples in a row,
    left below ``leave``."""

    enter: float
    leave: float
    samples: int = 1


LADDER: tuple[Rung, ...] = (
    Rung(0.2, 0.1),
    Rung(0.4, 0.3),
    Rung(0.8, 0.6, samples=3),
    Rung(0.95, 0.8, samples=3),
)


def recent_lag_ns(lag_ns: int, sampled_ns: int, now_ns: int) -> int:
    """A network thread's smoothed lag, ns, if its last sample (a timed wake-up) is at most
    :data:`LAG_MAX_AGE_NS` old at ``now_ns``; else 0: a thread that wakes on its sockets or
    never parks has no news of lateness, and an old stall must not hold the ladder up."""
    return lag_ns if now_ns - sampled_ns <= LAG_MAX_AGE_NS else 0


def _lag_share(lag_ns: float) -> float:
    return (lag_ns - LAG_FLOOR_NS) / (LAG_CEILING_NS - LAG_FLOOR_NS)


def pressure_of(backlog: float, lag_ns: float, busy: float) -> float:
    """One pressure in [0, 1] from the three signals (module doc)."""
    return max(0.0, min(1.0, max(backlog, _lag_share(lag_ns), busy / 2)))


def is_lag_led(backlog: float, lag_ns: float, busy: float) -> bool:
    """Whether the duty-cycle lag is the largest of the three signals (or ties it): a climb
    it leads is the machine's, too busy to run the network threads when their timers ring,
    not the driver's own load (``GOVERNOR_LAG_CLIMBS``)."""
    return _lag_share(lag_ns) >= max(backlog, busy / 2)


class PressureGovernor:
    """The ladder's state: :attr:`step` 0 (no pressure) to :data:`TOP_STEP`."""

    def __init__(self) -> None:
        self.step = 0
        self.pressure = 0.0
        self.climbs = 0
        self.descents = 0
        self.entries = [0] * (TOP_STEP + 1)  # by step
        self._above = 0  # samples in a row above the next rung's entry

    @property
    def is_calm(self) -> bool:
        """At the bottom of the ladder, the last pressure below the first rung's leave mark
        (no sample yet counts as calm): nothing to follow closely."""
        return self.step == 0 and self.pressure < LADDER[0].leave

    def sample_interval_ns(self) -> int:
        """How long until the next sample, at the latest."""
        return CALM_SAMPLE_INTERVAL_NS if self.is_calm else SAMPLE_INTERVAL_NS

    def sample(self, pressure: float) -> int:
        """Take one sample; returns the step change (+1, -1 or 0)."""
        self.pressure = pressure
        if self.step < TOP_STEP:
            rung = LADDER[self.step]
            self._above = self._above + 1 if pressure > rung.enter else 0
            if self._above >= rung.samples:
                self.step += 1
                self.climbs += 1
                self.entries[self.step] += 1
                self._above = 0
                return 1
        if self.step > 0 and pressure < LADDER[self.step - 1].leave:
            self.step -= 1
            self.descents += 1
            self._above = 0
            return -1
        return 0
