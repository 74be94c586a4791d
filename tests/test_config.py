"""Driver configuration: defaults, precedence, validation messages, formatting, driver.toml."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import logging
import os
import pwd
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from slipstream.client.errors import ConfigurationError
from slipstream.client.units import (
    format_duration_ns,
    format_size,
    parse_duration_ns,
    parse_size,
)
from slipstream.daemon.config import (
    SETTINGS,
    DriverSettings,
    Kind,
    Setting,
    add_arguments,
    default_directory,
    format_settings,
    load_settings,
    load_settings_from_args,
    overrides_from_args,
    render_default_config,
    settings_to_dict,
    shipped_config_text,
)

KiB, MiB = 1 << 10, 1 << 20
US, MS, S = 1_000, 1_000_000, 1_000_000_000

# Written out from docs/DEFAULTS.md §8 (Aeron's defaults, and slipstream's own keys), not
# read from the table: this is the independent statement of what the defaults must be.
EXPECTED_DEFAULTS: dict[str, Any] = {
    "dir": None,
    "client_group": "",  # the driver's own user only
    "log_level": "info",
    "metrics_address": "",
    "counters_capacity": 100_000,
    "threading_mode": "shared_network",  # Aeron's SHARED_NETWORK (its default: DEDICATED)
    "network_idle_spin": 200 * US,
    "term_buffer_length": 16 * MiB,
    "ipc_term_buffer_length": 64 * MiB,
    "term_buffer_sparse_file": False,  # Aeron: aeron.term.buffer.sparse.file
    "mtu_length": 1408,
    "log_buffer_memory_limit": 4 * 1024 * MiB,  # slipstream: a cap Aeron does not have
    "log_reuse_bytes": 512 * MiB,  # slipstream: Aeron deletes a released log
    "log_reuse_timeout": 10 * S,  # slipstream
    "ipc_mtu_length": 1408,
    "publication_term_window_length": 0,
    "ipc_publication_term_window_length": 0,
    "image_term_buffer_length_max": 16 * MiB,  # slipstream; Aeron takes up to 1 GiB
    "image_source_max_images": 256,  # slipstream (issue 59: the SETUP flood)
    "image_source_memory_limit": 2048 * MiB,  # slipstream
    "image_pending_max": 16,  # slipstream
    "rcv_initial_window_length": 128 * KiB,
    "cubic_initial_rtt": 100 * US,  # Aeron: AERON_CUBICCONGESTIONCONTROL_INITIALRTT
    "cubic_measure_rtt": True,  # Aeron: false (docs/FLOW.md says why not here)
    "cubic_tcp_mode": True,  # Aeron: false
    "status_message_timeout": 200 * MS,
    "status_message_catch_up_interval": MS,  # slipstream
    "nak_unicast_delay": 100 * US,
    "nak_unicast_retry_delay_ratio": 100,
    "nak_multicast_max_backoff": 10 * MS,
    "nak_multicast_group_size": 10,
    "socket_so_rcvbuf": 128 * KiB,
    "socket_so_sndbuf": 0,
    "socket_gso": True,  # slipstream; Aeron sends datagram by datagram
    "socket_multicast_ttl": 0,
    "receiver_group_tag": None,
    "reliable_stream": True,
    "send_to_status_poll_ratio": 6,
    # Aeron sends 2 per ~100 ns duty cycle; a Python duty cycle costs microseconds.
    "network_publication_max_messages_per_send": 64,
    "retransmit_unicast_delay": 0,
    "retransmit_unicast_linger": 200 * US,
    "max_resend": 256,
    "mdc_join": "",
    "mdc_candidates_max": 64,
    "mdc_validation_timeout": 3 * S,
    "retransmit_budget_percent": 100,  # issue 59: NAKs at most double what is sent
    "retransmit_budget_interval": 1 * S,
    "debug_receive_data_loss": 0,  # Aeron: aeron.debug.receive.data.loss.rate, off
    "debug_receive_data_loss_seed": 1,
    "debug_conductor_gil_hold": 0,
    "timer_interval": 1 * S,
    "client_liveness_timeout": 10 * S,
    "client_keepalive_interval": 500 * MS,
    "driver_timeout": 10 * S,
    "drain_timeout": 10 * S,
    "publication_linger_timeout": 5 * S,
    "publication_unblock_timeout": 15 * S,
    "publication_connection_timeout": 5 * S,
    "image_liveness_timeout": 10 * S,
    "receiver_rebind_timeout": 1 * S,
    "name_re_resolution_interval": S,
    "unicast_flow_control": "unicast",
    "multicast_flow_control": "max",
    "flow_control_receiver_timeout": 5 * S,
    "flow_control_group_tag": -1,
    "flow_control_group_min_size": 0,
    "flow_control_admission_interval": 100 * MS,
    "backpressure_high_watermark": 100,  # slipstream's (docs/BACKPRESSURE.md)
    "backpressure_low_watermark": 50,
    "untethered_window_limit_timeout": 5 * S,
    "untethered_resting_timeout": 10 * S,
    "publication_reserved_session_id_low": -1,
    "publication_reserved_session_id_high": 1000,
    "keys_dir": None,  # no encrypted channels
    "keys_reload_interval": S,
}


def _text(spec: Setting, value: Any) -> str:
    """How a person writes ``value`` in the environment or on a command line (with units)."""
    if value is None:
        return ""
    if spec.kind is Kind.BOOL:
        return "true" if value else "false"
    if spec.kind is Kind.SIZE:
        return format_size(value)
    if spec.kind is Kind.DURATION:
        return format_duration_ns(value)
    return str(value)


def _toml_line(key: str, value: Any) -> str:
    """``key = value`` with native TOML ints/bools and unit strings for sizes and durations."""
    spec = SETTINGS[key]
    if isinstance(value, bool):
        return f"{key} = {'true' if value else 'false'}"
    if spec.kind is Kind.INT and value is not None:
        return f"{key} = {value}"
    return f"{key} = {json.dumps(_text(spec, value))}"


def _alternative(key: str) -> Any:
    """A valid value for ``key`` other than its default (given default values elsewhere)."""
    spec = SETTINGS[key]
    d = spec.default
    if key in ("dir", "keys_dir"):
        candidates: list[Any] = ["/tmp/slipstream-test"]
    elif key == "metrics_address":
        candidates = ["127.0.0.1:9100"]
    elif key == "client_group":
        candidates = ["slipstream"]
    elif key == "mdc_join":
        candidates = ["10.1.0.0/16,fd00::/8"]
    elif spec.kind is Kind.BOOL:
        candidates = [not d]
    elif spec.kind is Kind.CHOICE:
        candidates = [c for c in spec.choices if c != d]
    elif d is None:
        candidates = [7]
    else:
        step = spec.multiple_of or (MS if spec.kind is Kind.DURATION else 1)
        candidates = [d * 2, d // 2] if spec.power_of_two else [d + step, d - step, d + MiB]
    for value in candidates:
        try:
            DriverSettings(**{key: value})
        except ConfigurationError:
            continue
        return value
    raise AssertionError(f"no alternative value for {key}")


ALTERNATIVES = {key: _alternative(key) for key in SETTINGS}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- defaults


def test_defaults_match_protocol() -> None:
    assert list(EXPECTED_DEFAULTS) == list(SETTINGS)
    assert settings_to_dict(DriverSettings()) == EXPECTED_DEFAULTS
    assert all(SETTINGS[k].default == v for k, v in EXPECTED_DEFAULTS.items())


def test_directory_resolves_unset_to_default() -> None:
    assert default_directory() == f"/dev/shm/slipstream-{pwd.getpwuid(os.geteuid()).pw_name}"
    assert DriverSettings().directory == default_directory()
    assert DriverSettings(dir="/tmp/x").directory == "/tmp/x"
    assert DriverSettings(dir="").dir is None


def test_every_setting_documents_unit_and_range() -> None:
    for key, spec in SETTINGS.items():
        assert spec.doc and "\n" not in spec.doc, key
        assert spec.accepted(), key
        if spec.kind is Kind.SIZE:
            assert "bytes" in spec.doc, key
        if spec.kind is Kind.DURATION:
            assert "ns" in spec.doc, key


# ---------------------------------------------------------------------------- driver.toml


def test_driver_toml_has_every_key_at_its_default() -> None:
    raw = tomllib.loads(shipped_config_text())
    assert list(raw) == list(SETTINGS)  # every key, no extra key, flat
    for key, value in raw.items():
        assert SETTINGS[key].parse(key, value) == SETTINGS[key].default, key


def test_driver_toml_loads_to_defaults() -> None:
    resource = importlib.resources.files("slipstream.config").joinpath("driver.toml")
    with importlib.resources.as_file(resource) as path:
        loaded = load_settings(path, env={})
    assert loaded == DriverSettings()
    assert {loaded.source_of(k) for k in SETTINGS} == {"file"}


def test_driver_toml_is_generated_from_the_table() -> None:
    assert shipped_config_text() == render_default_config(), (
        "config/driver.toml is stale: python -m slipstream.daemon.config > config/driver.toml"
    )


# ---------------------------------------------------------------------------- precedence


@pytest.mark.parametrize("key", list(SETTINGS))
def test_precedence_file_env_overrides(key: str, tmp_path: Path) -> None:
    spec, a, b = SETTINGS[key], ALTERNATIVES[key], SETTINGS[key].default
    env_name = f"SLIPSTREAM_{key.upper()}"
    config = _write(tmp_path / "driver.toml", [_toml_line(key, a)])

    assert getattr(load_settings(env={}), key) == b
    from_file = load_settings(config, env={})
    assert (getattr(from_file, key), from_file.source_of(key)) == (a, "file")
    # Each layer overrides the one below; alternate values so every step is visible.
    from_env = load_settings(config, env={env_name: _text(spec, b)})
    assert (getattr(from_env, key), from_env.source_of(key)) == (b, "env")
    from_cli = load_settings(config, env={env_name: _text(spec, b)}, overrides={key: a})
    assert (getattr(from_cli, key), from_cli.source_of(key)) == (a, "cli")
    as_text = load_settings(config, env={env_name: _text(spec, b)}, overrides={key: _text(spec, a)})
    assert getattr(as_text, key) == a


def test_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_MTU_LENGTH", "4096")
    monkeypatch.setenv("SLIPSTREAM_DIR", "/tmp/from-env")
    loaded = load_settings()
    assert (loaded.mtu_length, loaded.directory) == (4096, "/tmp/from-env")


def test_environment_ignores_variables_that_are_not_settings() -> None:
    env = {"SLIPSTREAM_CLIENT_NAME": "x", "SLIPSTREAM_AERON_JAR": "/x.jar", "MTU_LENGTH": "1"}
    assert load_settings(env=env) == DriverSettings()


@pytest.mark.parametrize(("variable", "meant"), [
    ("SLIPSTREAM_MTU_LENGHT", "SLIPSTREAM_MTU_LENGTH"),
    ("SLIPSTREAM_TERM_BUFFER_LENGHT", "SLIPSTREAM_TERM_BUFFER_LENGTH"),
    ("SLIPSTREAM_SOCKET_SO_RCVBUFF", "SLIPSTREAM_SOCKET_SO_RCVBUF"),
])
def test_a_misspelt_environment_setting_is_refused_naming_the_setting_meant(
        variable: str, meant: str) -> None:
    with pytest.raises(ConfigurationError, match=f"{variable}.*did you mean {meant}"):
        load_settings(env={variable: "4096"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("1", True), ("yes", True), ("On", True), ("TRUE", True),
     ("false", False), ("0", False), ("no", False), ("off", False)],
)
def test_environment_booleans(text: str, expected: bool) -> None:
    assert load_settings(env={"SLIPSTREAM_RELIABLE_STREAM": text}).reliable_stream is expected


# ---------------------------------------------------------------------------- bad values

BAD_VALUES = [
    ("term_buffer_length", "100k", "100k is not a power of 2 in 64k..1g"),
    ("term_buffer_length", "2g", "2g is not a power of 2 in 64k..1g"),
    ("ipc_term_buffer_length", "32k", "32k is not a power of 2 in 64k..1g"),
    ("mtu_length", 1000, "1000 is not a multiple of 32 in 64..65504"),
    ("mtu_length", 32, "32 is not a multiple of 32 in 64..65504"),
    ("mtu_length", 65536, "64k is not a multiple of 32 in 64..65504"),
    ("max_resend", 0, "0 is not an integer in 1..256"),
    ("max_resend", 257, "257 is not an integer in 1..256"),
    ("mdc_join", "10.1.0.1/16", "host bits set"),
    ("mdc_join", "10.1.0.0/16,nowhere", "'nowhere' is not a subnet"),
    ("counters_capacity", "lots", "expected an integer in 256..1000000"),
    ("counters_capacity", "64", "64 is not an integer in 256..1000000"),  # held one stream
    ("status_message_timeout", "-5s", "expected a duration in 1ns..1h"),
    ("status_message_timeout", "0ns", "0ns is not a duration in 1ns..1h"),
    ("nak_unicast_delay", -1, "expected a duration in 0ns..1s"),
    ("nak_unicast_delay", "fast", "is not a duration"),
    ("reliable_stream", "maybe", "'maybe' is not a boolean; expected true or false"),
    ("multicast_flow_control", "fastest", "'fastest' is not one of max|min|tagged"),
    ("log_level", "verbose", "is not one of debug|info|warning|error"),
    ("metrics_address", "localhost", "is not host:port"),
    ("metrics_address", "host:99999", "is not host:port"),
    ("socket_multicast_ttl", 256, "256 is not an integer in 0..255"),
    ("receiver_group_tag", "blue", "or \"\" for unset"),
]


def _set_in(source: str, key: str, value: Any, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """load_settings kwargs putting ``key = value`` in one source, and that source's name."""
    if source == "file":
        path = _write(tmp_path / "bad.toml", [f"{key} = {json.dumps(value)}"])
        return {"config_file": path, "env": {}}, str(path)
    if source == "env":
        name = f"SLIPSTREAM_{key.upper()}"
        return {"env": {name: str(value)}}, name
    return {"env": {}, "overrides": {key: value}}, "override"


@pytest.mark.parametrize("source", ["file", "env", "cli"])
@pytest.mark.parametrize(("key", "value", "message"), BAD_VALUES)
def test_bad_value_names_key_range_and_source(
    source: str, key: str, value: Any, message: str, tmp_path: Path
) -> None:
    kwargs, origin = _set_in(source, key, value, tmp_path)
    with pytest.raises(ConfigurationError) as info:
        load_settings(**kwargs)
    assert info.value.key == key
    assert str(info.value).startswith(f"configuration key {key!r}: ")
    assert message in str(info.value)
    assert origin in str(info.value)


@pytest.mark.parametrize("value", [1.5, [1], {"a": 1}, b"1"])
def test_bad_native_types(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="term_buffer_length"):
        DriverSettings(term_buffer_length=value)


def test_unknown_key_in_file_suggests_closest(tmp_path: Path) -> None:
    path = _write(tmp_path / "typo.toml", ["mtu_lenght = 4096"])
    with pytest.raises(ConfigurationError, match="did you mean 'mtu_length'") as info:
        load_settings(path, env={})
    assert info.value.key == "mtu_lenght"


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("mtu_lenght", "mtu_length"),
        ("directory", "dir"),
        ("client_liveness", "client_liveness_timeout"),
    ],
)
def test_unknown_override_suggests_closest(key: str, suggestion: str) -> None:
    with pytest.raises(ConfigurationError, match=f"did you mean {suggestion!r}"):
        load_settings(env={}, overrides={key: 1})
    with pytest.raises(ConfigurationError, match=f"did you mean {suggestion!r}"):
        DriverSettings.from_mapping({key: 1})


def test_unknown_key_without_close_match() -> None:
    with pytest.raises(ConfigurationError, match="unknown setting") as info:
        load_settings(env={}, overrides={"zzz": 1})
    assert "did you mean" not in str(info.value)


def test_toml_tables_are_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "nested.toml", ["[driver]", "mtu_length = 4096"])
    with pytest.raises(ConfigurationError, match=r"\[driver\]"):
        load_settings(path, env={})


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "broken.toml", ["mtu_length = 4096", "", "max_resend = = 3"])
    with pytest.raises(ConfigurationError) as info:
        load_settings(path, env={})
    assert info.value.key == "config"
    assert f"{path}:3:" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_settings(tmp_path / "absent.toml", env={})


# ---------------------------------------------------------------------------- cross-field rules


def test_keepalive_must_be_below_client_liveness() -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(env={}, overrides={"client_keepalive_interval": "10s"})
    assert info.value.key == "client_keepalive_interval"
    assert "client_liveness_timeout (10s)" in str(info.value)
    with pytest.raises(ConfigurationError, match=r"client_keepalive_interval.*client_liveness"):
        load_settings(env={"SLIPSTREAM_CLIENT_LIVENESS_TIMEOUT": "400ms"})


@pytest.mark.parametrize(
    ("overrides", "left", "right"),
    [
        ({"mtu_length": "8k", "rcv_initial_window_length": "4k"}, "mtu_length",
         "rcv_initial_window_length"),
        ({"rcv_initial_window_length": "1m"}, "rcv_initial_window_length", "socket_so_rcvbuf"),
        ({"mtu_length": 4096, "socket_so_sndbuf": 2048}, "mtu_length", "socket_so_sndbuf"),
        ({"publication_unblock_timeout": "10s"}, "client_liveness_timeout",
         "publication_unblock_timeout"),
        ({"timer_interval": "20s"}, "timer_interval", "client_liveness_timeout"),
        ({"backpressure_high_watermark": 40}, "backpressure_low_watermark",
         "backpressure_high_watermark"),
        ({"publication_reserved_session_id_low": 2000}, "publication_reserved_session_id_low",
         "publication_reserved_session_id_high"),
    ],
)
def test_cross_field_rules_name_both_keys(overrides: dict[str, Any], left: str, right: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(env={}, overrides=overrides)
    assert info.value.key == left
    assert right in str(info.value)


def test_a_reserved_range_of_every_session_id_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="reserves every session id") as info:
        load_settings(env={}, overrides={"publication_reserved_session_id_low": -(1 << 31),
                                         "publication_reserved_session_id_high": (1 << 31) - 1})
    assert info.value.key == "publication_reserved_session_id_low"
    one_left = load_settings(env={}, overrides={
        "publication_reserved_session_id_low": -(1 << 31),
        "publication_reserved_session_id_high": (1 << 31) - 2})
    assert one_left.publication_reserved_session_id_high == (1 << 31) - 2


def test_a_file_line_the_environment_outranks_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The systemd unit sets SLIPSTREAM_DIR: a dir line in driver.toml is then not used, and
    the operator who wrote it is told so."""
    config = _write(tmp_path / "driver.toml", ['dir = "/dev/shm/elsewhere"', "max_resend = 3"])
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        loaded = load_settings(config, env={"SLIPSTREAM_DIR": "/dev/shm/unit"},
                               overrides={"max_resend": 5})
    assert (loaded.dir, loaded.max_resend) == ("/dev/shm/unit", 5)
    assert [r.getMessage() for r in caplog.records] == [
        f"dir in {config} is not used: it is set from $SLIPSTREAM_DIR, which outranks the file",
        f"max_resend in {config} is not used: it is set by override, which outranks the file"]
    # The shipped driver.toml sets every key to its default, and an override may repeat the
    # file's value: neither is a line someone meant and lost, so neither is warned of.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slipstream.config"):
        shipped = _write(tmp_path / "shipped.toml", shipped_config_text().splitlines())
        load_settings(shipped, env={"SLIPSTREAM_DIR": "/dev/shm/unit"})
        load_settings(config, env={"SLIPSTREAM_DIR": "/dev/shm/elsewhere"})
    assert caplog.records == []


def test_zero_socket_buffer_means_os_default_and_is_not_checked() -> None:
    overrides = {"socket_so_rcvbuf": 0, "rcv_initial_window_length": "1m"}
    loaded = load_settings(env={}, overrides=overrides)
    assert loaded.rcv_initial_window_length == MiB


# ---------------------------------------------------------------------------- formatting


def test_format_settings_shows_units_and_sources(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.toml", ["term_buffer_length = \"32m\""])
    loaded = load_settings(
        path, env={"SLIPSTREAM_MAX_RESEND": "3"}, overrides={"status_message_timeout": "300ms"}
    )
    lines = format_settings(loaded).splitlines()
    assert 'term_buffer_length = "32m"  # file' in lines
    assert "max_resend = 3  # env" in lines
    assert 'status_message_timeout = "300ms"  # cli' in lines
    assert "mtu_length = 1408  # default" in lines
    assert f'dir = ""  # default ({default_directory()})' in lines


def test_format_settings_round_trips_every_key_changed(tmp_path: Path) -> None:
    changed = DriverSettings.from_mapping(ALTERNATIVES)
    assert all(getattr(changed, k) != SETTINGS[k].default for k in SETTINGS)
    path = _write(tmp_path / "printed.toml", [format_settings(changed)])
    assert load_settings(path, env={}) == changed


def _valid_values(key: str) -> st.SearchStrategy[Any]:
    spec = SETTINGS[key]
    if key in ("dir", "keys_dir"):
        return st.sampled_from([None, "/tmp/slip", "/dev/shm/a b", 'odd"dir\\x', "/tmp/ünï\tx"])
    if key == "metrics_address":
        return st.sampled_from(["", "127.0.0.1:9100", "[::1]:0", "host.example:65535"])
    if key == "client_group":
        return st.sampled_from(["", "slipstream", "1001", "spark-users"])
    if key == "mdc_join":
        return st.sampled_from(["", "10.1.0.0/16", "10.1.0.0/16,10.2.0.0/24", "fd00::/8"])
    if spec.kind is Kind.BOOL:
        return st.booleans()
    if spec.kind is Kind.CHOICE:
        return st.sampled_from(spec.choices)
    assert spec.low is not None and spec.high is not None
    if spec.power_of_two:
        exponents = st.integers(spec.low.bit_length() - 1, spec.high.bit_length() - 1)
        return exponents.map(lambda e: 1 << e)
    if spec.multiple_of:
        m = spec.multiple_of
        return st.integers(-(-spec.low // m), spec.high // m).map(lambda k: k * m)
    values = st.integers(spec.low, spec.high)
    return st.none() | values if spec.optional else values


@st.composite
def _overrides(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(list(SETTINGS)), max_size=6, unique=True))
    return {key: draw(_valid_values(key)) for key in keys}


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.filter_too_much],
)
@given(overrides=_overrides())
def test_format_settings_round_trips(
    overrides: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    try:
        original = DriverSettings.from_mapping(overrides)
    except ConfigurationError:
        reject()  # a cross-field rule; the value ranges themselves are all valid here
    path = tmp_path_factory.getbasetemp() / "round-trip.toml"
    path.write_text(format_settings(original))
    assert load_settings(path, env={}) == original
    # The child-process route: native values through settings_to_dict and from_mapping.
    assert DriverSettings.from_mapping(settings_to_dict(original)) == original


def test_native_and_unit_strings_validate_the_same() -> None:
    native = DriverSettings.from_mapping(
        {"term_buffer_length": 32 * MiB, "status_message_timeout": S, "reliable_stream": False}
    )
    text = DriverSettings.from_mapping(
        {"term_buffer_length": "32m", "status_message_timeout": "1s", "reliable_stream": "no"}
    )
    assert native == text
    for bad in (100_000, "100000"):
        with pytest.raises(ConfigurationError, match="power of 2"):
            DriverSettings.from_mapping({"term_buffer_length": bad})


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(0, 1 << 45))
def test_sizes_round_trip_through_units(n: int) -> None:
    assert parse_size(format_size(n)) == n


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(0, 1 << 62))
def test_durations_round_trip_through_units(n: int) -> None:
    assert parse_duration_ns(format_duration_ns(n)) == n


@settings(max_examples=300, deadline=None, database=None)
@given(whole=st.integers(0, 10**6), digits=st.text("0123456789", min_size=1, max_size=9),
       unit=st.sampled_from(["s", "ms", "us"]))
def test_a_decimal_duration_is_exact_to_the_nanosecond(whole: int, digits: str,
                                                        unit: str) -> None:
    """4.1s is 4_100_000_000 ns (through a float it was 4_099_999_999); a fraction of a
    nanosecond is refused, never rounded away."""
    scale = {"s": 9, "ms": 6, "us": 3}[unit]
    text = f"{whole}.{digits}{unit}"
    if len(digits.rstrip("0")) <= scale:
        assert parse_duration_ns(text) == int(f"{whole}{digits.rstrip('0').ljust(scale, '0')}")
    else:
        with pytest.raises(ValueError, match="not a whole number of nanoseconds"):
            parse_duration_ns(text)


# ---------------------------------------------------------------------------- the object itself


def test_settings_are_frozen_and_sources_do_not_affect_equality() -> None:
    a = load_settings(env={"SLIPSTREAM_MAX_RESEND": "256"})
    b = DriverSettings()
    assert a == b and hash(a) == hash(b)
    assert (a.source_of("max_resend"), b.source_of("max_resend")) == ("env", "default")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.max_resend = 3  # type: ignore[misc]


def test_derived_helpers() -> None:
    s = DriverSettings()
    assert s.metrics_endpoint is None
    assert DriverSettings(metrics_address="[::1]:9100").metrics_endpoint == ("::1", 9100)


# ---------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream driver")
    add_arguments(parser)
    return parser


def test_command_line_flags(tmp_path: Path) -> None:
    config = _write(tmp_path / "d.toml", ["mtu_length = 2048", "max_resend = 5"])
    args = _parser().parse_args(
        ["--config", str(config), "--dir", "/tmp/cli-dir", "--set", "mtu-length=4k",
         "--set", "dir=/tmp/ignored", "--print-config"]
    )
    assert args.print_config is True
    assert overrides_from_args(args) == {"mtu_length": "4k", "dir": "/tmp/cli-dir"}
    loaded = load_settings_from_args(args, env={"SLIPSTREAM_MAX_RESEND": "7"})
    assert (loaded.mtu_length, loaded.max_resend, loaded.dir) == (4096, 7, "/tmp/cli-dir")
    assert loaded.source_of("mtu_length") == "cli"


def test_command_line_defaults_are_empty() -> None:
    args = _parser().parse_args([])
    assert (args.config_file, args.print_config, overrides_from_args(args)) == (None, False, {})


def test_set_without_equals_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--set", "mtu_length"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_set_unknown_key_suggests_closest() -> None:
    args = _parser().parse_args(["--set", "max-resends=3"])
    with pytest.raises(ConfigurationError, match="did you mean 'max_resend'"):
        load_settings_from_args(args, env={})


def test_a_client_group_that_is_no_group_name_or_that_this_host_lacks_names_the_key() -> None:
    with pytest.raises(ConfigurationError, match=r"client_group.*'a:b' is not a group name"):
        DriverSettings(client_group="a:b")
    missing = DriverSettings(client_group="no-such-group-here")
    with pytest.raises(ConfigurationError, match=r"client_group.*is not a group of this host"):
        _ = missing.client_gid
    assert DriverSettings(client_group="4242").client_gid == 4242
    assert DriverSettings().client_gid is None
