"""Shared builders for tests: a tiny random-weight Llama, engines, reference generations."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention: 2 q heads per kv head
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def make_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A random-weight transformers model. Weights are scaled up from the usual init so the
    next-token distribution is peaked: with near-uniform logits a 1e-6 rounding difference
    could flip a greedy choice and make equality tests flaky for the wrong reason."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {**TINY_LLAMA, "initializer_range": 0.15, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def save_hf_model(model, directory: Path) -> Path:
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def engine_config(model_dir: Path | str, dtype: str = "float32", num_blocks: int | None = 256,
                  block_size: int = 16, enable_prefix_cache: bool = True, device: str = "cpu",
                  attention_backend: str = "auto", cuda_graphs: bool = False, speculative=None,
                  **scheduler) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), dtype=dtype, device=device, attention_backend=attention_backend, cuda_graphs=cuda_graphs,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_cache=enable_prefix_cache),
        scheduler=SchedulerConfig(**scheduler) if scheduler else SchedulerConfig(), speculative=speculative,
    )


def prefill_worker_config(**fields):
    """A ``PrefillWorkerConfig`` with ``pdserve serve``'s lease unless ``fields`` name one: the
    config has no default of its own (``pdserve.cluster.settings.LEASE_SECONDS`` is the one)."""
    from pdserve.cluster.settings import LEASE_SECONDS
    from pdserve.prefill_worker.config import PrefillWorkerConfig

    return PrefillWorkerConfig(**{"lease_seconds": LEASE_SECONDS.default, **fields})


def decode_worker_config(**fields):
    """A ``DecodeWorkerConfig`` with ``pdserve serve``'s transfer timeout and lease unless ``fields``
    name them: the config has no defaults of its own (``pdserve.cluster.settings``)."""
    from pdserve.cluster.settings import LEASE_SECONDS, TRANSFER_TIMEOUT_SECONDS
    from pdserve.decode_worker.worker import DecodeWorkerConfig

    return DecodeWorkerConfig(**{"transfer_timeout_s": TRANSFER_TIMEOUT_SECONDS.default,
                                 "lease_seconds": LEASE_SECONDS.default, **fields})


def make_engine(model_dir: Path | str, tokenizer=None, **kwargs) -> LLMEngine:
    config = engine_config(model_dir, **kwargs)
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, tokenizer, model_dir=str(model_dir))


def make_tp_engine(model_dir: Path | str, tensor_parallel_size: int, on_rank_lost=None, lora=None,
                   **kwargs) -> LLMEngine:
    """An engine on ``tensor_parallel_size`` ranks (rank 0 here, the others its child processes).
    ``on_rank_lost``: what a lost rank does (default: record nothing and raise in the step; a
    worker's default, ending the process, would end the test run); ``lora``: its ``LoRAConfig``.
    Close it when done."""
    from pdserve.shell.rank_follower import RANK_ENTRY

    config = dataclasses.replace(engine_config(model_dir, **kwargs), tensor_parallel_size=tensor_parallel_size,
                                 lora=lora)
    return LLMEngine.from_config(config, progress=False, detokenize=False,
                                 on_rank_lost=on_rank_lost or (lambda exc: None), follower_entry=RANK_ENTRY)


@functools.cache
def default_reference():
    """transformers' model of the default model in float32 and its tokenizer, loaded once per
    test process: a dozen modules compare served tokens with it, and each used to load its own
    copy (seconds each). Read only: generate and forward passes change nothing in it."""
    from transformers import AutoTokenizer

    from pdserve.engine.loader import materialize

    directory = materialize("default")
    return load_reference(directory, torch.float32), AutoTokenizer.from_pretrained(str(directory))


def load_reference(directory, dtype: torch.dtype):
    """transformers' model of a local directory, as the correctness oracle.

    Its parameters are copied into fresh (64-byte aligned) memory: transformers leaves some
    weights at the 8-byte-aligned offsets they have in the safetensors file, and MKL's
    single-row float32 kernel rounds differently for such pointers (a 5e-7 difference that
    can flip a near-tied greedy choice). Same weights, same math; only the alignment changes.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()
    for p in model.parameters():
        p.data = p.data.clone()
    return model


# transformers' greedy answers already computed in this test process: the same questions go to
# the same shared model (``default_reference``) in a dozen modules, and a 24-token ``generate``
# of the default model costs seconds on a busy core. Keyed by the model object and every
# parameter's storage and in-place version counter, so a model changed since is asked again;
# held weakly, so a model's answers go with it (a new model could reuse its addresses).
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _known_greedy(hf_model, prompt: list[int], max_new_tokens: int, eos_token_id) -> tuple[dict, tuple, list | None]:
    """``hf_greedy``'s memo of ``hf_model``, its key for this question, and the answer if known."""
    params = tuple((p.data_ptr(), p._version) for p in hf_model.parameters())
    eos = tuple(eos_token_id) if isinstance(eos_token_id, list) else eos_token_id
    known = _GREEDY.setdefault(hf_model, {})
    key = (params, tuple(prompt), eos)
    limit, tokens = known.get(key, (0, []))
    if limit >= max_new_tokens or len(tokens) < limit:  # long enough, or it ended before its limit
        return known, key, tokens[:max_new_tokens]
    return known, key, None


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """transformers' own greedy generate: the correctness oracle. A shorter answer to the same
    prompt is the beginning of a longer one (greedy decoding does the same steps in the same
    order, whatever the limit), so it is cut from one computed before."""
    known, key, tokens = _known_greedy(hf_model, prompt, max_new_tokens, eos_token_id)
    if tokens is not None:
        return tokens
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_token_id, pad_token_id=0,
        )
    tokens = out[0, len(prompt):].tolist()
    known[key] = (max_new_tokens, tokens)
    return list(tokens)  # the caller's own copy


# Two logits closer than this are a tie in float32: two correct implementations that sum in
# different orders land on either side of it (the default model has such a pair 1.1e-5 apart,
# and transformers itself orders them one way with its KV cache and the other without).
NEAR_TIE = 1e-4


def assert_greedy_matches(hf_model, prompt: list[int], ours: list[int], max_new_tokens: int,
                          eos_token_id=None, what: str = "") -> None:
    """The float32 correctness oracle: ``ours`` equals transformers' greedy ``generate``
    token for token, except where transformers' own top two logits are a near tie
    (``NEAR_TIE``). There ours may take either token, and from there on each of our tokens
    must be transformers' argmax given the prompt and our tokens before it (or tie with it).
    A token that is not an argmax or a near tie fails, naming where.

    Answers already generated or verified are compared first; otherwise one forward pass over
    the prompt and ``ours`` is tried before ``generate`` (``is_forward_greedy``): a few times
    cheaper than ``generate``'s step per token, and it accepts only transformers' exact argmax
    at every step."""
    memo, key, known = _known_greedy(hf_model, prompt, max_new_tokens, eos_token_id)
    seen = ("forward greedy", key, max_new_tokens, tuple(ours))  # served answers repeat across modules
    if known == ours or seen in memo:
        return
    if known is None and is_forward_greedy(hf_model, prompt, ours, max_new_tokens, eos_token_id):
        memo[seen] = True
        return
    expected = hf_greedy(hf_model, prompt, max_new_tokens, eos_token_id)
    if ours == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
    assert first < len(ours) and first < len(expected), (
        f"{what}: one output stops early where the other goes on: ours {ours}, transformers {expected}")
    with torch.no_grad():  # every position's logits given our own tokens (teacher forcing)
        logits = hf_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ours)]
    for i, token in enumerate(ours):
        best = int(logits[i].argmax())
        gap = float(logits[i, best] - logits[i, token])
        assert gap <= NEAR_TIE, (f"{what}: token {i} is {token} but transformers' argmax there is {best}, "
                                 f"{gap:.3g} above it (more than a near tie, {NEAR_TIE}); "
                                 f"ours {ours}, transformers {expected}")
    if eos_token_id is not None and ours[-1] != eos_token_id:
        assert len(ours) == max_new_tokens, f"{what}: ours stopped after {len(ours)} tokens without EOS: {ours}"


# generation_config fields under which greedy ``generate`` is not the plain argmax of the logits
_LOGITS_PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                      "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                      "sequence_bias", "encoder_repetition_penalty")


def is_forward_greedy(hf_model, prompt: list[int], ours: list[int], max_new_tokens: int, eos_token_id=None) -> bool:
    """Whether ``ours`` is transformers' greedy answer, read off one forward pass over the prompt
    and ``ours`` (teacher forcing): every token the argmax of the logits given everything before
    it, no end of sequence before the last token, and the answer as long as ``max_new_tokens``
    unless it ends at one (``eos_token_id``; None: none, as ``generate`` given None goes on past
    the model's own). That is what greedy ``generate`` computes step by step. False also where a
    generation_config setting (``_LOGITS_PROCESSORS``) would make ``generate`` more than an argmax."""
    from transformers import GenerationConfig

    config, plain = hf_model.generation_config, GenerationConfig()
    if not ours or len(ours) > max_new_tokens or any(
            getattr(config, name, None) != getattr(plain, name, None) for name in _LOGITS_PROCESSORS):
        return False
    eos = set(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else {eos_token_id} - {None}
    if eos & set(ours[:-1]) or (len(ours) < max_new_tokens and ours[-1] not in eos):
        return False
    with torch.no_grad():  # (len(ours), V): each row predicts the token at its position
        logits = hf_model(torch.tensor([list(prompt) + list(ours)])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ours)]
    return logits.argmax(-1).tolist() == list(ours)


CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
                  "Explain gravity to a child in two sentences.", "Hi"]


def chat_variants(n: int = 16) -> list[str]:
    """``n`` distinct chat questions, CHAT_QUESTIONS numbered "(variant i)". With the default
    model's chat template, "Hi (variant 14)" meets a float32 near tie at its second token."""
    return [f"{q} (variant {i})" for i, q in enumerate(CHAT_QUESTIONS * (n // len(CHAT_QUESTIONS) + 1))][:n]


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def computed_blocks(bm, seq_id: str, tokens: list[int], **allocate_kwargs):
    """Allocate ``tokens`` in block manager ``bm`` and mark all of them final, as a finished
    prefill step does (a block is findable only then)."""
    alloc = bm.allocate(seq_id, tokens, **allocate_kwargs)
    bm.mark_final(seq_id, tokens, len(tokens))
    return alloc


def replace(config, **changes):
    return dataclasses.replace(config, **changes)


class FailingSampler:
    """Wraps an engine's sampler and raises for the named requests, as a sampler fed
    overflowing logits once did (``torch.multinomial`` refusing inf/NaN probabilities).

    A stand-in, used because the real trigger is gone: request validation now treats a
    temperature below ``TEMPERATURE_EPSILON`` as greedy and floors the repetition penalty, so no
    valid request can overflow the logits any more. What the tests check, that a step which
    raises aborts exactly its own sequences and leaves the engine serving, does not depend on
    why the step raised.
    """

    def __init__(self, inner, fail_for: set[str], times: int | None = None):
        self.inner, self.fail_for, self.times = inner, set(fail_for), times

    def __call__(self, logits, rows):
        bad = [r.seq_id for r in rows if r.seq_id in self.fail_for]
        if bad and (self.times is None or self.times > 0):
            if self.times is not None:
                self.times -= 1
            raise RuntimeError(f"injected sampler failure for {bad}")
        return self.inner(logits, rows)

    def forget(self, seq_id: str) -> None:
        self.inner.forget(seq_id)


def fail_sampling_for(engine, *request_ids: str, times: int | None = None) -> None:
    """Make ``engine``'s sampler raise (the whole call: nothing says which row) whenever a
    step samples one of ``request_ids``; with ``times``, only that many times."""
    engine.runner.sampler = FailingSampler(engine.runner.sampler, set(request_ids), times)


def fail_forward_for(engine, request_id: str, when=lambda seq: True) -> list[list[str]]:
    """An injected fault outside the sampler: ``engine``'s forward raises after the decoder
    stack (every layer has written the step's KV) whenever the batch it runs, a whole step or a
    part of one the engine runs again, holds ``request_id`` and ``when(its sequence)`` is true.
    Returns the list every run's request ids are appended to, in order."""
    runner = engine.runner
    runs: list[list[str]] = []
    current: list = []  # the sequences of the run under way
    run = runner.run

    def run_and_note(out):
        runs.append([item.seq.seq_id for item in out.seqs])
        current[:] = [item.seq for item in out.seqs]
        return run(out)

    def raise_for_it(module, args):
        if any(seq.seq_id == request_id and when(seq) for seq in current):
            raise RuntimeError(f"injected forward fault for {request_id}")

    runner.run = run_and_note
    runner.model.norm.register_forward_pre_hook(raise_for_it)
    return runs


class NaNLogitsSampler:
    """Wraps an engine's sampler and sets the named requests' logits rows to NaN before the
    real sampler sees them, as a forward that overflowed for one sequence would."""

    def __init__(self, inner, nan_for: set[str]):
        self.inner, self.nan_for = inner, set(nan_for)

    def __call__(self, logits, rows):
        for i, r in enumerate(rows):
            if r.seq_id in self.nan_for:
                logits[i] = float("nan")
        return self.inner(logits, rows)

    def forget(self, seq_id: str) -> None:
        self.inner.forget(seq_id)


def nan_logits_for(engine, *request_ids: str) -> None:
    """Make the logits of ``request_ids`` NaN whenever a step samples them."""
    engine.runner.sampler = NaNLogitsSampler(engine.runner.sampler, set(request_ids))


# A Hermes-style chat template with tools (the format Qwen2.5 and Hermes 2/3 use: the tools as
# JSON inside <tools>, calls answered as <tool_call>{json}</tool_call>), written for the tests.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. Their signatures, within <tools></tools>:\n"
    "<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n</tools>\n"
    "Answer a call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def save_tool_llama(directory: Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama with the default model's tokenizer (49,152 tokens, as the
    grammar tests need a real byte-level vocabulary) and ``TOOLS_CHAT_TEMPLATE``."""
    import json
    import shutil

    from pdserve.engine.loader import materialize

    source = materialize("default", progress=False)
    save_hf_model(make_hf_model("llama", seed=seed, vocab_size=49152), directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    return directory
