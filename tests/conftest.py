"""Shared fixtures: real driver processes in private directories under /dev/shm."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
from helpers import DRIVER_START_TIMEOUT_S, FAST_DRIVER_SETTINGS, NETWORK_SETTINGS, lacking

# installed_venv: the wheel in a fresh venv; slipstream_image and containers: the image;
# loops: the event loops the async tests marked anyio run under
pytest_plugins = ["installed", "containers", "loops"]

# Properties are judged by what each example does, not how fast: the unit and sim lanes run
# niced beside the drivers' lanes (scripts/run-lanes), where an example may wait for the CPU
# past hypothesis' default 200 ms deadline.
hypothesis.settings.register_profile("slipstream", deadline=None)
hypothesis.settings.load_profile("slipstream")

#: The session's bytecode cache of the Python processes the tests start, made by
#: :func:`pytest_configure` (None: the environment's own rule stands).
_PYCACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (without ``PYTHONPYCACHEPREFIX``), every process the
    tests start (a driver, a CLI, a holder, a Spark task's worker) would compile each module
    of the checkout again: a quarter of a second of CPU for a driver's start, hundreds of
    seconds over the suite.  Their bytecode goes to a cache of the session's instead (under
    the temporary directory, world-readable, removed at the end), never into the checkout,
    which is what the variable keeps clean.  Processes of other users read it and write
    nothing (Python ignores a cache it cannot write); the installed package's commands run
    without either variable (tests/installed.py)."""
    global _PYCACHE
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        _PYCACHE = Path(tempfile.mkdtemp(prefix="slipstream-pycache-"))
        _PYCACHE.chmod(0o755)
        os.environ["PYTHONPYCACHEPREFIX"] = str(_PYCACHE)
        del os.environ["PYTHONDONTWRITEBYTECODE"]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _PYCACHE
    if _PYCACHE is not None:
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        shutil.rmtree(_PYCACHE, ignore_errors=True)
        _PYCACHE = None


@pytest.fixture
def driver_dir() -> Iterator[Path]:
    """A fresh driver directory path (not created), removed afterwards whatever happened."""
    path = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def driver(driver_dir: Path):  # -> Iterator[MediaDriver]
    """A real driver process with fast timers."""
    from slipstream.daemon.driver import MediaDriver

    with MediaDriver.launch(directory=driver_dir, startup_timeout=DRIVER_START_TIMEOUT_S,
                            **FAST_DRIVER_SETTINGS) as media_driver:
        yield media_driver


@pytest.fixture
def client(driver):  # -> Iterator[Client]
    from slipstream.client import Client

    with Client.connect(driver.directory) as connected:
        yield connected


@pytest.fixture
def launch():  # -> Iterator[Callable[..., MediaDriver]]
    """Start drivers with the network settings (each in its own directory) that are stopped
    after the test."""
    from slipstream.daemon.driver import MediaDriver

    drivers = []

    def start(**settings: object) -> MediaDriver:
        stack = contextlib.ExitStack()
        directory = Path("/dev/shm") / f"slipstream-udp-{uuid.uuid4().hex[:12]}"
        driver = stack.enter_context(MediaDriver.launch(
            directory=directory, startup_timeout=DRIVER_START_TIMEOUT_S,
            **{**NETWORK_SETTINGS, **settings}))
        drivers.append((stack, driver))
        return driver

    yield start
    for stack, driver in reversed(drivers):
        stack.close()
        shutil.rmtree(driver.directory, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory in /dev/shm for log buffers and counters files, removed afterwards."""
    path = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def spark():  # -> Iterator[SparkSession]
    """One local SparkSession (``local[2]``) for every test of the session that takes it:
    a session's start is a JVM's, seconds of CPU that each module would pay again.  Tests
    share it as Spark applications share one: each query its own checkpoint and streams.
    Stopped at the session's end."""
    from slipstream.spark_bridge import session

    started = session(master="local[2]", app_name="slipstream-tests")
    yield started
    started.stop()


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    """A streaming query's checkpoint location of the test's own (not created)."""
    return str(tmp_path / "checkpoint")


@pytest.fixture
def needs_hosts() -> None:
    """Namespace hosts can be made here (root, iproute2): skips without, fails under
    CI=true."""
    from slipstream.sim.real import hosts as namespace

    problem = namespace.unavailable()
    if problem is not None:
        lacking(f"test hosts: {problem}")


@pytest.fixture
def hosts(request: pytest.FixtureRequest, needs_hosts: None):  # -> Iterator[NamespaceHosts]
    """Test hosts: network namespaces on a bridge (2, or ``indirect`` parametrised), removed
    afterwards.  Needs root: skips without it, fails under CI=true."""
    from slipstream.sim.real import hosts as namespace

    count = getattr(request, "param", 2)
    with namespace.namespace_hosts(count) as made:
        yield made


# -- lanes ----------------------------------------------------------------------------------
#
# Every test is in exactly one lane, a marker that pyproject.toml registers:
#
#   unit     logic in this process: no driver, no other process, nothing sent to another
#            process (a socketpair or a UDP socket the test hands to C is still unit)
#   sim      the simulator: virtual hosts, links and time (sim/)
#   sockets  real driver processes (or a driver in this process serving its control socket),
#            real sockets, shared memory between processes on this host
#   hosts    root, network namespaces, iptables/tc, mounts, other Unix users, systemd
#   interop  the stock Aeron Java driver (tests/aeron_peer/)
#   spark    a SparkSession
#   containers  slipstream's image and containers of it (podman, as root), on this host or on
#            namespace hosts
#   arm64    the aarch64 wheel, its driver and clients under qemu-user in an arm64 root (root;
#            make arm64)
#   installed  the package as pip installs it, outside the checkout: make wheel's wheelhouse
#            in fresh environments (tests/installed.py), another CPython's Debian root, its
#            commands run there, as root or as other users
#   untimed  what sockets, hosts or spark tests need (real drivers, namespace hosts, Spark
#            clusters), for tests that hold no real-time rate or latency, only generous
#            timeouts: they pass on the CPU the rate-holding lanes leave, so they run niced
#            beside them (scripts/run-lanes), not in their way
#
# ``make test-fast`` runs ``-m "unit or sim"``, ``make test-lane LANE=x`` one lane, and
# ``make test`` every lane, in groups side by side (scripts/run-lanes).  A module's lane is
# MODULE_LANES'; a test of another lane says so with its own ``@pytest.mark.<lane>`` (or its
# module's ``pytestmark``), or, in the modules listed in TEST_LANES, there.  A module missing
# from MODULE_LANES fails the collection.

LANES = ("unit", "sim", "sockets", "hosts", "interop", "spark", "containers", "arm64",
         "installed", "untimed")

MODULE_LANES = {
    "test_aeron_peer": "interop",
    "test_archive": "sockets",
    "test_arm64": "arm64",
    "test_archive_disk_full": "hosts",
    "test_archive_units": "unit",
    "test_archive_stream_retention": "unit",
    "test_archive_catalog_reads": "sockets",
    "test_archive_replay": "sockets",
    "test_archive_calls": "sockets",
    "test_archive_async": "sockets",
    "test_archive_settings": "sockets",
    "test_archive_calls_hosts": "hosts",
    "test_archive_merge": "sockets",
    "test_recording_view": "sockets",
    "test_spark_archive_planning": "sockets",
    "test_archive_merge_hosts": "hosts",
    "test_archive_moves_hosts": "hosts",
    "test_archive_replication": "sockets",
    "test_archive_two_hosts": "hosts",
    "test_async": "sockets",
    "test_backpressure_units": "unit",
    "test_destinations": "unit",
    "test_bands": "unit",
    "test_channel": "unit",
    "test_channel_keys": "sockets",
    "test_chaos": "sockets",
    "test_client_close": "sockets",
    "test_client_counters": "sockets",
    "test_client_group": "installed",
    "test_client_liveness": "sockets",
    "test_config": "unit",
    "test_containers": "containers",
    "test_containers_hosts": "containers",
    "test_containers_setup": "unit",
    "test_control_plane": "sockets",
    "test_control_binding": "unit",
    "test_control_hosts": "hosts",
    "test_controlled_poll": "sockets",
    "test_counters": "unit",
    "test_stream_scale": "unit",
    "test_cubic": "unit",
    "test_demo": "unit",
    "test_demo_end_to_end": "sockets",
    "test_docs": "unit",
    "test_durable": "sockets",
    "test_drain": "sockets",
    "test_drain_threads": "unit",
    "test_driver_config_cli": "sockets",
    "test_driver_directory": "sockets",
    "test_driver_errors": "sockets",
    "test_driver_idle": "sockets",
    "test_driver_process": "sockets",
    "test_embedded": "sockets",
    "test_envelope": "unit",
    "test_exclusive_publication": "sockets",
    "test_flow_control": "unit",
    "test_flow_hosts": "hosts",
    "test_frames": "unit",
    "test_holder": "sockets",
    "test_hosts": "hosts",
    "test_hostile_network": "hosts",
    "test_installed_package": "installed",
    "test_interop": "interop",
    "test_kubernetes": "unit",
    "test_kubernetes_hosts": "containers",
    "test_interop_mdc": "interop",
    "test_interop_mds": "interop",
    "test_ipc": "sockets",
    "test_ipc_client": "sockets",
    "test_ipc_failures": "sockets",
    "test_ipc_positions": "sockets",
    "test_ipc_publication": "unit",
    "test_layers": "unit",
    "test_layout": "unit",
    "test_log_cleaner": "unit",
    "test_logbuffer": "unit",
    "test_loss_detector": "unit",
    "test_metrics": "sockets",
    "test_names": "sockets",
    "test_network_publication": "unit",
    "test_ownership": "unit",
    "test_params": "unit",
    "test_policies": "sockets",
    "test_agent_passes": "unit",
    "test_protocol_pair": "unit",
    "test_publication_image": "unit",
    "test_rate_control": "unit",
    "test_re_resolution": "unit",
    "test_re_resolution_hosts": "hosts",
    "test_run_lanes": "unit",
    "test_replay": "hosts",
    "test_replay_block": "unit",
    "test_response_channels": "sockets",
    "test_response_hosts": "hosts",
    "test_retransmit": "unit",
    "test_setup_flood": "sockets",
    "test_log_reuse": "sockets",
    "test_resource_linger": "sockets",
    "test_setup_flood_hosts": "hosts",
    "test_sim_cli": "sim",
    "test_sim_control": "sim",
    "test_sim_flow": "sim",
    "test_sim_mdc": "sim",
    "test_sim_mds": "sim",
    "test_sim_scale": "sim",
    "test_sim_response_channels": "sim",
    "test_sim_network": "sim",
    "test_sim_protocol": "sim",
    "test_sim_timing": "sim",
    "test_spark_bridge": "spark",
    "test_spark_columns": "spark",
    "test_spark_cluster": "untimed",
    "test_spark_executor": "sockets",
    "test_spark_planning": "sockets",
    "test_spark_session_ends": "sockets",
    "test_spark_archive": "sockets",
    "test_spark_archive_seams": "sockets",
    "test_spark_kafka": "sockets",
    "test_spy": "sockets",
    "test_stat": "unit",
    "test_status_messages_c": "unit",
    "test_strategy_registration": "unit",
    "test_systemd": "sockets",
    "test_systemd_boot": "hosts",
    "test_other_pythons": "installed",
    "test_tether": "unit",
    "test_thread_ownership": "unit",
    "test_udp": "sockets",
    "test_mdc": "sockets",
    "test_sealing": "unit",
    "test_handshake": "unit",
    "test_encrypted_streams": "sockets",
    "test_encrypted_hosts": "hosts",
    "test_mds": "sockets",
    "test_mdc_hosts": "hosts",
    "test_mdc_validation": "sockets",
    "test_mdc_validation_hosts": "hosts",
    "test_udp_failures": "sockets",
    "test_udp_untethered": "sockets",
}

#: The tests (by function name) whose lane is not their module's, for modules whose tests do
#: not carry lane markers of their own.
TEST_LANES = {
    "test_archive_replication": {
        "test_stitched_pieces_hold_exactly_what_the_first_archive_holding_each_position_holds":
            "unit",
        "test_a_piece_of_a_less_preferred_archive_gives_way_where_the_first_holds_again": "unit",
        "test_missing_ranges_are_exactly_what_no_held_range_covers": "unit",
        "test_a_seam_inside_a_message_widens_to_the_whole_message": "unit",
    },
    "test_bands": {
        "test_in_the_simulator_band_4_takes_eight_ninths_of_a_bottleneck_link": "sim",
        "test_in_the_simulator_a_deferred_band_waits_without_stalling_the_clock": "sim",
        "test_in_the_simulator_the_lowest_band_refuses_offers_at_step_4_and_takes_them_after":
            "sim",
    },
    "test_stream_scale": {
        "test_ten_thousand_ipc_pairs_are_added_under_the_default_settings": "untimed",
        "test_removing_one_of_many_udp_endpoints_leaves_the_others_found": "sockets",
        "test_a_network_episode_scan_a_cycle_skipped_is_owed_and_the_conductor_wakes_for_it":
            "sockets",
    },
    "test_control_plane": {
        "test_an_unexpected_failure_in_a_command_is_answered_and_counted": "unit",
        "test_a_calm_governor_samples_on_the_timers_cycles_once_a_second": "unit",
        "test_a_calm_governor_shares_the_timers_wake_ups": "unit",
        "test_a_governor_under_pressure_samples_every_100_ms": "unit",
        "test_a_calm_governor_never_samples_more_often_than_every_100_ms": "unit",
        "test_the_default_directory_is_the_effective_users_whatever_user_says": "unit",
        "test_the_control_socket_refuses_another_user_even_through_an_open_directory": "hosts",
        "test_commands_run_by_a_uid_without_a_passwd_entry_find_their_directory": "hosts",
        "test_a_client_of_another_user_is_told_whose_directory_it_is": "hosts",
        "test_a_driver_of_another_user_refuses_the_client_and_the_error_says_so": "hosts",
    },
    "test_cubic": {
        "test_multicast_receivers_measure_their_round_trip_too": "sim",
    },
    "test_demo": {
        "test_the_demo_ends_with_an_error_when_its_driver_ends": "sockets",
        "test_the_demo_ends_with_an_error_when_one_of_its_processes_dies": "sockets",
    },
    "test_embedded": {
        "test_an_embedded_driver_refuses_the_settings_of_threads_it_does_not_have": "unit",
        "test_closing_waits_for_a_subscriber_whose_process_has_the_applications_pid_elsewhere":
            "hosts",
    },
    "test_flow_hosts": {
        "test_a_host_run_refuses_what_real_links_cannot_do_by_name": "unit",
    },
    "test_mdc_hosts": {
        "test_a_host_run_gives_a_publisher_link_its_own_loss_and_refuses_the_rest_by_name": "unit",
    },
    "test_installed_package": {
        "test_the_floor_is_the_one_pyproject_pins": "unit",
    },
    "test_logbuffer": {
        "test_concurrent_appends_from_several_processes_never_corrupt_or_lose_a_frame":
            "sockets",
    },
    "test_policies": {
        "test_a_bad_policy_names_the_part_and_the_problem": "unit",
        "test_the_uri_form_of_a_policy_prints_back_the_same": "unit",
        "test_every_error_an_application_can_meet_is_importable_from_slipstream_client": "unit",
    },
    "test_stat": {
        "test_stat_of_another_users_directory_says_whose_it_is": "hosts",
        "test_stat_shows_a_new_driver_in_the_directory_of_one_that_was_killed": "sockets",
    },
    "test_systemd": {
        "test_the_unit_passes_systemd_analyze_verify": "hosts",
        "test_the_units_exposure_is_under_three": "hosts",
        "test_the_units_settings_are_the_drivers_and_its_sandbox_lets_it_serve_its_group":
            "unit",
        "test_watchdog_variables_meant_for_another_process_are_ignored": "unit",
        "test_a_stale_network_thread_stops_the_pings": "unit",
    },
}

_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test of this folder with its lane; a module without one, a test with two,
    or a table entry that names nothing stops the collection, saying what to fix."""
    problems: list[str] = []
    for name in sorted(set(MODULE_LANES) | set(TEST_LANES)):
        if not (_TESTS / f"{name}.py").is_file():
            problems.append(f"tests/conftest.py names tests/{name}.py, which does not exist: "
                            "remove it from MODULE_LANES / TEST_LANES")
    for name, lane in [*MODULE_LANES.items(),
                       *((t, lane) for tests in TEST_LANES.values() for t, lane in tests.items())]:
        if lane not in LANES:
            problems.append(f"tests/conftest.py: {name}'s lane {lane!r} is not one of {LANES}")
    unlisted: set[str] = set()
    checked: set[str] = set()
    for item in items:
        if item.path.parent != _TESTS:
            continue
        module = item.path.stem
        function = getattr(item, "originalname", item.name)
        marked = sorted({mark.name for mark in item.iter_markers() if mark.name in LANES})
        listed = TEST_LANES.get(module, {}).get(function)
        if module not in checked:
            checked.add(module)
            python_module = getattr(item, "module", None)
            for name in TEST_LANES.get(module, {}):
                if python_module is not None and not hasattr(python_module, name):
                    problems.append(f"TEST_LANES in tests/conftest.py names {module}.{name}, "
                                    "which does not exist: remove or rename it there")
        if module not in MODULE_LANES:
            unlisted.add(module)
        elif len(marked) > 1:
            problems.append(f"{item.nodeid} is marked with {len(marked)} lanes ({marked}): "
                            "a test is in exactly one")
        elif marked and listed:
            problems.append(f"{item.nodeid} has its lane twice: @pytest.mark.{marked[0]} and "
                            "TEST_LANES in tests/conftest.py; keep one")
        elif not marked:
            item.add_marker(listed or MODULE_LANES[module])
    problems += [f"tests/{module}.py is in no lane: add it to MODULE_LANES in tests/conftest.py "
                 f"(one of {', '.join(LANES)}; see the lanes there)" for module in sorted(unlisted)]
    if problems:
        raise pytest.UsageError("\n".join(problems))
