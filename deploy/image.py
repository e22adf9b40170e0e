"""Build pdserve's CPU image with podman, here, reaching no package index: `make image`.

    .venv/bin/python deploy/image.py                        # builds (or reuses) pdserve:cpu
    .venv/bin/python deploy/image.py --base python:3.12-slim-bookworm   # where a registry serves bases

Three steps, each cached:
1. The base. With no ``--base``, a root filesystem made by Debian's ``mmdebstrap`` from Debian's
   own packages (python3, venv, g++, CA certificates) and imported as ``localhost/pdserve-base``.
   Where a registry serves base images, pass ``--base`` instead (the Dockerfile's default
   CPU base is ``python:3.12-slim-bookworm``).
2. The wheels. ``pip wheel`` on the host, constrained by requirements.lock, into a cache keyed
   by the lock; pdserve's own wheel and triton (asked for by xgrammar's metadata, never
   imported on a CPU) are left out. They are linked into deploy/wheels/ for the build only.
3. ``podman build`` of deploy/Dockerfile with ``VARIANT=cpu``. The image is labelled with a
   hash of everything the build reads, and a later call with the same inputs reuses it.

Podman runs with ``--runtime runc``: crun refuses this kind of machine's hybrid cgroups.
Prints the image's size and the build time at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNOREFILE = ROOT / "deploy" / "Dockerfile.dockerignore"
WHEELS_IN_CONTEXT = ROOT / "deploy" / "wheels"
CACHE = Path(os.environ.get("PDSERVE_IMAGE_CACHE", Path.home() / ".cache" / "pdserve-image"))
DEFAULT_TAG = "localhost/pdserve:cpu"
DEBIAN_BASE = "localhost/pdserve-base:bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "g++", "ca-certificates")
INPUTS_LABEL = "dev.pdserve.inputs"
BOOTSTRAP = ("pip==26.3", "setuptools==80.9.0", "wheel==0.45.1")  # as deploy/Dockerfile pins them
LEFT_OUT = ("pdserve-", "triton-")  # wheel name prefixes the image does not take from the host


def podman(*args: str, capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["podman", "--runtime", "runc", *args]
    return subprocess.run(cmd, check=check, text=True, capture_output=capture)


def image_label(ref: str, label: str) -> str | None:
    """The label's value on a local image, or None when the image is not here."""
    out = podman("image", "inspect", ref, capture=True, check=False)
    if out.returncode != 0:
        return None
    return (json.loads(out.stdout)[0].get("Labels") or {}).get(label, "")


def build_inputs() -> list[Path]:
    """Every file the build reads (the Dockerfile's context after its ignore file), wheels aside."""
    files = [DOCKERFILE, IGNOREFILE, ROOT / "pyproject.toml", ROOT / "README.md", ROOT / "requirements.lock"]
    files += sorted(p for p in (ROOT / "pdserve").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so"))
    return files


def inputs_hash(base: str) -> str:
    digest = hashlib.blake2b(digest_size=10)
    digest.update(base.encode())
    for path in build_inputs():
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def debian_base() -> str:
    """The base made from Debian's packages, built once per machine."""
    if image_label(DEBIAN_BASE, "x") is not None:
        return DEBIAN_BASE
    if shutil.which("mmdebstrap") is None:
        sys.exit("deploy/image.py: no --base given and no mmdebstrap to make one (apt-get install mmdebstrap)")
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "debian-base.tar"
    print(f"[1/3] base: mmdebstrap bookworm with {', '.join(DEBIAN_PACKAGES)} (a few minutes, once)", flush=True)
    subprocess.run(["mmdebstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", "bookworm",
                    str(tar)], check=True)
    podman("import", "--change", 'CMD ["/bin/bash"]', str(tar), DEBIAN_BASE, capture=True)
    tar.unlink()
    return DEBIAN_BASE


def wheelhouse() -> Path:
    """The locked dependencies as wheels, made once per requirements.lock."""
    lock = (ROOT / "requirements.lock").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    out = CACHE / f"wheels-{hashlib.blake2b(lock, digest_size=8).hexdigest()}"
    if (out / ".complete").exists():
        return out
    print(f"[2/3] wheels: pip wheel -c requirements.lock into {out}", flush=True)
    scratch = out.with_suffix(".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--progress-bar", "on", "-w", str(scratch),
                    "-c", str(ROOT / "requirements.lock"), str(ROOT)], check=True)
    # The image's venv starts by installing these (the Dockerfile's first pip line).
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d",
                    str(scratch / "bootstrap"), *BOOTSTRAP], check=True)
    for wheel in scratch.glob("*.whl"):
        if wheel.name.startswith(LEFT_OUT):
            wheel.unlink()
    (scratch / ".complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)
    return out


def build(tag: str, base: str | None, force: bool = False) -> dict:
    """Build the image, or reuse the one already built from the same inputs; returns a record."""
    base = base or debian_base()
    inputs = inputs_hash(base)
    if not force and image_label(tag, INPUTS_LABEL) == inputs:
        print(f"{tag}: already built from these inputs ({inputs}), reused", flush=True)
        return {"tag": tag, "inputs": inputs, "reused": True, "size_bytes": image_size(tag)}
    wheels = wheelhouse()
    started = time.monotonic()
    linked = []
    try:
        for wheel in [*wheels.glob("*.whl"), *wheels.glob("bootstrap/*.whl")]:
            target = WHEELS_IN_CONTEXT / wheel.relative_to(wheels)
            target.parent.mkdir(exist_ok=True)
            if not target.exists():
                same_disk = wheel.stat().st_dev == WHEELS_IN_CONTEXT.stat().st_dev
                os.link(wheel, target) if same_disk else shutil.copy2(wheel, target)
                linked.append(target)
        print(f"[3/3] podman build {tag} from {base} ({len(linked)} wheels)", flush=True)
        podman("build", "-f", str(DOCKERFILE), "--ignorefile", str(IGNOREFILE), "--build-arg", "VARIANT=cpu",
               "--build-arg", f"CPU_IMAGE={base}", "--label", f"{INPUTS_LABEL}={inputs}", "-t", tag, str(ROOT))
    finally:
        for target in linked:
            target.unlink(missing_ok=True)
        shutil.rmtree(WHEELS_IN_CONTEXT / "bootstrap", ignore_errors=True)
    record = {"tag": tag, "inputs": inputs, "reused": False, "build_s": round(time.monotonic() - started, 1),
              "size_bytes": image_size(tag)}
    print(f"{tag}: built in {record['build_s']} s, {record['size_bytes'] / 2**30:.2f} GiB", flush=True)
    return record


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", tag, "--format", "{{.Size}}", capture=True).stdout.strip())


def cold_start(tag: str, model_dir: str, port: int = 18000) -> float:
    """Seconds from ``podman run`` of ``pdserve serve`` to the first streamed token of a
    completion (the container starts, Ray starts, both workers load the model)."""
    import urllib.request
    import uuid

    name = f"pdserve-cold-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 1, "stream": True}).encode()
    started = time.monotonic()
    podman("run", "-d", "--name", name, "--network", "host", "--shm-size", "1g", "--ulimit", "nofile=16384:16384",
           "--ulimit", "nproc=8192:8192", "-v", f"{Path(model_dir).resolve()}:/models/model:ro", tag, "serve",
           "/models/model", "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(port + 1), capture=True)
    try:
        while time.monotonic() - started < 600:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                 headers={"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as answer:
                    if answer.readline().startswith(b"data:"):
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"{tag} served no token in 600 s")
    finally:
        podman("rm", "-f", "--time", "5", name, capture=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=DEFAULT_TAG)
    parser.add_argument("--base", help="a base image with python3 (default: one made from Debian's packages)")
    parser.add_argument("--force", action="store_true", help="build even if an image from the same inputs exists")
    parser.add_argument("--cold-start", metavar="MODEL_DIR",
                        help="then time `pdserve serve` in the image, from `podman run` to a first token, with "
                             "MODEL_DIR (readable by uid 10001) mounted as the model")
    args = parser.parse_args(argv)
    if shutil.which("podman") is None:
        sys.exit("deploy/image.py: podman is not installed (apt-get install podman runc)")
    record = build(args.tag, args.base, args.force)
    if args.cold_start:
        record["cold_start_s"] = round(cold_start(args.tag, args.cold_start), 1)
        print(f"{args.tag}: first token {record['cold_start_s']} s after podman run", flush=True)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
