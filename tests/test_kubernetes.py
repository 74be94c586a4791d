"""The Kubernetes manifests (deploy/kubernetes/): every document valid against Kubernetes'
published schemas (``kubernetes-validate``, strict: an unknown field is an error), the uid
and gid they run as the image's, and ``podman kube play`` of the driver (the pod of its
DaemonSet, deploy/kubernetes/kube_play.py) and of the IPC example's two application pods,
which stream through it over the node's driver directory; the archive's configuration runs
in a container beside a driver container.

The schema checks are unit; the play is in the containers lane (root and podman: skips
without, fails under CI=true).
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from containers import APP_UID, Containers, image_settings, podman
from helpers import lacking

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
#: The Kubernetes versions the manifests are checked against: the oldest still supported
#: upstream when they were written, and the newest whose schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.29.0", "latest")
#: Where the manifests keep the driver directory, on the node and in every container.
DRIVER_DIRECTORY = "/dev/shm/slipstream"

sys.path.insert(0, str(MANIFESTS))
import kube_play  # noqa: E402  (deploy/kubernetes/ is no package)


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
            for path in sorted(MANIFESTS.glob("*.yaml"))}


def _validator():  # -> module kubernetes_validate
    if importlib.util.find_spec("kubernetes_validate") is None:
        lacking("needs kubernetes-validate (pip install 'slipstream[test]'; make install)")
    import kubernetes_validate

    return kubernetes_validate


def _version(validator: Any, version: str) -> str:
    return validator.latest_version() if version == "latest" else version


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_against_kubernetes_schemas(version: str) -> None:
    validator = _validator()
    checked = []
    for name, documents in manifests().items():
        for document in documents:
            validator.validate(document, _version(validator, version), strict=True)
            checked.append(f"{name}:{document['kind']}")
    assert {"DaemonSet", "ConfigMap", "Pod", "Service", "StatefulSet", "Deployment"} <= {
        c.split(":")[1] for c in checked}, checked


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    validator = _validator()
    daemonset = copy.deepcopy(next(d for d in manifests()["driver.yaml"]
                                   if d["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(validator.ValidationError, match="hostNetwrok"):
        validator.validate(daemonset, validator.latest_version(), strict=True)


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for name, documents in manifests().items():
        for document in documents:
            spec = document.get("spec", {})
            if document["kind"] == "Pod":
                specs.append((f"{name}:{document['metadata']['name']}", spec))
            elif "template" in spec:
                specs.append((f"{name}:{document['metadata']['name']}", spec["template"]["spec"]))
    return specs


def test_the_pods_run_as_the_images_user_or_with_its_group() -> None:
    """The driver and the archive as the image's user; applications with its group as their
    primary group (the driver's control socket admits them by it); the init container gives
    the driver directory to that user; every pod mounts the same directory."""
    uid, gid = (int(image_settings()[k]) for k in ("SLIPSTREAM_UID", "SLIPSTREAM_GID"))
    for name, spec in _pod_specs():
        for container in spec["containers"]:
            context = {**spec.get("securityContext", {}),
                       **container.get("securityContext", {})}
            assert context["runAsGroup"] == gid, (name, container["name"])
            if container["name"] in ("driver", "archive"):
                assert context["runAsUser"] == uid, (name, container["name"])
            else:
                assert context["runAsUser"] != uid, (name, container["name"])
            assert context["runAsNonRoot"] is True
            assert any(m["mountPath"] == DRIVER_DIRECTORY for m in container["volumeMounts"])
        paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
        assert paths == [DRIVER_DIRECTORY], name
    driver = dict(_pod_specs())["driver.yaml:slipstream-driver"]
    assert f"chown {uid}:{gid} {DRIVER_DIRECTORY}" in driver["initContainers"][0]["command"][-1]


def test_podman_gets_the_pod_of_a_daemonset_and_of_a_statefulset() -> None:
    played, left_out = kube_play.playable(
        [*manifests()["driver.yaml"], *manifests()["archive.yaml"]])
    kinds = [(d["kind"], d["metadata"]["name"]) for d in played]
    assert kinds == [("ConfigMap", "slipstream-driver"), ("Pod", "slipstream-driver"),
                     ("ConfigMap", "slipstream-archive"),
                     ("PersistentVolumeClaim", "recordings-slipstream-archive-0"),
                     ("Pod", "slipstream-archive-0")]
    assert left_out == ["Service/slipstream-archive"]
    key, value = kube_play.INIT_CONTAINER_TYPE  # both have init containers
    assert all(d["metadata"]["annotations"][key] == value for d in played if d["kind"] == "Pod")
    archive = played[-1]["spec"]
    assert {"name": "recordings", "persistentVolumeClaim": {
        "claimName": "recordings-slipstream-archive-0"}} in archive["volumes"]
    mdc, left_out = kube_play.playable(manifests()["example-mdc.yaml"])
    assert left_out == ["Service/slipstream-mdc-control"]
    [deployment] = [d for d in mdc if d["kind"] == "Deployment"]
    assert deployment["metadata"]["annotations"][key] == value  # where podman reads it
    with pytest.raises(kube_play.ManifestError, match="Job/x: podman kube play runs no Job"):
        kube_play.playable([{"kind": "Job", "metadata": {"name": "x"}}])


def _for_this_test(documents: list[dict[str, Any]], image: str, directory: str,
                   suffix: str) -> list[dict[str, Any]]:
    """The documents with the test's image, a driver directory of its own on this host, and
    names of their own (the driver's ConfigMap's too, and what refers to it)."""
    text = kube_play.dump(documents)
    text = text.replace("localhost/slipstream:latest", image)
    text = text.replace(f"path: {DRIVER_DIRECTORY}\n", f"path: {directory}\n")
    renamed = list(yaml.safe_load_all(text))
    for document in renamed:
        document["metadata"]["name"] += suffix
        for volume in document.get("spec", {}).get("volumes", []):
            if "configMap" in volume:
                volume["configMap"]["name"] += suffix
    return renamed


@pytest.mark.containers
@pytest.mark.timeout(900)  # the session's image build, the first time
def test_podman_kube_play_runs_the_driver_and_two_pods_that_stream_through_it(
        containers: Containers, tmp_path: Path) -> None:
    suffix = f"-{uuid.uuid4().hex[:6]}"
    directory = f"{DRIVER_DIRECTORY}-kube{suffix}"
    driver_play, example_play = tmp_path / "driver.yaml", tmp_path / "example.yaml"
    driver_docs, _ = kube_play.playable(manifests()["driver.yaml"])
    driver_play.write_text(kube_play.dump(
        _for_this_test(driver_docs, containers.image, directory, suffix)))
    example_docs, _ = kube_play.playable(manifests()["example-ipc.yaml"])
    example_play.write_text(kube_play.dump(
        _for_this_test(example_docs, containers.image, directory, suffix)))
    pause_images = _pause_images()
    try:
        podman("kube", "play", str(driver_play))
        driver = f"slipstream-driver{suffix}-driver"
        containers.wait_healthy(driver)
        settings = podman("exec", driver, "slipstream", "driver", "--config",
                          "/etc/slipstream/driver.toml", "--print-config").stdout
        assert 'ipc_term_buffer_length = "16m"' in settings, settings  # the ConfigMap's
        podman("kube", "play", "--network", "none", str(example_play))
        received = containers.assert_succeeds(f"slipstream-example-subscriber{suffix}-subscriber",
                                              timeout=120)
        assert "received 100000 in order (0..99999)" in received, received
        assert "published 100000" in containers.assert_succeeds(
            f"slipstream-example-publisher{suffix}-publisher")
    finally:  # what a play that failed half way made too
        for path in (example_play, driver_play):
            podman("kube", "down", str(path), check=False)
        # The ConfigMap's volume (podman 4.3's kube down leaves it), and the pods' infra
        # image when podman built it for this test.
        podman("volume", "rm", "--force", f"slipstream-driver{suffix}", check=False)
        for image in _pause_images() - pause_images:
            podman("rmi", image, check=False)
        shutil.rmtree(directory, ignore_errors=True)


def _pause_images() -> set[str]:
    """The infra images podman builds for pods when no registry gives it one."""
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter",
                    "reference=localhost/podman-pause").stdout
    return set(listed.split())


#: A call to the archive's control stream from a container beside it: its recordings.
_LIST_RECORDINGS = """
from slipstream.archive.client import ArchiveClient
from slipstream.client import Client
with Client.connect() as client, ArchiveClient(client, "127.0.0.1", 8010, 10,
                                               timeout_s=10) as archive:
    for listed in archive.list_recordings():
        d = listed.descriptor
        print("recording", d.recording_id, d.channel, d.stream_id, listed.recorded_position)
"""


@pytest.mark.containers
@pytest.mark.timeout(900)  # the session's image build, the first time
def test_the_archives_configuration_records_and_answers_calls_in_a_container(
        containers: Containers) -> None:
    """archive.yaml's archive.toml, as its ConfigMap gives it (its directory moved to the
    container's /tmp, where the StatefulSet mounts a volume): the archive records the IPC
    stream it names and answers a call on its control stream (bound on every address, here
    the loopback of the driver container's network, which the others join)."""
    config = next(d for d in manifests()["archive.yaml"] if d["kind"] == "ConfigMap")
    toml = config["data"]["archive.toml"].replace(
        'dir = "/var/lib/slipstream-archive"', 'dir = "/tmp/recordings"')
    driver = containers.driver(shm_size="512m")
    beside = (f"--ipc=container:{driver}", f"--network=container:{driver}",
              "--no-healthcheck")
    archive = containers.run(
        "archive", *beside, "--env", f"ARCHIVE_TOML={toml}", command=[
            "sh", "-c", 'printf "%s" "$ARCHIVE_TOML" > /tmp/archive.toml && '
                        "exec slipstream-archive run --config /tmp/archive.toml"])
    gid = containers.settings["SLIPSTREAM_GID"]
    app = (*beside, f"--user={APP_UID}:{gid}")
    published = containers.run("publisher", *app, command=[
        "slipstream-sample", "publish", "aeron:ipc", "1001", "--count", "1000",
        "--timeout", "3"])  # the archive never leaves: the publisher waits out the 3 s
    assert "published 1000" in containers.assert_succeeds(published)
    answer = containers.run("caller", *app, detach=False,
                            command=["python", "-c", _LIST_RECORDINGS])
    assert "recording 0 aeron:ipc 1001 96000" in answer, (answer, containers.logs(archive))
