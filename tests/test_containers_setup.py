"""The set-up of the containers (scripts/containers-conf): the two settings podman needs on
hosts like this one are added to containers.conf only where its table lacks the key, each
with the reason beside it, and nothing else of the file changes."""

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
