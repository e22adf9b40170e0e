"""Write a Hugging Face directory of the default model (SmolLM2-135M) that vLLM accepts.

The project already converts the default GGUF into a float32 HF directory
(``pdserve.engine.loader.materialize``); this copies it into a peer directory with bfloat16 weights and
patches config.json / tokenizer_config.json the way docs/peers.md says, so the older
transformers inside vLLM's venv reads it: ``architectures``, ``rope_theta: 100000.0``,
``torch_dtype``, ``tokenizer_class: PreTrainedTokenizerFast``, ``model_max_length: 8192`` and the
chat template inline in tokenizer_config.json. Idempotent: an existing complete copy is reused.

    cd /work/main && .venv/bin/python benchmarks/peers/hf_dir.py [--out DIR] [--force]

Default DIR: $PDSERVE_PEERS_DIR/smollm2-hf, $PDSERVE_PEERS_DIR = ~/.cache/pdserve-peers.
Prints the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PDSERVE_PEERS_DIR", Path.home() / ".cache" / "pdserve-peers"))
DTYPE = "bfloat16"


def build(out: Path, force: bool = False) -> Path:
    if (out / "complete").exists() and not force:
        return out
    sys.path.insert(0, str(REPO))
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.engine.loader import materialize

    src = materialize("default")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "complete"):
            shutil.copy2(f, tmp / f.name)

    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(getattr(torch, DTYPE)).contiguous() for k, v in tensors.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})

    cfg = json.loads((src / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama",
               rope_theta=float(rope.get("rope_theta", 100000.0)),
               rope_scaling=None, torch_dtype=DTYPE, dtype=DTYPE)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))

    tok = json.loads((tmp / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192)
    tok.pop("backend", None)
    template = tmp / "chat_template.jinja"
    if "chat_template" not in tok and template.exists():
        tok["chat_template"] = template.read_text()
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    (tmp / "complete").write_text(str(src))

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PEERS / "smollm2-hf")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    args = ap.parse_args()
    print(build(args.out.expanduser(), args.force))


if __name__ == "__main__":
    main()
