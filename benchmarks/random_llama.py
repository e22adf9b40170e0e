"""A Llama of a deployed shape with random weights, for benchmarks that need a larger model than
the default one (nothing is downloaded).

    .venv/bin/python benchmarks/random_llama.py /tmp/llama-1b    # hidden 2048, 16 layers, 8192, 32/8 heads
    .venv/bin/python benchmarks/lora.py --model /tmp/llama-1b --prompt-len 32 --steps 8 --repeats 4

Writes config.json and model.safetensors (bfloat16, normal(0, 0.02), norms 1) and the default
model's tokenizer into DIR, which must not exist yet or be empty: transformers' save removes
weight shards it did not write, so a directory already holding a model would lose it.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    if args.directory.exists() and any(args.directory.iterdir()):
        raise SystemExit(f"directory {args.directory} is not empty: name a new one")
    from pdserve.engine.loader import materialize  # the default model: its tokenizer and vocabulary

    default = Path(materialize("default", progress=False))
    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=49152,
                      max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    model.model.rotary_emb.__init__(config=cfg)
    model.save_pretrained(args.directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (default / name).exists():
            shutil.copy(default / name, args.directory / name)
    print(args.directory)


if __name__ == "__main__":
    main()
