"""What the GPU check runs on, built on the spot: a random-weight model of SmolLM2-135M's
shape and a byte-level tokenizer. No weights ship and nothing is downloaded, so the check
runs on a bare CUDA host (scripts/gpu_check.sh).

``PDSERVE_CHECK_DEVICE`` (default ``cuda``) names the device; ``cpu`` runs the same checks
here, which proves the checks themselves, not CUDA. ``PDSERVE_CHECK_LAYERS`` (default 30,
SmolLM2's) shortens the model for such a run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# SmolLM2-135M-Instruct's config.json, less its weights.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
# Larger than the usual 0.02 init, so next-token distributions are peaked: over 49,152 tokens
# near-uniform logits would make every greedy comparison a coin toss between near ties.
INIT_STD = 0.1
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (BOS), 2 (EOS), as SmolLM2's


def check_device() -> torch.device:
    return torch.device(os.environ.get("PDSERVE_CHECK_DEVICE", "cuda"))


def device_or_skip() -> torch.device:
    device = check_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (scripts/gpu_check.sh)")
    return device


# What a holder process (tests/gpu/test_nixl_vram.py, test_kv_by_head_on_device.py) imports: the
# seconds of a fresh interpreter's start.
HOLDER_IMPORTS = ["torch", "pdserve.kv_transfer", "pdserve.kv_transfer.metadata", "pdserve.kv_transfer.sharding",
                  "pdserve.kv_transfer.source", "pdserve.protos.kv_transfer_pb2"]


def holder_context():
    """How the check starts a holder process. On CUDA ``spawn``: a fresh interpreter (fork
    would share CUDA and UCX state with the child). On the CPU dry run a ``forkserver`` with
    HOLDER_IMPORTS loaded: each holder is a fork of a server that imported them and never
    touched a device or UCX, up in milliseconds instead of a fresh interpreter's seconds."""
    import multiprocessing as mp

    if check_device().type == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(HOLDER_IMPORTS)
    return ctx


def byte_tokenizer(vocab_size: int = 0):
    """A byte-level BPE with no merges: the 3 special tokens and the 256 byte symbols. Any
    text encodes (a token a byte), and xgrammar gets the byte-level vocabulary it needs; ids
    from 259 up to the model's 49,152 are unused, as padded vocabularies are. With
    ``vocab_size``, every id below it gets a piece, ``<ID>``, so that whatever id a random
    model samples decodes to text (the GPU bench's load generator times each chunk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<{i}>"] = i  # ASCII: the byte-level alphabet maps each character to itself
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0])


def save_smol(directory: Path, seed: int = 0) -> Path:
    """The random model (float32 safetensors) and its tokenizer in ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = int(os.environ.get("PDSERVE_CHECK_LAYERS", SMOLLM2_135M["num_hidden_layers"]))
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", **{**SMOLLM2_135M, "num_hidden_layers": layers},
                                  initializer_range=INIT_STD)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def reference(directory: Path, dtype: torch.dtype, device: torch.device):
    """transformers' model of ``directory`` on ``device``: the correctness oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()


@torch.no_grad()
def teacher_forced_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) float32 log-probabilities transformers gives each of ``tokens``'
    positions, given the prompt and the tokens before it."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = hf_model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
    return torch.log_softmax(logits, dim=-1).cpu()


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
