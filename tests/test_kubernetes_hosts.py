"""``podman kube play`` of the dynamic multi-destination-cast example
(deploy/kubernetes/example-mdc.yaml) across three namespace hosts, each a node: on every node
the driver's DaemonSet pod (driver.yaml), on node 1 the publisher's Deployment, on nodes 2
and 3 the subscriber DaemonSet's pod.  No multicast: the subscribers' drivers join node 1's
control address by their status messages, and every message a subscriber reads is the one
after the last (the sample exits 1 on a gap).

What a cluster gives and podman does not is given by the test, nothing else changed in the
manifests: the node's address for the downward API's ``status.hostIP`` (podman fills no
``status`` field) and where the commands name it (podman does not expand ``$(NAME)``), and
the headless Service's name, which cluster DNS would answer with the publisher's node
address, as the /etc/hosts of the drivers that resolve it (podman has no cluster DNS).
Podman runs inside each host's network namespace (``nsenter --net``, as in
test_containers_hosts.py), so a pod's ``hostNetwork`` is that host's network.

Needs root, podman and iproute2: skips without, fails under CI=true.
"""

from __future__ import annotations

import copy
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from containers import Containers, podman
from test_kubernetes import DRIVER_DIRECTORY, _for_this_test, _pause_images, kube_play, manifests

pytestmark = pytest.mark.timeout(900)  # the session's image build, the first time

#: What each subscriber reads, in order, before the test ends the pods (the publisher sends
#: 1,000 a second).
ENOUGH = 3000
#: The name the subscribers' channel gives the publisher's control address.
CONTROL_NAME = "slipstream-mdc-control.default.svc.cluster.local"


def _with_host_ip(document: dict[str, Any], address: str) -> dict[str, Any]:
    """``document`` with ``address`` where its containers take ``status.hostIP``, and in
    their commands where those name the variable (``$(NAME)``, which the kubelet expands and
    podman 4.3 does not); the caller's document is left as it was."""
    document = copy.deepcopy(document)
    pod = document["spec"]["template"] if document["kind"] == "Deployment" else document
    for container in pod["spec"]["containers"]:
        for variable in container.get("env", []):
            field = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field == "status.hostIP":
                variable.pop("valueFrom")
                variable["value"] = address
                for key in ("command", "args"):
                    container[key] = [part.replace(f"$({variable['name']})", address)
                                      for part in container.get(key, [])]
    return document


def _received(log: str) -> int:
    """The last count the subscriber printed (``received N in order (..)``), 0 if none."""
    counts = re.findall(r"received (\d+) in order", log)
    return int(counts[-1]) if counts else 0


def _with_hosts_file(documents: list[dict[str, Any]], hosts_file: Path) -> None:
    """The driver's pod in ``documents`` with ``hosts_file`` as its containers' /etc/hosts."""
    pod = next(d for d in documents if d["kind"] == "Pod")
    pod["spec"]["volumes"].append({"name": "cluster-dns",
                                   "hostPath": {"path": str(hosts_file), "type": "File"}})
    for container in pod["spec"]["containers"]:
        container.setdefault("volumeMounts", []).append(
            {"name": "cluster-dns", "mountPath": "/etc/hosts", "readOnly": True})


@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_podman_kube_play_runs_the_mdc_example_across_three_nodes(
        containers: Containers, hosts, tmp_path: Path) -> None:
    nodes = {i: hosts[i] for i in (1, 2, 3)}
    on = {i: ("nsenter", f"--net=/run/netns/{node.namespace}") for i, node in nodes.items()}
    suffix = f"-{uuid.uuid4().hex[:6]}"
    directories = {i: f"{DRIVER_DIRECTORY}-kube{suffix}-{i}" for i in nodes}
    driver_docs, _ = kube_play.playable(manifests()["driver.yaml"])
    example = {d["kind"]: d for d in kube_play.playable(manifests()["example-mdc.yaml"])[0]}
    # Podman keeps a pod's /etc/hosts the host's on the host's network (hostAliases too are
    # left out there): the Service's record is the drivers' /etc/hosts instead.
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"127.0.0.1 localhost\n{nodes[1].address} {CONTROL_NAME}\n")
    plays: dict[tuple[int, str], Path] = {}
    for i in nodes:
        documents = _for_this_test(driver_docs, containers.image, directories[i], f"{suffix}-{i}")
        _with_hosts_file(documents, hosts_file)
        plays[i, "driver"] = tmp_path / f"driver-{i}.yaml"
        plays[i, "driver"].write_text(kube_play.dump(documents))
    for i in (2, 3):
        plays[i, "subscriber"] = tmp_path / f"subscriber-{i}.yaml"
        plays[i, "subscriber"].write_text(kube_play.dump(_for_this_test(
            [_with_host_ip(example["Pod"], nodes[i].address)], containers.image,
            directories[i], f"{suffix}-{i}")))
    plays[1, "publisher"] = tmp_path / "publisher-1.yaml"
    plays[1, "publisher"].write_text(kube_play.dump(_for_this_test(
        [_with_host_ip(example["Deployment"], nodes[1].address)], containers.image,
        directories[1], f"{suffix}-1")))
    pause_images = _pause_images()

    def play(*which: tuple[int, str]) -> None:
        """Plays at once: podman 4.3 waits 20 s for each pod's init container here."""
        with ThreadPoolExecutor(len(which)) as pool:
            for done in [pool.submit(podman, "kube", "play",
                                     # The applications reach their driver by /dev/shm alone.
                                     *(("--network", "none") if role == "subscriber" else ()),
                                     str(plays[i, role]), prefix=on[i], timeout=300)
                         for i, role in which]:
                done.result()

    def container(i: int, pod: str, name: str) -> str:
        listed = podman("ps", "--all", "--format", "{{.Names}}", prefix=on[i]).stdout
        found = [n for n in listed.split() if n.startswith(f"{pod}{suffix}-{i}")
                 and n.endswith(f"-{name}")]
        assert len(found) == 1, (pod, name, listed)
        return found[0]

    try:
        play(*((i, "driver") for i in nodes))
        for i in nodes:
            containers.wait_healthy(container(i, "slipstream-driver", "driver"), prefix=on[i])
        play((2, "subscriber"), (3, "subscriber"), (1, "publisher"))
        subscribers = {i: container(i, "slipstream-mdc-subscriber", "subscriber")
                       for i in (2, 3)}
        publisher = container(1, "slipstream-mdc-publisher", "publisher")
        deadline = time.monotonic() + 120
        while True:
            logs = {i: containers.logs(name, on[i]) for i, name in subscribers.items()}
            if all(_received(log) >= ENOUGH for log in logs.values()):
                break
            for i, name in [*subscribers.items(), (1, publisher)]:
                state = containers.inspect(name, on[i])["State"]
                assert state["Running"], (name, state["Status"], containers.logs(name, on[i]))
            assert time.monotonic() < deadline, ({i: _received(log) for i, log in logs.items()},
                                                 logs, containers.logs(publisher, on[1]))
            time.sleep(1)
        for log in logs.values():
            assert f"control={CONTROL_NAME}:40456" in log, log
    finally:  # what a play that failed half way made too
        for (i, _), path in reversed(plays.items()):
            podman("kube", "down", str(path), prefix=on[i], check=False)
        for i in nodes:
            podman("volume", "rm", "--force", f"slipstream-driver{suffix}-{i}", check=False)
        for image in _pause_images() - pause_images:
            podman("rmi", image, check=False)
        for directory in directories.values():
            shutil.rmtree(directory, ignore_errors=True)
