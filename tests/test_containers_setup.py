"""The set-up of the containers (scripts/containers-conf): the two settings podman needs on
hosts like this one are added to containers.conf only where its table lacks the key, each
with the reason beside it, and nothing else of the file changes; the image's tag is the hash
of the source files; a test image's builder is known by its process id and start time."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = runpy.run_path(str(ROOT / "scripts" / "containers-conf"))
add_missing = CONF["add_missing"]


def test_a_missing_file_gets_both_settings_under_their_tables_with_why() -> None:
    text, added = add_missing("")
    assert added == ["[containers] default_ulimits", "[engine] runtime"]
    lines = text.splitlines()
    assert lines[0] == "[containers]"
    assert lines[1].startswith("# Added by slipstream") and "setrlimit" in lines[1]
    assert lines[2].startswith("default_ulimits = [")
    assert lines[4:6] == ["[engine]", lines[5]] and "hybrid cgroups" in lines[5]
    assert lines[6] == 'runtime = "runc"'


def test_a_key_the_file_sets_is_kept_and_the_other_added_under_the_existing_table() -> None:
    original = ('# the operator\'s\n[containers]\ndefault_ulimits = ["nofile=1024:1024"]\n'
                'log_driver = "k8s-file"\n\n[engine]\ncgroup_manager = "cgroupfs"\n'
                '\n[network]\nnetwork_backend = "netavark"\n')
    text, added = add_missing(original)
    assert added == ["[engine] runtime"]
    assert 'default_ulimits = ["nofile=1024:1024"]' in text
    assert text.count("default_ulimits") == 1
    engine = text.split("[engine]\n", 1)[1].split("[network]")[0]
    assert engine.splitlines()[1] == 'runtime = "runc"'
    assert "cgroup_manager" in engine
    assert text.replace(engine, "") == original.replace(
        original.split("[engine]\n", 1)[1].split("[network]")[0], "")  # the rest unchanged


def test_a_second_run_adds_nothing() -> None:
    once, _ = add_missing("")
    twice, added = add_missing(once)
    assert added == [] and twice == once


def test_the_image_tag_hashes_the_source_files_and_nothing_a_build_leaves(
        tmp_path: Path) -> None:
    """scripts/build-image tags the image with build_wheel.py's hash of the files it lists
    (a tree without git: every file outside what builds leave)."""
    from installed import build_wheel

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    first = build_wheel.source_hash(tmp_path)
    assert len(first) == 16 and build_wheel.source_hash(tmp_path) == first
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "pkg" / "_native.so").write_bytes(b"\0")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x").write_text("x")
    assert build_wheel.source_hash(tmp_path) == first
    (tmp_path / "pkg" / "a.py").write_text("A = 2\n")
    assert build_wheel.source_hash(tmp_path) != first


def test_a_test_image_s_builder_is_known_by_its_id_and_start() -> None:
    from containers import owner_alive, session_owner

    assert owner_alive(session_owner())
    pid, start = session_owner().split(":")
    assert not owner_alive(f"{pid}:{int(start) + 1}")  # the id reused by a later process
    assert not owner_alive("4194304:1")  # above pid_max
    assert not owner_alive("<no value>")
