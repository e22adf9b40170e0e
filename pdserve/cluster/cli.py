"""The cluster's commands of ``pdserve`` (``pdserve.cli`` registers them with the planner's):

    pdserve serve [MODEL]            start a local cluster (router + workers as Ray actors)
    pdserve status --address RAY     the endpoints and processes of a cluster on a Ray cluster
    pdserve stop --address RAY       drain and stop it
    pdserve rollout --address RAY --pool POOL   restart every process of a pool in turn, losing no request
    pdserve rollout --address RAY --verify-kv on|off   the same for every worker, to a new verify_kv_transfers
    pdserve set-role --address RAY --worker ADDR --role ROLE   move an elastic worker to another role in place
    pdserve generate "PROMPT"        stream a completion from a running cluster

``pdserve worker --role ROLE`` is ``pdserve.cluster.worker_cli``'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

from pdserve.cluster import shutdown
from pdserve.cluster.settings import DRAIN_GRACE_SECONDS, SettingsError, add_arguments, flag_type, given, resolve


def _serve_parser(sub, settings: bool = True) -> None:
    p = sub.add_parser("serve", help="start the cluster with a model (default: SmolLM2-135M-Instruct)",
                       description="Start a router, prefill workers and decode workers as Ray actors. "
                                   "Settings come from flags, PDSERVE_* variables and --config FILE.yaml, "
                                   "in that order of precedence.")
    p.add_argument("--version", action="version", version=f"pdserve {version()}")
    p.add_argument("--detach", action="store_true",
                   help="with --address: return once the cluster serves, and leave it running (pdserve stop ends it)")
    if settings:
        add_arguments(p)


def _cluster_parsers(sub) -> None:
    for name, help_ in (("status", "the endpoints and processes of a cluster started with --address"),
                        ("stop", "drain and stop a cluster started with --address")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--address", required=True, help="the Ray cluster's address (serve's --address)")
        p.add_argument("--cluster-name", default="pdserve", help="the cluster's Ray namespace (serve's --cluster-name)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the status as one JSON object")
        else:
            grace = DRAIN_GRACE_SECONDS
            p.add_argument(grace.flag, type=flag_type(grace), default=grace.default,
                           help=f"{grace.help} (default {grace.default:g})")


def _rollout_parser(sub) -> None:
    p = sub.add_parser("rollout", help="restart every process of one pool in turn, as a Deployment's rolling update does",
                       description="Each process of the pool is replaced in turn: a new one starts with the same "
                                   "settings and becomes ready, then the old one drains (no new requests; its "
                                   "held KV is pulled, its streams finish) and stops. Clients lose no request "
                                   "(docs/operations.md).")
    p.add_argument("--address", required=True, help="the Ray cluster's address (serve's --address)")
    p.add_argument("--cluster-name", default="pdserve", help="the cluster's Ray namespace (serve's --cluster-name)")
    p.add_argument("--pool", choices=("prefill", "decode", "router"), help="the pool to restart (or --verify-kv)")
    p.add_argument("--verify-kv", choices=("on", "off"),
                   help="instead of --pool: restart every worker with verify_kv_transfers on or off, turning it on "
                        "in the prefill pool (the KV holders) first, off in the decode pool first (docs/operations.md)")
    grace = DRAIN_GRACE_SECONDS
    p.add_argument(grace.flag, type=flag_type(grace), default=grace.default,
                   help=f"how long each old process may take to finish what it runs; past it a worker's streams "
                        f"migrate (default {grace.default:g})")


def _set_role_parser(sub) -> None:
    p = sub.add_parser("set-role", help="move an elastic worker to another role in place, without a model load",
                       description="The worker (of a cluster served with --elastic-roles) leaves its pool, lets "
                                   "what it runs there finish (held KV is pulled, streams end; past the grace "
                                   "its streams migrate), and joins the other pool in the same process "
                                   "(docs/elastic-roles.md).")
    p.add_argument("--address", required=True, help="the Ray cluster's address (serve's --address)")
    p.add_argument("--cluster-name", default="pdserve", help="the cluster's Ray namespace (serve's --cluster-name)")
    p.add_argument("--worker", required=True, help="the worker's internal address, as `pdserve status` lists it")
    p.add_argument("--role", required=True, choices=("prefill", "decode", "mixed"),
                   help="mixed: in the decode pool, and it prefills the requests it takes itself")
    p.add_argument("--reason", default="manual", help="why, for the log and pdserve:role_changes_total")
    grace = DRAIN_GRACE_SECONDS
    p.add_argument(grace.flag, type=flag_type(grace), default=grace.default,
                   help=f"how long the old role's work may take to finish; past it its streams migrate "
                        f"(default {grace.default:g})")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC address (serve's --grpc-port)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--api-key", default=None, help="the server's API key (default: env PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="verify a TLS public API against this CA (PEM)")


def serve(args, choose_layout=None) -> int:
    """``pdserve serve``. ``choose_layout``: what ``--layout auto`` asks for this machine's layout
    (``pdserve.cli`` hands in the planner's; without one, auto keeps the default layout)."""
    from pdserve.cluster.autoscaling import AutoscaleConfigError
    from pdserve.cluster.config import default_gpus
    from pdserve.cluster.layout_choice import apply_layout
    from pdserve.cluster.local import LocalCluster
    from pdserve.cluster.serve_config import build
    from pdserve.router.auth import ApiKeyError
    from pdserve.wire import tls
    from pdserve.wire.logs import configure

    from pdserve.engine.kernels.cpu_kernels import check_requested_isa

    try:
        s, layout_lines = apply_layout(resolve(args), given(args), choose_layout, gpu=lambda: default_gpus() > 0)
        for line in layout_lines:
            print(f"pdserve: {line}", flush=True)
        config = build(s)
        check_requested_isa()  # a KernelPathError is a ValueError too
    except (SettingsError, AutoscaleConfigError, ApiKeyError, tls.TlsConfigError, ValueError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)  # ValueError: ClusterConfig's checks across settings
        return 2
    if config.ray_address:
        return _serve_on_ray(config, s.ray.cluster_name, s.process.drain_grace_seconds, args.detach)
    configure(config.log, "controller")  # the autoscaler and supervisor log from this process
    cluster = LocalCluster(config)
    stop = threading.Event()
    _on_stop_signals(stop)
    shutdown.become_subreaper()  # every process Ray starts stays ours to end (cluster.shutdown)
    shutdown.dump_stacks_on(signal.SIGUSR1)  # kill -USR1: where every thread is, for a hang
    try:
        try:
            cluster.start()
        except Exception:
            # Say why now: stopping a half-started Ray can end this process (its core exits when
            # the GCS is gone) before the exception would reach the top.
            print(f"pdserve: the cluster did not start:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        _on_stop_signals(stop)  # ray.init (in start) installed its own SIGTERM handler: ours again
        http = f"OpenAI HTTP API on http://{cluster.http_address}/v1, " if cluster.http_address else ""
        print(f"pdserve: {http}gRPC API listening on {cluster.address}, serving {', '.join(config.served_model_names)} "
              f"({s.layout.prefill} prefill, {s.layout.decode} decode worker(s)); Ctrl-C stops", flush=True)
        stop.wait()
        grace_s = s.process.drain_grace_seconds
        # Whatever the stop waits on, the process ends in time (TERM_WAIT_S: to end the rest).
        shutdown.StopDeadline(grace_s + shutdown.MARGIN_S - shutdown.TERM_WAIT_S).start()
        cluster.stop_supervising()  # the workers the group's SIGTERM ends are not replaced
        print(f"pdserve: draining (up to {grace_s:g} s)", flush=True)
        _drain(cluster, grace_s)
    finally:
        print("pdserve: stopping", flush=True)
        lost = cluster.ray_lost()
        if not lost:
            cluster.stop()
        shutdown.end_descendants()
    if lost:  # Ray's own exit handler would wait on the GCS the signal ended
        print("pdserve: Ray was stopped by the same signal; its processes are ended", flush=True)
        os._exit(0)
    return 0


def _drain(cluster, grace_s: float) -> None:
    if cluster.ray_lost():
        print("pdserve: Ray was stopped by the same signal (its workers drained themselves); stopping", flush=True)
        return
    try:
        left = cluster.drain(grace_s)
    except Exception as exc:  # the router is gone already (the process group's signal reached it)
        print(f"pdserve: the router did not drain ({type(exc).__name__}: {exc}); stopping", flush=True)
        return
    if left:
        print(f"pdserve: {left} request(s) still running after the grace period; stopping anyway", flush=True)


def _banner(status: dict, config) -> str:
    http = f"OpenAI HTTP API on http://{status['http_address']}/v1, " if status["http_address"] else ""
    return (f"{http}gRPC API listening on {status['grpc_address']}, serving {', '.join(config.served_model_names)} "
            f"({len(status.get('prefill', []))} prefill, {len(status['decode'])} decode worker(s))")


def _serve_on_ray(config, cluster_name: str, grace_s: float, detach: bool) -> int:
    """``serve --address``: the cluster's controller is a detached actor (``pdserve.cluster.controller``).
    This process starts it, or attaches to the one running, and on Ctrl-C drains and stops the
    cluster. If this process dies instead, the cluster keeps serving."""
    import ray

    from pdserve.cluster import controller
    from pdserve.wire.logs import configure

    configure(config.log, "driver")
    controller.connect(config.ray_address, cluster_name)
    stop = threading.Event()
    _on_stop_signals(stop)
    handle, running = controller.get_or_create(config)
    # Secrets are not compared: the controller does not hand them out (a changed key goes unseen).
    if running and ray.get(handle.config.remote()) != config.without_secrets():
        print(f"pdserve: a cluster named {cluster_name!r} already runs with other settings; attaching to it "
              f"unchanged (pdserve stop --address {config.ray_address} first to apply new ones)", flush=True)
    status = ray.get(handle.start.remote())
    what = "attached to the running cluster" if running else "started"
    print(f"pdserve: {what}: {_banner(status, config)}; controller is the detached actor 'controller' in Ray "
          f"namespace {cluster_name!r}; " + ("detached, `pdserve stop --address` stops it" if detach
                                                    else "Ctrl-C stops the cluster"), flush=True)
    if detach:
        return 0
    stop.wait()
    print(f"pdserve: draining (up to {grace_s:g} s)", flush=True)
    _stop_cluster(handle, grace_s)
    return 0


def _stop_cluster(handle, grace_s: float) -> None:
    import ray

    left = ray.get(handle.drain.remote(grace_s))
    if left:
        print(f"pdserve: {left} request(s) still running after the grace period; stopping anyway", flush=True)
    print("pdserve: stopping", flush=True)
    try:
        ray.get(handle.shutdown.remote())
    except ray.exceptions.RayActorError:  # the controller ends itself as it answers
        pass


def cluster_status(args) -> int:
    import json

    import ray

    handle = _running_controller(args)
    if handle is None:
        return 1
    status = ray.get(handle.status.remote())
    if args.json:
        print(json.dumps(status))
        return 0
    print(f"router: gRPC {status['grpc_address']}, HTTP {status['http_address']}, pid {status['router_pid']}")
    print(f"controller: pid {status['controller_pid']}" + (" (restarted; took the cluster over)" if status["adopted"] else ""))
    for role in ("prefill", "decode"):
        for w in status[role]:
            print(f"{w.get('role', role)}: {w['address']} pid {w['pid']}")  # an elastic worker's own role
    return 0


def cluster_stop(args) -> int:
    handle = _running_controller(args)
    if handle is None:
        return 1
    _stop_cluster(handle, args.drain_grace_seconds)
    return 0


def cluster_rollout(args) -> int:
    import ray

    if (args.pool is None) == (args.verify_kv is None):
        print("pdserve rollout: give --pool or --verify-kv, one of them", file=sys.stderr)
        return 2
    handle = _running_controller(args)
    if handle is None:
        return 1
    verify = None if args.verify_kv is None else args.verify_kv == "on"
    what = f"the {args.pool} pool" if verify is None else f"every worker to verify_kv_transfers {args.verify_kv}"
    print(f"pdserve: rolling {what}, one process at a time", flush=True)
    for r in ray.get(handle.rollout.remote(args.pool, args.drain_grace_seconds, verify)):
        busy = "" if r["idle"] else "; stopped at the end of its grace with requests running"
        print(f"{r['pool']}: {r['old']} -> {r['new']} (ready in {r['surge_s']:.1f} s, drained in {r['drain_s']:.1f} s{busy})",
              flush=True)
    return 0


def cluster_set_role(args) -> int:
    import ray

    handle = _running_controller(args)
    if handle is None:
        return 1
    r = ray.get(handle.set_role.remote(args.worker, args.role, args.drain_grace_seconds, args.reason))
    past = "" if r["idle"] else f"; past the grace {r['handed_over']} stream(s) migrated, {r['kv_moved']} with their KV"
    print(f"{r['address']}: {r['previous']} -> {r['role']} in {r['seconds']:.3f} s{past}", flush=True)
    return 0


def _running_controller(args):
    """The controller of ``--cluster-name`` on the Ray at ``--address``; None, said on stderr, if none runs."""
    from pdserve.cluster import controller

    controller.connect(args.address, args.cluster_name)
    handle = controller.find()
    if handle is None:
        print(f"pdserve: no cluster named {args.cluster_name!r} on {args.address}", file=sys.stderr)
    return handle


def _on_stop_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def generate(args) -> int:
    import grpc

    from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc

    req = pdserve_pb2.GenerateRequest(sampling=pdserve_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature))
    if args.raw:
        req.text = args.prompt
    else:
        req.chat.messages.add(role="user", content=args.prompt)
    key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    if args.tls_ca:
        channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        try:
            for resp in stub.Generate(req, metadata=metadata):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                if resp.finish_reason:
                    usage = resp.usage
                    print(f"\n[{pdserve_pb2.FinishReason.Name(resp.finish_reason)}; "
                          f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]")
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def version() -> str:
    """The installed pdserve's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def add_commands(sub, serve_settings: bool = True) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add ``serve``, ``generate``, ``status`` and ``stop`` to ``sub``; returns each command's entry.
    ``serve_settings=False``: ``serve`` without its settings' flags (what building them imports,
    torch among it, costs seconds that another command never needs)."""
    _serve_parser(sub, serve_settings)
    _generate_parser(sub)
    _cluster_parsers(sub)
    _rollout_parser(sub)
    _set_role_parser(sub)
    return {"serve": serve, "generate": generate, "status": cluster_status, "stop": cluster_stop,
            "rollout": cluster_rollout, "set-role": cluster_set_role}
