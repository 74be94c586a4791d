"""slipstream's archive: streams recorded to segment files on disk (Aeron Archive's shape).

One service per host (``slipstream-archive run``), a client of the host's driver, records
streams from their logs into ``<recording id>-<segment base position>.rec`` segment files laid
out exactly as the log's terms, with a catalog of fixed-size descriptors updated in place.
docs/ARCHIVE.md is the operator's and the format's reference.

The public names for the pieces that build on the recordings (replay, a second archive):

- :class:`Catalog`, :class:`RecordingDescriptor`, :class:`RecordingState`, :class:`EndReason`:
  what was recorded, where it starts and stops, how it ended;
- :func:`segment_file_name`, :func:`parse_segment_file_name`, :func:`segment_base`,
  :func:`segment_files`, :func:`scan_segment`: the segment files and their frames;
- :class:`ArchiveSettings`, :func:`load_settings`: the service's settings;
- :class:`ArchiveService` and :class:`Recording`: the recording side;
- :class:`ArchiveClient` (the control stream's calls, replays), :class:`RecordingReader` (the
  local reader of segment files), :class:`ReplayMerge` (a late subscriber caught up from a
  replay, then live, failing over between archives), :class:`RecordingLostError` (a range
  not held);
- :func:`locate` and :class:`HeldRange`: where a session's range is held, over several
  recordings and archives (a second archive's replicas, docs/ARCHIVE.md "Two archives");
  :func:`read_session`: its messages read across them, in place or replayed, failing over
  (the one failover reader; :class:`LostRange` and :class:`SessionLostError`: what none
  holds).
"""

from slipstream.archive.catalog import (
    Catalog,
    CatalogError,
    EndReason,
    RecordingDescriptor,
    RecordingState,
)
from slipstream.archive.client import ArchiveClient, ArchiveReplay, ListedRecording
from slipstream.archive.locate import (
    HeldRange,
    LostRange,
    SessionLostError,
    locate,
    read_session,
)
from slipstream.archive.merge import MergeState, ReplayMerge
from slipstream.archive.reading import RecordingLostError, RecordingReader
from slipstream.archive.segments import (
    ScanResult,
    parse_segment_file_name,
    scan_segment,
    segment_base,
    segment_file_name,
    segment_files,
)
from slipstream.archive.settings import (
    ArchiveSettings,
    ArchiveSettingsError,
    RecordSpec,
    SyncPolicy,
    load_settings,
)

__all__ = [
    "ArchiveClient",
    "ArchiveReplay",
    "ArchiveSettings",
    "ArchiveSettingsError",
    "Catalog",
    "CatalogError",
    "EndReason",
    "HeldRange",
    "ListedRecording",
    "LostRange",
    "MergeState",
    "RecordSpec",
    "RecordingDescriptor",
    "RecordingLostError",
    "RecordingReader",
    "RecordingState",
    "ReplayMerge",
    "ScanResult",
    "SessionLostError",
    "SyncPolicy",
    "load_settings",
    "locate",
    "parse_segment_file_name",
    "read_session",
    "scan_segment",
    "segment_base",
    "segment_file_name",
    "segment_files",
]
