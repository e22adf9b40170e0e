"""What each pdserve container of deploy/'s overlays runs: its `pdserve` arguments, its
variables, its --config file as the pod would see it, and the settings the command resolves
from them (the real `pdserve` parser). Used by tests/deploy's cross-reference tests."""

import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.deploy.manifests import named, pod_templates


def pdserve_argv(container: dict) -> list[str] | None:
    """The `pdserve` arguments a container runs (its image's entry point is `pdserve`), or None."""
    if container.get("command") is None:
        return list(container.get("args", []))
    script = " ".join(container.get("args", []))
    found = re.search(r"exec pdserve (.*)$", script)
    return shlex.split(found.group(1)) if found else None


def with_mounted_files(argv: list[str], template: dict, overlay: str, tmp_path: Path) -> list[str]:
    """``argv`` with a --config path inside a ConfigMap volume replaced by a file holding that
    ConfigMap's data, as the pod would see it."""
    out = list(argv)
    if "--config" not in out:
        return out
    i = out.index("--config") + 1
    container = template["spec"]["containers"][0]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        if out[i].startswith(mount["mountPath"] + "/") and "configMap" in volumes[mount["name"]]:
            data = named(overlay, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])["data"]
            local = tmp_path / f"{mount['name']}-{len(list(tmp_path.iterdir()))}.yaml"
            local.write_text(data[out[i][len(mount["mountPath"]) + 1:]])
            out[i] = str(local)
            return out
    raise AssertionError(f"--config {out[i]} is not in a mounted ConfigMap")


def environment(container: dict) -> dict[str, str]:
    """The container's variables; those from the downward API get a stand-in value."""
    return {e["name"]: e.get("value", "10.0.0.7") for e in container.get("env", [])}


def parsed(argv: list[str], monkeypatch) -> SimpleNamespace:
    """Parse ``argv`` with the real `pdserve` parser; returns the command and its namespace."""
    import pdserve.cluster.cli
    from pdserve.cli import main
    from pdserve.cluster import worker_cli

    seen = {}
    monkeypatch.setattr(pdserve.cluster.cli, "serve", lambda args, **_: seen.setdefault("args", args) and 0)
    monkeypatch.setattr(worker_cli, "run_worker", lambda args: seen.setdefault("args", args) and 0)
    main(argv)
    return seen["args"]


def settings_of(argv: list[str], env: dict[str, str], monkeypatch) -> tuple[tuple, Any]:
    """(settings table, typed settings) of the command ``argv`` runs, as it would resolve them
    (``ServeSettings`` or ``WorkerSettings``, pdserve/cluster/typed_settings.py)."""
    from pdserve.cluster import settings, worker_cli

    args = parsed(argv, monkeypatch)
    if args.command == "worker":
        return worker_cli.worker_settings(), worker_cli.settings(args, env)
    assert args.command == "serve", argv
    return settings.serve_settings(), settings.resolve(args, env)


def pdserve_containers(overlay: str):
    for where, template in pod_templates(overlay):
        for container in template["spec"]["containers"]:
            argv = pdserve_argv(container)
            if argv is not None:
                yield where, template, container, argv
