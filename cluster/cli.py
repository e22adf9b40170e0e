"""The ``pdserve`` command.

    pdserve serve [MODEL]            start a local cluster (router + workers as Ray actors)
    pdserve generate "PROMPT"        stream a completion from a running cluster
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the cluster with a model (default: SmolLM2-135M-Instruct)",
                       description="Start a router, prefill workers and decode workers as Ray actors.")
    p.add_argument("model", nargs="?", default="default", help="HF directory, .gguf file, or 'default'")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="router gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (default 8000; -1: off)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per worker in GiB (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    p.add_argument("--kv-transfer-backend", choices=["nixl", "tcp"], default="nixl",
                   help="how KV moves from prefill to decode (default nixl)")
    p.add_argument("--lease-seconds", type=float, default=30.0, help="how long held KV waits to be pulled")
    p.add_argument("--threads-per-worker", type=int, default=None, help="torch threads per worker")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")


def serve(args) -> int:
    from cluster.local import ClusterConfig, LocalCluster
    from engine.config import CacheConfig, EngineConfig

    engine = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          cache=CacheConfig(block_size=args.block_size,
                                            memory_budget_bytes=int(args.kv_cache_gib * (1 << 30))))
    config = ClusterConfig(engine=engine, num_prefill=args.prefill, num_decode=args.decode, host=args.host,
                           port=args.port, http_port=None if args.http_port < 0 else args.http_port,
                           kv_transfer_backend=args.kv_transfer_backend,
                           lease_seconds=args.lease_seconds, threads_per_worker=args.threads_per_worker,
                           ray_address=args.address)
    cluster = LocalCluster(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        address = cluster.start()
        http = f", OpenAI HTTP API on http://{cluster.http_address}/v1" if cluster.http_address else ""
        print(f"pdserve: gRPC API listening on {address}{http} "
              f"({args.prefill} prefill, {args.decode} decode worker(s)); Ctrl-C stops", flush=True)
        stop.wait()
    finally:
        print("pdserve: stopping", flush=True)
        cluster.stop()
    return 0


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
    args = parser.parse_args(argv)
    return {"serve": serve, "generate": generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
