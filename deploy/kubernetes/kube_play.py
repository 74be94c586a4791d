"""Kubernetes manifests in the kinds ``podman kube play`` runs, for trying them on one host:

    python3 deploy/kubernetes/kube_play.py deploy/kubernetes/driver.yaml > driver-play.yaml
    podman kube play driver-play.yaml          # podman kube down driver-play.yaml ends it

Pods, Deployments, ConfigMaps and PersistentVolumeClaims pass as they are.  A DaemonSet (one
pod per node) becomes the Pod of its template, named as the DaemonSet: on one host, that is
what it runs; a StatefulSet becomes the Pod of its first replica (``NAME-0``), with its
volume claim templates as PersistentVolumeClaims named as Kubernetes names them
(``CLAIM-NAME-0``).  Services are left out, as podman has no cluster network to give them
(each is named on stderr).  A pod with init containers is annotated to keep them once they
end (podman's ``always`` type): podman 4.3 removes a ``once`` init container as it ends and
can fail the whole play when that races with the container's exit ("failed to remove once
init container ... as it is running", podman issue 18477).  Needs PyYAML (in the project's
test extra).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

#: Kinds ``podman kube play`` runs as they are.
PLAYED = {"Pod", "Deployment", "ConfigMap", "PersistentVolumeClaim"}
#: Kinds it has no use for on one host.
LEFT_OUT = {"Service"}
#: Podman's annotation of how a pod's init containers run, and the value that keeps them.
INIT_CONTAINER_TYPE = ("io.podman.annotations.init.container.type", "always")


class ManifestError(ValueError):
    """A document this tool cannot turn into what podman plays: the message names it."""


def _template_pod(document: dict[str, Any], name: str) -> dict[str, Any]:
    template = copy.deepcopy(document["spec"]["template"])
    metadata = template.get("metadata", {})
    metadata["name"] = name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def _keep_init_containers(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (a Pod or a Deployment) with :data:`INIT_CONTAINER_TYPE` on its pods when
    they have init containers; the caller's document is left as it was."""
    pod = document["spec"]["template"] if document["kind"] == "Deployment" else document
    if not pod.get("spec", {}).get("initContainers"):
        return document
    document = copy.deepcopy(document)
    key, value = INIT_CONTAINER_TYPE
    # Podman 4.3 takes a Deployment's pod annotations from the Deployment's own metadata;
    # a cluster, from its template's.
    annotated = [document]
    if document["kind"] == "Deployment":
        annotated.append(document["spec"]["template"])
    for part in annotated:
        part.setdefault("metadata", {}).setdefault("annotations", {})[key] = value
    return document


def playable(documents: Iterable[dict[str, Any] | None]) -> tuple[list[dict[str, Any]],
                                                                   list[str]]:
    """The documents podman plays, and the names of those left out (``Service/NAME``)."""
    played: list[dict[str, Any]] = []
    left_out: list[str] = []
    for document in documents:
        if not document:
            continue
        kind, name = document.get("kind"), document.get("metadata", {}).get("name")
        if kind in ("Pod", "Deployment"):
            played.append(_keep_init_containers(document))
        elif kind in PLAYED:
            played.append(document)
        elif kind == "DaemonSet":
            played.append(_keep_init_containers(_template_pod(document, name)))
        elif kind == "StatefulSet":
            pod = _template_pod(document, f"{name}-0")
            volumes = pod["spec"].setdefault("volumes", [])
            for claim in document["spec"].get("volumeClaimTemplates", []):
                claim_name = f"{claim['metadata']['name']}-{name}-0"
                played.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                               "metadata": {"name": claim_name}, "spec": claim["spec"]})
                volumes.append({"name": claim["metadata"]["name"],
                                "persistentVolumeClaim": {"claimName": claim_name}})
            played.append(_keep_init_containers(pod))
        elif kind in LEFT_OUT:
            left_out.append(f"{kind}/{name}")
        else:
            raise ManifestError(f"{kind}/{name}: podman kube play runs no {kind}, and this "
                                f"tool knows no form of it that it does")
    return played, left_out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a ConfigMap's files) as literal blocks, as they were written."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                   style="|" if "\n" in value else None)


_Dumper.add_representer(str, _string)


def dump(documents: Sequence[dict[str, Any]]) -> str:
    """The documents as one YAML stream."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    documents = [doc for path in paths for doc in yaml.safe_load_all(Path(path).read_text())]
    try:
        played, left_out = playable(documents)
    except ManifestError as e:
        print(f"kube_play: {e}", file=sys.stderr)
        return 2
    for name in left_out:
        print(f"kube_play: left out {name} (podman has no cluster network)", file=sys.stderr)
    sys.stdout.write(dump(played))
    return 0


if __name__ == "__main__":
    sys.exit(main())
