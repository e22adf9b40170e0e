"""Sampling parameters of one request, and the checks they meet.

Two levels, each written once. ``SamplingParams.check`` and ``check_prompt`` are the cheap
checks that protect an engine (sizes, ranges, token ids within the vocabulary, the context
length): every engine runs them on entry, whoever sent the request (``check_request``). The
router runs the same checks once per request, before it routes, and also asks whether a
structured-output spec compiles (``StructuredOutput.validate``); an engine finds that out
when it compiles the spec to use it (``pdserve.engine.sampling.grammar.GrammarCompiler``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.grammar import StructuredOutput

# Below this a temperature counts as greedy: logits / 1e-40 overflow float32 to inf, and
# softmax of inf is NaN, which no draw can use. At 1e-5 the largest logit a model
# gives (~1e2) scales to ~1e7, far from float32's 3.4e38; and sampling at such a temperature
# is the argmax anyway.
TEMPERATURE_EPSILON = 1e-5
# The penalty divides positive logits: a floor keeps them finite (1e2 / 1e-2 = 1e4).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2], as in OpenAI's API
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's own limit on logit_bias keys
MAX_TOP_LOGPROBS = 20  # alternatives per position, OpenAI's chat limit
MAX_CACHE_SALT_CHARS = 256
MAX_LORA_NAME_CHARS = 256  # room for a client's salt; the router's per-key salts are 64

# The most likely alternatives at one position: (token id, logprob) pairs, best first.
TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature below ``TEMPERATURE_EPSILON`` (0 included) means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. ``seed`` makes sampled output reproducible regardless of batch company.
    ``logprobs`` returns the log-probability (under the model's raw distribution) of each
    chosen token, and ``top_logprobs`` that many most likely alternatives with it.
    ``prompt_logprobs`` (None: off) returns the logprob of every prompt token after the
    first, with that many alternatives (echo / loglikelihood); such a prompt bypasses the
    prefix cache, whose blocks carry no logits.

    Penalties, as vLLM applies them: ``logit_bias`` adds to the named tokens' logits;
    ``repetition_penalty`` divides (multiplies, when negative) the logits of every token
    in prompt and output; ``frequency_penalty`` subtracts, per token, its count in the
    output so far, and ``presence_penalty`` a constant once it occurs there. Until
    ``min_tokens`` tokens are out, EOS and ``stop_token_ids`` cannot be drawn.
    ``structured`` restricts every draw to what its grammar allows next, and forces a stop
    token once the grammar is complete.

    ``cache_salt`` is not about sampling, but travels with the request's parameters to every
    worker that caches its KV: prefix-cache blocks are shared only between requests of the
    same salt (``pdserve.engine.core.block_manager``). ``lora_name`` names the LoRA adapter
    the request runs under, "" for the base model.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # a grammar the output must follow (engine.grammar)
    cache_salt: str = ""  # "": the shared, unsalted prefix cache
    # The LoRA adapter the request runs under ("": the base model). Like the salt it is not about
    # sampling; it travels with the parameters to every worker, and KV is shared only within it.
    lora_name: str = ""

    @property
    def penalised(self) -> bool:
        """True when any logit processing applies before the draw (greedy included)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_EPSILON

    def check(self, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` naming the first field out of range or over its size.
        Cheap (no grammar is built): every engine runs it on entry."""
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}", 1)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails every comparison
            raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (below "
                                      f"{TEMPERATURE_EPSILON:g}: greedy), got {self.temperature}", (0, MAX_TEMPERATURE))
        if self.top_k < 0 and self.top_k != -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}", -1)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}", (0, 1))
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}", (0, 1))
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            limits = (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
            raise InvalidRequestError("repetition_penalty", f"must be in [{limits[0]:g}, {limits[1]:g}], "
                                      f"got {self.repetition_penalty}", limits)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}",
                                          (-MAX_PENALTY, MAX_PENALTY))
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError("logit_bias", f"{len(self.logit_bias)} entries; the limit is "
                                      f"{MAX_LOGIT_BIAS_ENTRIES}", MAX_LOGIT_BIAS_ENTRIES)
        for tid, bias in self.logit_bias:
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError("logit_bias", f"token id {tid} is outside [0, {vocab_size})", vocab_size)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError("logit_bias", f"bias {bias} for token {tid} is outside "
                                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", MAX_LOGIT_BIAS)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens}", self.max_tokens)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                                      f"{self.top_logprobs}", MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                                      f"{self.prompt_logprobs}", MAX_TOP_LOGPROBS)
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError("stop_token_ids", f"{tid} is outside [0, {vocab_size})", vocab_size)
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError("cache_salt", f"{len(self.cache_salt)} characters; the limit is "
                                      f"{MAX_CACHE_SALT_CHARS}", MAX_CACHE_SALT_CHARS)
        if "\0" in self.cache_salt:  # kv_salt's adapter salts start with one (core/block_hashes.py)
            raise InvalidRequestError("cache_salt", "must not contain a NUL character")
        if len(self.lora_name) > MAX_LORA_NAME_CHARS:
            raise InvalidRequestError("lora_name", f"{len(self.lora_name)} characters; the limit is "
                                      f"{MAX_LORA_NAME_CHARS}", MAX_LORA_NAME_CHARS)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        if self.structured is not None:
            self.structured.check("structured_output")
            if self.min_tokens:  # a complete grammar allows only EOS, which min_tokens bans
                raise InvalidRequestError("min_tokens", "cannot be combined with structured output", 0)


def check_request(prompt_token_ids, params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The cheap checks that protect an engine, as every engine runs them on entry."""
    params.check(vocab_size)
    check_prompt(prompt_token_ids, params, vocab_size, max_model_len)


def check_prompt(prompt_token_ids, params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The prompt's part of ``check_request`` (the router checks ``params`` before it
    tokenizes, and the prompt after)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt", "must contain at least one token", 1)
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError("prompt_token_ids", f"every id must be in [0, {vocab_size})", vocab_size)
    if n >= max_model_len:
        raise InvalidRequestError("prompt", f"{n} tokens; the limit is {max_model_len - 1}", max_model_len - 1)
    if n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context length {max_model_len}", max_model_len - n)
