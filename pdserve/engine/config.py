"""Configuration dataclasses of the engine: one frozen dataclass per concern.

Built once at process entry and passed down; derived values (block counts, cache bytes)
are returned by functions, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from pdserve.engine.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")

Get = Callable[..., Any]  # get(key, default=None): one field of a config.json


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K and V of every head are up-projected from one compressed
    latent per token (``kv_lora_rank`` values, normed) plus one decoupled RoPE key shared by all
    heads (``qk_rope_head_dim``); the cache holds those two alone (kv_cache.py)."""

    q_lora_rank: int | None  # None: a plain q_proj; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared
    rope_layout: str  # "interleaved", "complex" (the same pairs, kept in place), "halves"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token stores per layer: the latent and its RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class ExpertsConfig(Protocol):
    """What a family's routed-expert settings tell readers outside the family (the planner);
    each family keeps its own dataclass with whatever else its routing needs."""

    num_experts: int  # routed experts in an MoE layer
    top_k: int  # of them, per token
    intermediate_size: int  # one routed expert's width
    shared_intermediate_size: int  # the always-on experts' summed width; 0: none

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts (else a dense MLP)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of one of the supported families (pdserve/engine/models/),
    independent of where weights came from. Each family reads its own config.json into one."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on the q/k/v projections (Qwen2); Llama and Mistral have none
    rope_scaling: Mapping[str, Any] | None = None  # "llama3" or "yarn", with rope_theta
    # The softmax scale of K/V attention (q.k times this); None: head_dim ** -0.5. A family whose
    # checkpoints say otherwise sets it (Granite's attention_multiplier); MLA has its own (mla).
    attention_scale: float | None = None
    sliding_window: int | None = None  # caps max_model_len; attention is over all of it (Mistral, Phi-3)
    # Per layer, the keys its attention sees where it slides (a query at position p: p - w + 1
    # .. p), None where it sees every key up to p; () when no layer slides. The attention
    # backends run these windows (attention.py), so unlike ``sliding_window`` they cap nothing:
    # the cache keeps every token. A family whose layers slide sets it (Gemma 3).
    layer_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None  # latent attention, and its latent cache
    moe: ExpertsConfig | None = None  # the family's own routed-expert settings; None: every MLP is dense
    quantization: str | None = None  # "fp8": float8 weights, dequantized as they load (checkpoint.with_scales)
    weight_block_size: tuple[int, int] | None = None  # FP8 scales per block of (rows, columns); None: per tensor or row

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (``layer_windows``), None for all keys."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def max_model_len(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def config_getter(hf: Any) -> Get:
    """``get(key, default)`` over a config dict or a ``transformers`` config object."""
    if isinstance(hf, Mapping):
        return lambda k, d=None: hf.get(k, d)
    return lambda k, d=None: getattr(hf, k, d)


def dense_fields(get: Get, source: str, rope_types: tuple[str, ...] = ("default", "llama3")) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a Llama-like config (a family adds or overrides its own):
    GQA heads, RoPE with ``rope_types`` scaling, no sliding window, biases where the config
    says ``attention_bias``; a quantized checkpoint's method is checked here (``quantization_fields``)
    for every family that reads its config through this."""
    quantization = quantization_fields(get, source)
    num_heads, hidden = get("num_attention_heads"), get("hidden_size")
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in rope_types:
        raise ModelLoadError(source, f"unsupported rope scaling {rope_type!r}; supported: {', '.join(rope_types)}")
    return dict(common_fields(get), num_heads=num_heads, num_kv_heads=get("num_key_value_heads") or num_heads,
                head_dim=get("head_dim") or hidden // num_heads,
                rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
                qkv_bias=bool(get("attention_bias", False)), rope_scaling=rope if rope_type != "default" else None,
                **quantization)


# The quantized checkpoints pdserve serves: FP8 weights (e4m3) with a scale per tensor, per
# output row, or per block (weight_block_size), dequantized to the serving dtype as they load.
QUANTIZATIONS = ("fp8",)


def quantization_fields(get: Get, source: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a checkpoint's ``quantization_config``: none for an
    unquantized one. Any method but FP8's is a ``ModelLoadError`` naming it: weights copied as
    they are would serve wrong tokens."""
    quantized = get("quantization_config")
    if not quantized:
        return {}
    method = quantized.get("quant_method", "?") if isinstance(quantized, Mapping) else "?"
    if method not in QUANTIZATIONS:
        raise ModelLoadError(source, f"quantization_config ({method}) is not supported: pdserve loads bfloat16, "
                                     f"float16 or float32 weights, or {', '.join(QUANTIZATIONS)}; dequantize the "
                                     "checkpoint first")
    block = quantized.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ModelLoadError(source, f"quantization_config.weight_block_size {block!r}: expected [rows, columns]")
    return dict(quantization=method, weight_block_size=tuple(block) if block else None)


def eos_token_ids(eos: Any) -> tuple[int, ...]:
    """A config's ``eos_token_id``: one id, a list of them, or none."""
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def common_fields(get: Get) -> dict[str, Any]:
    """The fields every family reads the same way."""
    return dict(model_type=get("model_type"), vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
                intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                max_position_embeddings=get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)), bos_token_id=get("bos_token_id"),
                eos_token_ids=eos_token_ids(get("eos_token_id")))


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and on CPU.

    On an x86-64 CPU, bfloat16 runs pdserve's own linear and RMSNorm kernels
    (pdserve/engine/kernels/csrc/linear.cpp, chosen by pdserve/engine/linear.py): every output element is one
    float32 FMA chain in a fixed order, so a sequence's tokens do not depend on how many
    others share its batch, on the thread count or on the machine, and the weights stream
    at half float32's bytes. Its numerics differ from ``transformers``' bfloat16 (oneDNN,
    which is not batch-invariant); ``dtype="float32"`` runs the same kernels on float32
    weights and equals ``transformers`` in float32 token for token (near ties aside).
    """
    return torch.bfloat16


DEFAULT_KV_CACHE_BYTES = 1 << 30  # a worker's KV cache when no setting sizes it (1 GiB)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The block count is derived from an exact budget
    (``memory_budget_bytes``), or from what the device leaves this worker after its weights and
    a profiled forward (``gpu_memory_utilization``, pdserve/engine/memory.py); an exact budget
    wins over the share. With neither, ``DEFAULT_KV_CACHE_BYTES``."""

    block_size: int = 16  # tokens per block; 16 keeps waste under one block per sequence
    memory_budget_bytes: int | None = None  # KV cache bytes per worker, exactly
    # vLLM's meaning: the share of the device's total memory (host RAM on a CPU) this worker may
    # take for weights, activations and KV together; the KV gets what the rest leaves of it.
    gpu_memory_utilization: float | None = None
    num_blocks: int | None = None  # set to override the budget (tests use tiny caches)
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ValueError(f"memory_budget_bytes must be at least 1, got {self.memory_budget_bytes}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share!r}")

    def exact_budget_bytes(self) -> int | None:
        """The KV bytes a worker takes whatever its device holds; None where the size follows
        ``gpu_memory_utilization`` (measured at start)."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        return None if self.gpu_memory_utilization is not None else DEFAULT_KV_CACHE_BYTES


PREFILL_FIRST, MIXED = "prefill_first", "mixed"
SCHEDULING_POLICIES = (PREFILL_FIRST, MIXED)


# A disaggregated cluster's decode workers prefill only what the router sends them: a
# conversation's next turn, whose uncached suffix is short (a long one goes to the prefill
# pool). That step stalls every stream the worker runs, and on one CPU core a prompt token costs
# about a millisecond, so a 50-token suffix in one step doubled the streams' gap there. 40 took
# the conversations benchmark's ITL p99 from 93 to 82 ms for 43 ms more TTFT p50 (BENCHMARKS.md
# "Conversations keep their KV", AMD EPYC avx512_bf16). Colocated and elastic workers prefill
# every prompt they serve, so no cap by default there: it would multiply their prompts' steps.
DISAGGREGATED_MIXED_PREFILL_TOKENS = 32


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 64  # sequences in one decode batch
    # Prefill token budget per step (chunk size for long prompts). benchmarks/prefill_budget.py
    # (256-token prompts, float32, 1 thread, 2026-11-22 on a loaded 2-core box): 256 / 512 /
    # 1024 / 2048 gave 86 / 118 / 187 / 207 prompt tok/s (mean of two runs in opposite orders).
    # 2048 keeps the most throughput; its longer step only delays a prompt arriving mid-step.
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # prefill_first: a step prefills, or else decodes (a prefill worker's engine). mixed:
    # every step decodes all running sequences and fills the rest of the token budget with
    # prompt chunks (pdserve/engine/core/scheduler.py); what a worker that decodes runs.
    policy: str = PREFILL_FIRST
    # mixed only: prompt tokens one step computes while sequences are decoding in it (0: no
    # cap beyond max_num_batched_tokens). With nothing decoding, a prompt gets the whole
    # budget: there is no stream to protect. ``pdserve serve`` sets it for a disaggregated
    # cluster's decode workers (``DISAGGREGATED_MIXED_PREFILL_TOKENS``, the reason there).
    mixed_prefill_tokens: int = 0
    # mixed only, and above 0: the chunk instead fits this step time, from what steps have
    # cost on this worker (pdserve/engine/core/step_budget.py; mixed_prefill_tokens is the chunk
    # until it knows). ``pdserve serve`` sets half the TPOT objective. 0: the fixed cap above.
    mixed_step_target_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.mixed_step_target_s >= 0:
            raise ValueError(f"mixed_step_target_s must be at least 0, got {self.mixed_step_target_s!r}")
        if self.mixed_prefill_tokens < 0:
            raise ValueError(f"mixed_prefill_tokens must be at least 0, got {self.mixed_prefill_tokens}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduler policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on a worker that decodes (vLLM's ``--speculative-config`` JSON keys).

    Each step a proposer guesses up to ``num_speculative_tokens`` next tokens per sequence
    (``ngram``: the continuation of the newest earlier match of the sequence's last
    ``prompt_lookup_min``..``prompt_lookup_max`` tokens; ``draft_model``: a smaller model of the
    same tokenizer, ``model``, run beside the target); the target scores them all in one forward and
    keeps a prefix by rejection sampling, so the output follows the target's distribution
    exactly (pdserve/engine/spec/). A step with more than ``disable_by_batch_size`` running
    sequences does not speculate: a full batch gains nothing from the extra positions."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: a HF directory (a model of the target's vocabulary)
    disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be at least 1 and at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative model is needed by method draft_model, and by no other method")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")


@dataclass(frozen=True)
class LoRAConfig:
    """Many LoRA adapters on one engine (vLLM's ``--enable-lora`` settings).

    ``modules``: (name, PEFT directory) pairs loaded at start; more are loaded and unloaded at
    run time. At most ``max_loras`` adapters run in one batch (each holds a slot of stacked
    weights on the device); any number stay loaded on the host. An adapter's rank may not pass
    ``max_lora_rank``. A request names its adapter in ``SamplingParams.lora_name``."""

    max_loras: int = 4
    max_lora_rank: int = 16
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names) or any(not name for name in names):
            raise ValueError(f"lora module names must be unique and non-empty, got {names}")


@dataclass(frozen=True)
class KVTierConfig:
    """The KV tier below the prefix cache (pdserve/engine/kv_tier/, docs/kv_tier.md): full
    prefix blocks evicted from the worker's KV memory are kept in a directory, bounded by
    ``offload_bytes``, that the workers of a host share, and come back (verified against their
    checksum) when a prompt matches them. ``offload_dir`` None: a directory under /dev/shm next
    to a GPU (host memory), under the system's temporary directory on a CPU host."""

    offload_bytes: int
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        if self.offload_bytes < 1:
            raise ValueError(f"kv_offload_bytes must be at least 1, got {self.offload_bytes}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, built once by the process that owns it."""

    model: str = "default"  # "default", a HF directory, or a .gguf file
    dtype: str | None = None  # None: default_dtype(device); "float32": transformers-exact
    device: str | None = None  # None: cuda if available, else cpu
    attention_backend: str = "auto"  # auto | paged | triton | sdpa | flash | flash_invariant (engine/attention/select.py)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0  # seeds weight-free randomness (unseeded sampling)
    # Decode steps replay CUDA graphs captured at start (engine/cuda_graphs.py). On since the
    # first H100 runs showed graphed tokens equal transformers' and the eager engine's
    # (BENCHMARKS.md, GPU). Without CUDA it changes nothing.
    cuda_graphs: bool = True
    # Processes (ranks) one worker runs the model on, each with 1/N of every layer's heads and
    # MLP rows (pdserve/engine/parallel.py); N must divide the heads, KV heads and intermediate size.
    tensor_parallel_size: int = 1
    # "auto": the checkpoint's weights; "dummy": random weights made on the device from
    # config.json alone (vLLM's name), for benchmarks and GPU runs that cannot carry a checkpoint.
    load_format: str = "auto"
    # None: one token a step. Set: speculative decoding (workers that decode; SpeculativeConfig).
    speculative: SpeculativeConfig | None = None
    # None: no adapters (a request naming one is refused). Set: multi-LoRA (LoRAConfig).
    lora: LoRAConfig | None = None
    # None: an evicted prefix block is gone. Set: it moves to the KV tier (KVTierConfig).
    kv_tier: KVTierConfig | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")

    def torch_device(self) -> torch.device:
        if self.device:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return default_dtype(self.torch_device())
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]
