"""KV bytes a request moves per prompt token: MLA's latent (DeepSeek) against GQA's per-head K/V.

    .venv/bin/python benchmarks/kv_bytes.py                 # bfloat16, NIXL, a 1,000-token prompt
    .venv/bin/python benchmarks/kv_bytes.py --backend tcp --prompt-tokens 200

For each model, a 2-layer random-weight stand-in with the real model's per-layer cache row
(DeepSeek: kv_lora_rank 512 + qk_rope_head_dim 64, one row per token; GQA: K and V of 8 KV
heads of 128) is served by a real prefill worker and a real decode worker in this process;
one greedy request's prompt is pulled over the chosen backend, and the decode worker's
``kv_transfer_bytes`` divided by the prompt's tokens is the measured bytes per prompt token of
2 layers. Bytes grow linearly with layers, so x (layers / 2) is the whole model's; the table
shows it next to what the engine's cache layout says for the real config
(``kv_cache.cache_spec_of``), which must agree. Nothing here is timed: the numbers are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.cluster.settings import LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS  # noqa: E402
from pdserve.decode_worker.server import start as start_decode  # noqa: E402
from pdserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig  # noqa: E402
from pdserve.engine.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.engine.models.registry import model_config_from_hf  # noqa: E402
from pdserve.engine.attention.kv_cache import cache_spec_of  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.prefill_worker.server import start as start_prefill  # noqa: E402
from pdserve.prefill_worker.config import PrefillWorkerConfig  # noqa: E402
from pdserve.prefill_worker.worker import PrefillWorker  # noqa: E402
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from pdserve.wire.grpc_util import aio_channel  # noqa: E402

# The fields of each public config.json that size the KV cache (and name the family).
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, n_shared_experts=1)
GQA = dict(num_key_value_heads=8, head_dim=128)
MODELS = {  # name: (model_type, real layers, real attention fields, total / active parameters)
    "DeepSeek-V2-Lite": ("deepseek_v2", 27, dict(MLA, num_attention_heads=16, q_lora_rank=None), "15.7B / 2.4B"),
    "Qwen2.5-14B": ("qwen2", 48, dict(GQA, num_attention_heads=40), "14.7B"),
    "Llama-3.1-8B": ("llama", 32, dict(GQA, num_attention_heads=32), "8.0B"),
    "DeepSeek-V3": ("deepseek_v3", 61, dict(MLA, num_attention_heads=128, q_lora_rank=1536, n_group=1,
                                            topk_group=1), "671B / 37B"),
    "Qwen3-8B": ("qwen3", 36, dict(GQA, num_attention_heads=32), "8.2B"),
    "Qwen3-30B-A3B": ("qwen3_moe", 48, dict(GQA, num_attention_heads=32, num_key_value_heads=4, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=64), "30.5B / 3.3B"),
    "Llama-3.3-70B": ("llama", 80, dict(GQA, num_attention_heads=64), "70.6B"),
    "Llama-3.1-405B": ("llama", 126, dict(GQA, num_attention_heads=128), "405B"),
}
STAND_IN = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                max_position_embeddings=4096, tie_word_embeddings=False)


def stand_in(model_type: str, fields: dict, directory: Path) -> Path:
    """A 2-layer random model with ``fields``' per-layer cache row, saved as a HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = min(fields["num_attention_heads"], 8)  # the query heads do not enter the cache
    config = AutoConfig.for_model(model_type, **{**STAND_IN, **fields, "num_attention_heads": heads,
                                                 **({"num_key_value_heads": heads} if "kv_lora_rank" in fields
                                                    else {})})
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def spec_bytes(model_type: str, layers: int, fields: dict, dtype: torch.dtype) -> int:
    """Bytes per token of the real config's cache, from the engine's own layout."""
    raw = {**STAND_IN, "hidden_size": 7168, **fields, "model_type": model_type, "num_hidden_layers": layers}
    return cache_spec_of(model_config_from_hf(raw, "config"), 16, dtype).bytes_per_token


async def moved_bytes(directory: Path, backend: str, prompt_tokens: int, dtype: str) -> int:
    """Bytes the decode worker pulled for one request of ``prompt_tokens`` tokens."""
    def engine() -> LLMEngine:
        config = EngineConfig(model=str(directory), dtype=dtype, device="cpu", cache=CacheConfig(num_blocks=256))
        return LLMEngine.from_config(config, progress=False, detokenize=False)

    prefill = PrefillWorker(PrefillWorkerConfig(kv_transfer_backend=backend, lease_seconds=LEASE_SECONDS.default),
                            engine=engine())
    decode = DecodeWorker(DecodeWorkerConfig(kv_transfer_backend=backend, lease_seconds=LEASE_SECONDS.default,
                                             transfer_timeout_s=TRANSFER_TIMEOUT_SECONDS.default), engine=engine())
    servers = [await start_prefill(prefill.config, prefill), await start_decode(decode.config, decode)]
    channels = [aio_channel(s.address) for s in servers]
    try:
        p_stub, d_stub = worker_pb2_grpc.PrefillWorkerStub(channels[0]), worker_pb2_grpc.DecodeWorkerStub(channels[1])
        sampling = pdserve_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prompt = [(7 * i) % 500 + 3 for i in range(prompt_tokens)]
        pre = await p_stub.Prefill(worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=prompt,
                                                             sampling=sampling), timeout=120)
        async for _ in d_stub.Decode(worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt,
                                                              first_token_id=pre.first_token_id, sampling=sampling,
                                                              kv=pre.kv), timeout=120):
            pass
        return (await d_stub.Stats(worker_pb2.StatsRequest(), timeout=5)).kv_transfer_bytes
    finally:
        for c in channels:
            await c.close()
        for s in servers:
            await s.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="nixl", choices=("nixl", "tcp"))
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"KV bytes per prompt token, {args.dtype}, {args.backend}, a {args.prompt_tokens}-token prompt")
    print(f"{'model':<17}{'params':>14}{'layers':>8}{'cache row / layer':>26}{'measured':>12}{'layout':>12}")
    for name in args.models.split(","):
        model_type, layers, fields, params = MODELS[name]
        with tempfile.TemporaryDirectory() as tmp:
            pulled = asyncio.run(moved_bytes(stand_in(model_type, fields, Path(tmp)), args.backend,
                                             args.prompt_tokens, args.dtype))
        measured = pulled / args.prompt_tokens * layers / 2
        row = (f"latent {fields['kv_lora_rank']} + rope {fields['qk_rope_head_dim']}" if "kv_lora_rank" in fields
               else f"K,V x {fields['num_key_value_heads']} x {fields['head_dim']}")
        layout = spec_bytes(model_type, layers, fields, dtype)
        print(f"{name:<17}{params:>14}{layers:>8}{row:>26}{measured:>12,.0f}{layout:>12,}")


if __name__ == "__main__":
    main()
