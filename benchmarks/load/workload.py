"""What a load run sends and when: length distributions, arrival processes, shared prefixes,
and the seeded expansion of a spec into concrete requests and send times.

Everything here is pure and seeded, so the same spec always yields the same requests: two
servers compared in one run see identical traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

LENGTH_KINDS = ("fixed", "uniform", "lognormal")
ARRIVAL_KINDS = ("poisson", "gamma", "closed")
PROMPT_FORMATS = ("ids", "text")

# The long-tailed chat mix: log-normal lengths whose means are ShareGPT's as the vLLM paper
# reports them (161 prompt tokens, 338 output tokens per request). ShareGPT's lengths span
# two orders of magnitude with a long right tail; sigma 1.0 (prompts) and 0.8 (outputs) give a
# p99/p50 of about 10x and 6x. Clamping to [minimum, maximum] lowers the mean by a few percent.
CHAT_PROMPT_MEAN, CHAT_PROMPT_SIGMA = 161.0, 1.0
CHAT_OUTPUT_MEAN, CHAT_OUTPUT_SIGMA = 338.0, 0.8

# Words that are one token each (with their leading space) in common BPE vocabularies, for
# text prompts: the server's usage reports the exact count.
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
         "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
         "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more")


class WorkloadError(ValueError):
    """A workload setting outside what it can be: the message names the field and the limit."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.field = name


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise WorkloadError(name, message)


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts; ``sample`` clamps every draw to [minimum, maximum]."""

    kind: str = "fixed"
    value: int = 128  # fixed
    low: int = 1  # uniform, inclusive
    high: int = 1
    mean: float = 0.0  # lognormal: the mean before clamping
    sigma: float = 0.0  # lognormal: the standard deviation of log(length)
    minimum: int = 1
    maximum: int = 1 << 20

    def __post_init__(self):
        _require(self.kind in LENGTH_KINDS, "kind", f"{self.kind!r} is not one of {LENGTH_KINDS}")
        _require(1 <= self.minimum <= self.maximum, "minimum", f"1 <= minimum <= maximum, got {self.minimum}, "
                 f"{self.maximum}")
        if self.kind == "fixed":
            _require(self.value >= 1, "value", f"must be >= 1, got {self.value}")
        elif self.kind == "uniform":
            _require(1 <= self.low <= self.high, "low", f"1 <= low <= high, got {self.low}, {self.high}")
        else:
            _require(self.mean >= 1, "mean", f"must be >= 1, got {self.mean}")
            _require(0 <= self.sigma <= 4, "sigma", f"must be in [0, 4], got {self.sigma}")

    @classmethod
    def fixed(cls, n: int) -> "Lengths":
        return cls("fixed", value=n)

    @classmethod
    def uniform(cls, low: int, high: int) -> "Lengths":
        return cls("uniform", low=low, high=high)

    @classmethod
    def lognormal(cls, mean: float, sigma: float, minimum: int = 1, maximum: int = 1 << 20) -> "Lengths":
        return cls("lognormal", mean=mean, sigma=sigma, minimum=minimum, maximum=maximum)

    @classmethod
    def chat_prompts(cls, scale: float = 1.0, maximum: int = 2048) -> "Lengths":
        return cls.lognormal(CHAT_PROMPT_MEAN * scale, CHAT_PROMPT_SIGMA, 4, maximum)

    @classmethod
    def chat_outputs(cls, scale: float = 1.0, maximum: int = 1024) -> "Lengths":
        return cls.lognormal(CHAT_OUTPUT_MEAN * scale, CHAT_OUTPUT_SIGMA, 1, maximum)

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "fixed":
            raw = [self.value] * n
        elif self.kind == "uniform":
            raw = [rng.randint(self.low, self.high) for _ in range(n)]
        else:  # mean of a log-normal is exp(mu + sigma^2 / 2)
            mu = math.log(self.mean) - self.sigma ** 2 / 2
            raw = [round(rng.lognormvariate(mu, self.sigma)) for _ in range(n)]
        return [min(self.maximum, max(self.minimum, x)) for x in raw]


def parse_lengths(text: str, name: str = "lengths") -> Lengths:
    """``fixed:N``, ``uniform:LOW:HIGH``, ``lognormal:MEAN:SIGMA[:MIN:MAX]``, ``chat-prompt[:SCALE]``
    or ``chat-output[:SCALE]`` (the chat mix, its means scaled)."""
    kind, *args = text.split(":")
    try:
        if kind == "fixed" and len(args) == 1:
            return Lengths.fixed(int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return Lengths.uniform(int(args[0]), int(args[1]))
        if kind == "lognormal" and len(args) in (2, 4):
            bounds = [int(a) for a in args[2:]]
            return Lengths.lognormal(float(args[0]), float(args[1]), *bounds)
        if kind in ("chat-prompt", "chat-output") and len(args) <= 1:
            scale = float(args[0]) if args else 1.0
            _require(scale > 0, name, f"scale must be > 0, got {scale}")
            return Lengths.chat_prompts(scale) if kind == "chat-prompt" else Lengths.chat_outputs(scale)
    except ValueError as exc:
        if isinstance(exc, WorkloadError):
            raise WorkloadError(name, str(exc)) from None
        raise WorkloadError(name, f"{text!r}: {exc}") from None
    raise WorkloadError(name, f"{text!r} is not fixed:N, uniform:LOW:HIGH, lognormal:MEAN:SIGMA[:MIN:MAX], "
                              "chat-prompt[:SCALE] or chat-output[:SCALE]")


@dataclass(frozen=True)
class Arrivals:
    """When requests are sent.

    ``poisson``: open loop, exponential gaps at ``rate`` requests/s. ``gamma``: open loop, gamma
    gaps with the same mean and shape ``burstiness`` (below 1 burstier than Poisson, above 1
    more regular; 1 is Poisson). ``closed``: ``concurrency`` clients, each sending its next
    request when its last one ends. Open loops may cap requests in flight (``max_concurrency``).
    """

    kind: str = "poisson"
    rate: float = 1.0
    burstiness: float = 1.0
    concurrency: int = 1
    max_concurrency: int | None = None

    def __post_init__(self):
        _require(self.kind in ARRIVAL_KINDS, "kind", f"{self.kind!r} is not one of {ARRIVAL_KINDS}")
        if self.kind == "closed":
            _require(self.concurrency >= 1, "concurrency", f"must be >= 1, got {self.concurrency}")
        else:
            _require(self.rate > 0, "rate", f"must be > 0 requests/s (math.inf: all at once), got {self.rate}")
            _require(0 < self.burstiness <= 100, "burstiness", f"must be in (0, 100], got {self.burstiness}")
        _require(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
                 f"must be >= 1 or None, got {self.max_concurrency}")

    @property
    def open_loop(self) -> bool:
        return self.kind != "closed"


def send_offsets(arrivals: Arrivals, n: int, rng: random.Random) -> list[float]:
    """Seconds from the run's start at which each of ``n`` open-loop requests is sent: the
    first at 0, then cumulative gaps. Gamma gaps with shape k and scale 1/(rate*k) have mean
    1/rate and a coefficient of variation 1/sqrt(k)."""
    _require(arrivals.open_loop, "kind", "a closed loop has no send times")
    if math.isinf(arrivals.rate):
        return [0.0] * n
    shape = 1.0 if arrivals.kind == "poisson" else arrivals.burstiness
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1.0 / (arrivals.rate * shape))
    return out


@dataclass(frozen=True)
class SharedPrefix:
    """``count`` system prompts of ``length`` tokens; each request starts with one of them
    (round robin), followed by its own question drawn from the prompt lengths."""

    count: int = 8
    length: int = 1500

    def __post_init__(self):
        _require(self.count >= 1, "count", f"must be >= 1, got {self.count}")
        _require(self.length >= 1, "length", f"must be >= 1, got {self.length}")


@dataclass(frozen=True)
class SLO:
    """DistServe's per-request objectives: time to first token, and time per output token
    after the first. A request meets the SLO when it meets both."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self):
        _require(self.ttft_ms > 0, "ttft_ms", f"must be > 0, got {self.ttft_ms}")
        _require(self.tpot_ms > 0, "tpot_ms", f"must be > 0, got {self.tpot_ms}")


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 32
    arrivals: Arrivals = field(default_factory=Arrivals)
    prompt_len: Lengths = field(default_factory=lambda: Lengths.fixed(256))
    output_len: Lengths = field(default_factory=lambda: Lengths.fixed(64))
    shared_prefix: SharedPrefix | None = None
    prompt_format: str = "ids"  # "ids": token-id prompts (exact lengths); "text": words
    token_range: tuple[int, int] = (1000, 10000)  # ids prompts draw ids from [low, high)
    model: str | None = None  # None: the first model /v1/models lists
    ignore_eos: bool = True  # every request generates exactly its output length
    slo: SLO | None = None
    warmup: int = 1  # unmeasured requests sent one at a time before the run
    seed: int = 0
    request_timeout_s: float = 600.0

    def __post_init__(self):
        _require(self.num_requests >= 1, "num_requests", f"must be >= 1, got {self.num_requests}")
        _require(self.prompt_format in PROMPT_FORMATS, "prompt_format",
                 f"{self.prompt_format!r} is not one of {PROMPT_FORMATS}")
        low, high = self.token_range
        _require(0 <= low < high, "token_range", f"needs 0 <= low < high, got {self.token_range}")
        _require(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        _require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class Request:
    prompt: list[int] | str
    max_tokens: int
    prefix: int | None = None  # which shared prefix it starts with


def _ids(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*token_range) for _ in range(n)]


def _text(rng: random.Random, n: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def build_requests(spec: WorkloadSpec, n: int | None = None, seed_offset: int = 0) -> list[Request]:
    """The spec's requests (``n`` of them, default ``spec.num_requests``), seeded by ``spec.seed``
    plus ``seed_offset`` (warm-up requests use another offset than measured ones)."""
    rng = random.Random(spec.seed * 1_000_003 + seed_offset)
    n = spec.num_requests if n is None else n
    make = ((lambda k: _ids(rng, k, spec.token_range)) if spec.prompt_format == "ids" else (lambda k: _text(rng, k)))
    prefixes = [make(spec.shared_prefix.length) for _ in range(spec.shared_prefix.count)] if spec.shared_prefix else []
    prompt_lens, output_lens = spec.prompt_len.sample(rng, n), spec.output_len.sample(rng, n)
    out = []
    for i, (plen, olen) in enumerate(zip(prompt_lens, output_lens)):
        which = i % len(prefixes) if prefixes else None
        body = make(plen)
        out.append(Request(prefixes[which] + body if prefixes else body, olen, which))
    return out
