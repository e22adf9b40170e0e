"""The ``pdserve`` command.

    pdserve serve [MODEL]            start a local cluster (router + workers as Ray actors)
    pdserve generate "PROMPT"        stream a completion from a running cluster
    pdserve worker --role ROLE       one role as a plain process, without Ray (cluster/worker_cli.py)
    pdserve plan                     size prefill and decode pools (simulated; planner/)
    pdserve profile                  fit the CPU cost profile to this machine's engine
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from cluster.settings import SettingsError, add_arguments, resolve


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the cluster with a model (default: SmolLM2-135M-Instruct)",
                       description="Start a router, prefill workers and decode workers as Ray actors. "
                                   "Settings come from flags, PDSERVE_* variables and --config FILE.yaml, "
                                   "in that order of precedence.")
    add_arguments(p)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--api-key", default=None, help="the server's API key (default: env PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="verify a TLS public API against this CA (PEM)")


def serve(args) -> int:
    from cluster.local import ClusterConfig, LocalCluster, default_gpus
    from engine.config import CacheConfig, EngineConfig

    from cluster.autoscaling import AutoscaleConfigError, from_mapping

    from router.auth import ApiKeyError, read_key
    from wire import tls

    try:
        v = resolve(args)
        autoscaling = from_mapping(v["autoscaling"]) if v["autoscaling"] is not None else None
        security = dict(api_key=read_key(v["api_key"], v["api_key_file"]),
                        tls=tls.load(v["tls_cert"], v["tls_key"], v["tls_ca"], prefix="tls"),
                        public_tls=tls.load(v["public_tls_cert"], v["public_tls_key"], v["public_tls_ca"],
                                            prefix="public_tls", require_ca=False))
    except (SettingsError, AutoscaleConfigError, ApiKeyError, tls.TlsConfigError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    engine = EngineConfig(model=v["model"], dtype=v["dtype"], max_model_len=v["max_model_len"],
                          cache=CacheConfig(block_size=v["block_size"],
                                            memory_budget_bytes=int(v["kv_cache_gib"] * (1 << 30))))
    config = ClusterConfig(engine=engine, router_limits=_router_limits(v), num_prefill=v["prefill"], num_decode=v["decode"], host=v["host"],
                           port=v["port"], http_port=None if v["http_port"] < 0 else v["http_port"],
                           advertise_host=v["advertise_host"], internal_host=v["internal_host"],
                           internal_advertise_host=v["internal_advertise_host"], **security,
                           kv_transfer_backend=v["kv_transfer_backend"], lease_seconds=v["lease_seconds"],
                           admission_wait_s=v["admission_wait_seconds"], hang_timeout_s=v["hang_timeout_seconds"],
                           threads_per_worker=v["threads_per_worker"], ray_address=v["address"],
                           prefill_placement=_placement(v, "prefill", default_gpus),
                           decode_placement=_placement(v, "decode", default_gpus), autoscaling=autoscaling)
    cluster = LocalCluster(config)
    stop = threading.Event()
    _on_stop_signals(stop)
    try:
        address = cluster.start()
        _on_stop_signals(stop)  # ray.init (in start) installed its own SIGTERM handler: ours again
        http = f", OpenAI HTTP API on http://{cluster.http_address}/v1" if cluster.http_address else ""
        print(f"pdserve: gRPC API listening on {address}{http} "
              f"({v['prefill']} prefill, {v['decode']} decode worker(s)); Ctrl-C stops", flush=True)
        stop.wait()
        print(f"pdserve: draining (up to {v['drain_grace_seconds']:g} s)", flush=True)
        left = cluster.drain(v["drain_grace_seconds"])
        if left:
            print(f"pdserve: {left} request(s) still running after the grace period; stopping anyway", flush=True)
    finally:
        print("pdserve: stopping", flush=True)
        cluster.stop()
    return 0


def _on_stop_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _router_limits(v: dict):
    from router.orchestrator import RouterLimits
    from router.validation import RequestLimits

    return RouterLimits(admission_wait_s=v["admission_wait_seconds"], request_timeout_s=v["request_timeout_seconds"],
                        max_waiting_requests=v["max_waiting_requests"],
                        decode_idle_timeout_s=v["decode_idle_timeout_seconds"],
                        requests=RequestLimits(max_body_bytes=v["max_body_bytes"],
                                               max_prompt_chars=v["max_prompt_chars"]))


def _placement(v: dict, pool: str, default_gpus):
    from cluster.placement import PoolPlacement

    gpus = v["gpus_per_worker"] if v["gpus_per_worker"] is not None else default_gpus()
    return PoolPlacement(cpus=v["cpus_per_worker"], gpus=gpus, resource=v[f"{pool}_resource"])


def generate(args) -> int:
    import grpc

    from protos import pdserve_pb2, pdserve_pb2_grpc

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    from planner.cli import add_plan_parser, add_profile_parser, run_plan, run_profile

    add_plan_parser(sub)
    add_profile_parser(sub)
    from cluster import worker_cli

    worker_cli.add_worker_parser(sub)
    args = parser.parse_args(argv)
    return {"serve": serve, "generate": generate, "plan": run_plan, "profile": run_profile,
            "worker": worker_cli.run_worker}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
