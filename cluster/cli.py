"""The ``pdserve`` command.

    pdserve serve [MODEL]            start a local cluster (router + workers as Ray actors)
    pdserve generate "PROMPT"        stream a completion from a running cluster
    pdserve plan                     size prefill and decode pools (simulated; planner/)
    pdserve profile                  fit the CPU cost profile to this machine's engine
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

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


def serve(args) -> int:
    from cluster.local import ClusterConfig, LocalCluster, default_gpus
    from engine.config import CacheConfig, EngineConfig

    from cluster.autoscaling import AutoscaleConfigError, from_mapping

    try:
        v = resolve(args)
        autoscaling = from_mapping(v["autoscaling"]) if v["autoscaling"] is not None else None
    except (SettingsError, AutoscaleConfigError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    engine = EngineConfig(model=v["model"], dtype=v["dtype"], max_model_len=v["max_model_len"],
                          cache=CacheConfig(block_size=v["block_size"],
                                            memory_budget_bytes=int(v["kv_cache_gib"] * (1 << 30))))
    config = ClusterConfig(engine=engine, num_prefill=v["prefill"], num_decode=v["decode"], host=v["host"],
                           port=v["port"], http_port=None if v["http_port"] < 0 else v["http_port"],
                           kv_transfer_backend=v["kv_transfer_backend"], lease_seconds=v["lease_seconds"],
                           admission_wait_s=v["admission_wait_seconds"],
                           threads_per_worker=v["threads_per_worker"], ray_address=v["address"],
                           prefill_placement=_placement(v, "prefill", default_gpus),
                           decode_placement=_placement(v, "decode", default_gpus), autoscaling=autoscaling)
    cluster = LocalCluster(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        address = cluster.start()
        http = f", OpenAI HTTP API on http://{cluster.http_address}/v1" if cluster.http_address else ""
        print(f"pdserve: gRPC API listening on {address}{http} "
              f"({v['prefill']} prefill, {v['decode']} decode worker(s)); Ctrl-C stops", flush=True)
        stop.wait()
    finally:
        print("pdserve: stopping", flush=True)
        cluster.stop()
    return 0


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
    with grpc.insecure_channel(args.address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        try:
            for resp in stub.Generate(req):
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
    args = parser.parse_args(argv)
    return {"serve": serve, "generate": generate, "plan": run_plan, "profile": run_profile}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
