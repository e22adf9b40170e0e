"""The image run with podman, for the image tests (test_image.py).

``PlainK8s`` runs the plain-k8s overlay's Deployments as containers, one per pod, on a podman
network of their own (one address each, as pods have): args, environment variables, mounts,
probes, preStop hooks and grace periods come from `kubectl kustomize
deploy/k8s/overlays/plain-k8s`, the config is the overlay's own pdserve.yaml, and the TLS and
API-key secrets are made here. The two router Services (``pdserve-router`` for clients,
``pdserve-router-internal`` where workers join) are ``service.Service`` proxies on the
network's gateway address, which every pod resolves the internal Service's name to.

A worker pod's certificate is its own, as cert-manager's csi-driver would mount it
(``csi_certificate``): signed by the secrets' CA, naming the volume's role and the pod's DNS
name. Each container resolves every worker pod's DNS name (``<pod>.<subdomain>.<namespace>.svc
.cluster.local``, the cluster DNS of a headless Service) to its address: pods get names and
addresses by their number, so each container is told those of the first ``MAX_PODS`` at its start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.deploy.service import Service

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "plain-k8s"
ROLES = ("router", "prefill", "decode")
# What this machine cannot give a pod: the overlay's 20 GiB of KV and its cores. float32 is the
# transformers-exact mode, so that streams compare token for token with the host's engine. A
# worker checks its membership every second rather than every 5 s: a new router gathers its
# workers sooner (each join reaches a random router, as through a ClusterIP Service).
NAMESPACE = "pdserve"  # the overlay's (base/kustomization.yaml)
MAX_PODS = 16  # pods one PlainK8s starts at most (a few per rolling update)
SMALL_POD = {"PDSERVE_KV_CACHE_GIB": "0.25", "PDSERVE_THREADS_PER_WORKER": "1", "PDSERVE_DTYPE": "float32",
             "PDSERVE_JOIN_INTERVAL_SECONDS": "1"}


def load_image_tool():
    spec = importlib.util.spec_from_file_location("pdserve_image_tool", ROOT / "deploy" / "image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ulimits() -> list[str]:
    """The container's limits, at or below this process's (runc may not raise them)."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 16384)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    nproc = 8192 if nproc == resource.RLIM_INFINITY else min(nproc, 8192)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, check=check,
                          timeout=timeout)


def plain_k8s_deployments() -> dict[str, dict]:
    """Each Deployment's spec (strategy, template) by role."""
    rendered = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True)
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d and d.get("kind") == "Deployment"]
    return {d["metadata"]["name"].removeprefix("pdserve-"): d["spec"] for d in docs}


def secrets(tmp: Path) -> tuple[Path, Path, str]:
    """The overlay's two secrets as Kubernetes mounts them: files readable by the pod's user.
    The CA's key goes to ``tmp/issuer`` (the csi-driver's Issuer signs with it), not in a secret."""
    tls = tmp / "tls"
    subprocess.run([sys.executable, "-m", "pdserve.cluster.certs", str(tls)], check=True, capture_output=True)
    (tmp / "issuer").mkdir()
    (tls / "ca.key").rename(tmp / "issuer" / "ca.key")
    api_key_dir = tmp / "api-key"
    api_key_dir.mkdir()
    key = uuid.uuid4().hex
    (api_key_dir / "api-key").write_text(key)
    for path in [*tls.iterdir(), api_key_dir / "api-key"]:
        path.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)  # a Secret's defaultMode 0644
    return tls, api_key_dir, key


@dataclass(frozen=True)
class Pod:
    role: str
    name: str  # the container's, and the pod name the downward API gives it
    ip: str


@dataclass(frozen=True)
class Stopped:
    """How a pod's termination went."""
    exit_code: int
    seconds: float  # from the start of its preStop to its exit


def csi_certificate(out: Path, ca_dir: Path, pod: Pod, attributes: dict[str, str]) -> Path:
    """What cert-manager's csi-driver mounts for ``pod`` (in ``out``): a certificate of the CA
    (``ca_dir``'s ca.pem, and its Issuer's key) naming the volume's role and DNS names, its
    ``${POD_NAME}`` and ``${POD_NAMESPACE}`` filled in; as tls.crt, tls.key and ca.crt."""
    from pdserve.cluster.certs import Issued, issue
    from pdserve.wire.tls import ROLE_URI_PREFIX, role_name

    [role] = [uri.removeprefix(ROLE_URI_PREFIX) for uri in attributes["csi.cert-manager.io/uri-sans"].split(",")]
    names = attributes["csi.cert-manager.io/dns-names"].replace("${POD_NAME}", pod.name)
    names = names.replace("${POD_NAMESPACE}", NAMESPACE).split(",")
    assert role_name(role) in names, f"{pod.name}: the certificate would not name {role_name(role)}"
    out.mkdir(parents=True)
    ca = Issued(ca_dir / "tls" / "ca.pem", ca_dir / "issuer" / "ca.key")
    issued = issue(ca, out, role, extra_names=tuple(n for n in names if n != role_name(role)), stem="issued")
    issued.cert.rename(out / "tls.crt")
    issued.key.rename(out / "tls.key")
    shutil.copy(ca.cert, out / "ca.crt")
    for path in out.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    return out


class PlainK8s:
    """The overlay's pods on a network of their own; ``pods`` are the ones running."""

    def __init__(self, image: str, model_dir: Path, tmp: Path):
        self.image, self.specs, self.tmp = image, plain_k8s_deployments(), tmp
        self.tls, api_key_dir, self.api_key = secrets(tmp)
        self.network = f"pdserve-test-{uuid.uuid4().hex[:8]}"
        self.subnet = f"10.123.{200 + os.getpid() % 50}"
        self.gateway = f"{self.subnet}.1"  # the Services' cluster IP
        self.mounts = {"model": f"{model_dir}:/models/model:ro", "config": f"{OVERLAY}:/etc/pdserve/config:ro",
                       "tls": f"{self.tls}:/etc/pdserve/tls:ro", "api-key": f"{api_key_dir}:/etc/pdserve/api-key:ro"}
        self.pods: list[Pod] = []
        self.public: Service | None = None  # pdserve-router: ready routers only
        self.internal: Service | None = None  # pdserve-router-internal: publishNotReadyAddresses
        self._gone_logs: dict[str, str] = {}
        self._count = 0
        podman("network", "create", "--subnet", f"{self.subnet}.0/24", self.network)

    def template(self, role: str) -> dict:
        return self.specs[role]["template"]["spec"]

    def _pod(self, role: str, number: int) -> Pod:
        return Pod(role, f"{self.network}-{role}-{number}", f"{self.subnet}.{9 + number}")

    def _hosts(self) -> list[str]:
        """``--add-host`` of the cluster DNS: every worker pod's name this network may have."""
        hosts = [f"pdserve-router-internal:{self.gateway}"]
        for role in ROLES:
            subdomain = self.template(role).get("subdomain")
            if subdomain:
                hosts += [f"{p.name}.{subdomain}.{NAMESPACE}.svc.cluster.local:{p.ip}"
                          for p in (self._pod(role, n) for n in range(1, MAX_PODS + 1))]
        return [arg for host in hosts for arg in ("--add-host", host)]

    def _volumes(self, pod: Pod, container: dict) -> list[str]:
        """``-v`` of each mount: a secret's or ConfigMap's files, or the pod's own certificate."""
        volumes = {v["name"]: v for v in self.template(pod.role).get("volumes", [])}
        out = []
        for mount in container.get("volumeMounts", []):
            csi = volumes.get(mount["name"], {}).get("csi")
            if csi is not None and csi["driver"] == "csi.cert-manager.io":
                local = csi_certificate(self.tmp / "csi" / pod.name, self.tmp, pod, csi["volumeAttributes"])
                out += ["-v", f"{local}:{mount['mountPath']}:ro"]
            elif mount["name"] in self.mounts:
                out += ["-v", self.mounts[mount["name"]]]
        return out

    def start(self, role: str) -> Pod:
        """Create one more pod of ``role``'s Deployment (not waiting for it to be ready)."""
        self._count += 1
        assert self._count <= MAX_PODS, "raise MAX_PODS: each container knows the names of that many pods"
        pod = self._pod(role, self._count)
        container = self.template(role)["containers"][0]
        env = {}
        for item in container.get("env", []):  # in order: a value may name the variables before it, $(NAME)
            field = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            value = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": pod.ip}.get(
                field, item.get("value"))
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
        env |= SMALL_POD
        volumes = self._volumes(pod, container)
        podman("run", "-d", "--name", pod.name, "--network", self.network, "--ip", pod.ip,
               *self._hosts(), "--shm-size", "1g", *ulimits(), *volumes,
               *[a for k, v in env.items() for a in ("-e", f"{k}={v}")], self.image, *container["args"])
        self.pods.append(pod)
        if self.internal is None:  # the gateway's address exists once a container is on the network
            self.public, self.internal = Service(self.gateway, 50051, 50051), Service(self.gateway, 50052, 50052)
        if role == "router":
            self.internal.add(pod.ip)
        return pod

    def wait_ready(self, pod: Pod, timeout_s: float = 300.0) -> float:
        """Until the pod's readinessProbe (an HTTP GET, as the overlay declares it) passes; the
        seconds it took. A router that is ready joins the public Service's endpoints."""
        probe = self.template(pod.role)["containers"][0]["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in self.template(pod.role)["containers"][0]["ports"]}
        url = f"http://{pod.ip}:{ports.get(probe['port'], probe['port'])}{probe['path']}"
        start = time.monotonic()
        while _status(url) != 200:
            if podman("inspect", pod.name, "--format", "{{.State.Running}}", check=False).stdout.strip() != "true":
                raise AssertionError(f"{pod.name} exited:\n{self.log(pod)}")
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"{pod.name} not ready in {timeout_s:.0f} s:\n{self.log(pod)}")
            time.sleep(0.5)  # the overlay probes every 5 s; sooner here, to keep the test short
        if pod.role == "router":
            self.public.add(pod.ip)
        return time.monotonic() - start

    def terminate(self, pod: Pod) -> Stopped:
        """What deleting the pod does: it leaves the Services' endpoints (but the internal one's,
        which publishes not-ready addresses, keeps it until it is gone), the kubelet runs its
        preStop hook, then SIGTERM, and SIGKILL at terminationGracePeriodSeconds from the start."""
        spec = self.template(pod.role)
        grace = spec["terminationGracePeriodSeconds"]
        if pod.role == "router":
            self.public.remove(pod.ip)
        start = time.monotonic()
        hook = spec["containers"][0].get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if hook:  # a worker's ends with the process: podman exec then reports an error, which is fine
            podman("exec", pod.name, *hook, check=False, timeout=grace + 30)
        left = max(0, round(grace - (time.monotonic() - start)))
        podman("stop", "--time", str(left), pod.name, check=False, timeout=left + 60)
        seconds = time.monotonic() - start
        exit_code = int(podman("inspect", pod.name, "--format", "{{.State.ExitCode}}").stdout.strip())
        self._gone_logs[pod.name] = self.log(pod, chars=None)
        podman("rm", "-f", pod.name, check=False)
        self.pods.remove(pod)
        if pod.role == "router":
            self.internal.remove(pod.ip)
        return Stopped(exit_code, seconds)

    def running(self, role: str) -> list[Pod]:
        return [p for p in self.pods if p.role == role]

    def log(self, pod: Pod, chars: int | None = 3000) -> str:
        """The pod's stdout then stderr, the last ``chars`` characters (None: all)."""
        if pod.name in self._gone_logs:
            return self._gone_logs[pod.name][-chars if chars else 0:]
        done = podman("logs", pod.name, check=False)
        return (done.stdout + done.stderr)[-chars if chars else 0:]

    def logs(self) -> dict[str, str]:
        """Every pod's log tail, running or gone, for a failing assertion's message; the whole
        logs go to ``<tmp>/logs/<pod>.log`` (named in the message's first key)."""
        out = self.tmp / "logs"
        out.mkdir(exist_ok=True)
        whole = {**self._gone_logs, **{p.name: self.log(p, chars=None) for p in self.pods}}
        for name, text in whole.items():
            (out / f"{name}.log").write_text(text)
        return {"whole logs": str(out), **{name: text[-3000:] for name, text in whole.items()}}

    def close(self) -> None:
        for service in (self.public, self.internal):
            if service is not None:
                service.close()
        for pod in self.pods:  # the end of the test: no drain is under test here (a router's would
            # serve out its connection age first, router.handover), so SIGKILL at once
            podman("rm", "-f", "--time", "0", pod.name, check=False, timeout=90)
        podman("network", "rm", "-f", self.network, check=False)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # not listening (yet, or any more)
