"""Rendering and reading the Kubernetes manifests in deploy/k8s, for the deploy tests.

``render(overlay)`` runs ``kubectl kustomize`` (kubectl is on the machine image and CI's).
Schemas: core kinds against the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict:
an unknown field is an error), custom resources against the CRDs in deploy/crds, made strict
the same way (a CRD's structural schema only prunes unknown fields; we refuse them).
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRDS = ROOT / "deploy" / "crds"
OVERLAYS = ("plain-k8s", "kuberay", "cpu-dev")
KUBERNETES_VERSION = "1.32.0"  # the oldest minor the manifests promise (native sleep-free preStop, grpc probes)


@functools.lru_cache(maxsize=None)
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not installed: the deploy tests render the overlays with `kubectl kustomize`")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def objects(overlay: str, kind: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] == kind]


def named(overlay: str, kind: str, name: str) -> dict:
    matches = [o for o in objects(overlay, kind) if o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{overlay}: expected one {kind} {name}, found {len(matches)}"
    return matches[0]


# ---- schemas ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of that custom resource's strict schema."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            out[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


def strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever it lists properties and allows
    no unknown fields of its own (``x-kubernetes-preserve-unknown-fields``), so that a
    misspelt field fails validation as it would be dropped on a real cluster."""
    schema = copy.deepcopy(schema)
    for node in _walk(schema):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
    return schema


def _walk(node: Any) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def validate(obj: dict) -> None:
    """Raise if ``obj`` does not fit its kind's schema (CRD or Kubernetes)."""
    validator = crd_validators().get((obj["apiVersion"], obj["kind"]))
    if validator is None:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        raise error
    # The CRD schemas leave metadata open; check it as any object's metadata.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                                 KUBERNETES_VERSION, strict=True)


SchemaError = (jsonschema.ValidationError, kubernetes_validate.ValidationError)


# ---- pods ----------------------------------------------------------------------------------
def pod_templates(overlay: str) -> list[tuple[str, dict]]:
    """(where, pod template) for every pod the overlay makes: Deployments, Ray head and groups."""
    out = [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]) for d in objects(overlay, "Deployment")]
    for rc in objects(overlay, "RayCluster"):
        out.append((f"RayCluster/{rc['metadata']['name']}/head", rc["spec"]["headGroupSpec"]["template"]))
        out += [(f"RayCluster/{rc['metadata']['name']}/{g['groupName']}", g["template"])
                for g in rc["spec"]["workerGroupSpecs"]]
    return out


def container_ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
