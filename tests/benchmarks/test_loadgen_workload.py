"""The load generator's workloads (benchmarks/load/workload.py): length distributions, arrival
processes, shared prefixes and the seeded expansion into requests; no server."""

import math
import random
import statistics

import pytest

from benchmarks.load.workload import (CHAT_OUTPUT_MEAN, CHAT_PROMPT_MEAN, SLO, Arrivals, Lengths, SharedPrefix,
                                      WorkloadError, WorkloadSpec, build_requests, parse_lengths, send_offsets)
from benchmarks.loadgen import main as loadgen_main


def test_fixed_and_uniform_lengths():
    rng = random.Random(0)
    assert Lengths.fixed(7).sample(rng, 3) == [7, 7, 7]
    xs = Lengths.uniform(3, 6).sample(rng, 2000)
    assert set(xs) == {3, 4, 5, 6}  # both ends inclusive


def test_lognormal_mean_tail_and_clamp():
    xs = Lengths.lognormal(200, 1.0).sample(random.Random(1), 40000)
    assert statistics.fmean(xs) == pytest.approx(200, rel=0.03)
    assert statistics.median(xs) == pytest.approx(200 * math.exp(-0.5), rel=0.05)  # exp(mu) = mean * e^(-s^2/2)
    clamped = Lengths.lognormal(200, 1.0, 50, 300).sample(random.Random(1), 2000)
    assert min(clamped) == 50 and max(clamped) == 300


def test_chat_mix_keeps_sharegpt_means_and_scales():
    rng = random.Random(2)
    assert statistics.fmean(Lengths.chat_prompts().sample(rng, 40000)) == pytest.approx(CHAT_PROMPT_MEAN, rel=0.05)
    quarter = Lengths.chat_outputs(0.25).sample(rng, 40000)
    assert statistics.fmean(quarter) == pytest.approx(CHAT_OUTPUT_MEAN / 4, rel=0.05)


@pytest.mark.parametrize("text,expected", [
    ("fixed:64", Lengths.fixed(64)),
    ("uniform:8:16", Lengths.uniform(8, 16)),
    ("lognormal:100:0.5", Lengths.lognormal(100, 0.5)),
    ("lognormal:100:0.5:2:400", Lengths.lognormal(100, 0.5, 2, 400)),
    ("chat-prompt", Lengths.chat_prompts()),
    ("chat-output:0.5", Lengths.chat_outputs(0.5)),
])
def test_parse_lengths(text, expected):
    assert parse_lengths(text) == expected


@pytest.mark.parametrize("text,words", [
    ("fixed:0", "value: must be >= 1"),
    ("uniform:9:3", "low: 1 <= low <= high"),
    ("lognormal:100:9", "sigma: must be in [0, 4]"),
    ("fixed:x", "'fixed:x'"),
    ("zipf:3", "is not fixed:N"),
    ("chat-prompt:0", "scale must be > 0"),
])
def test_parse_lengths_refuses_naming_the_flag_and_limit(text, words):
    with pytest.raises(WorkloadError) as err:
        parse_lengths(text, "prompt_len")
    assert str(err.value).startswith("prompt_len: ") and words in str(err.value)


@pytest.mark.parametrize("kwargs,field", [
    (dict(kind="uniformish"), "kind"), (dict(rate=0), "rate"), (dict(rate=-1.0), "rate"),
    (dict(kind="gamma", burstiness=0), "burstiness"), (dict(kind="closed", concurrency=0), "concurrency"),
    (dict(max_concurrency=0), "max_concurrency"),
])
def test_arrivals_refuse_bad_values(kwargs, field):
    with pytest.raises(WorkloadError) as err:
        Arrivals(**kwargs)
    assert err.value.field == field


def gaps(arrivals: Arrivals, n: int = 40000) -> list[float]:
    t = send_offsets(arrivals, n, random.Random(3))
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    return [b - a for a, b in zip(t, t[1:])]


def test_poisson_gaps_are_exponential_at_the_rate():
    g = gaps(Arrivals("poisson", rate=4.0))
    assert statistics.fmean(g) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("k", [0.25, 4.0])
def test_gamma_gaps_keep_the_rate_and_have_cv_one_over_sqrt_burstiness(k):
    g = gaps(Arrivals("gamma", rate=2.0, burstiness=k))
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1 / math.sqrt(k), rel=0.06)


def test_infinite_rate_sends_all_at_once_and_closed_loop_has_no_send_times():
    assert send_offsets(Arrivals(rate=math.inf), 5, random.Random(0)) == [0.0] * 5
    with pytest.raises(WorkloadError, match="closed loop"):
        send_offsets(Arrivals("closed", concurrency=2), 5, random.Random(0))


def test_requests_are_seeded_and_have_the_drawn_lengths():
    spec = WorkloadSpec(num_requests=20, prompt_len=Lengths.uniform(5, 40), output_len=Lengths.uniform(1, 9),
                        token_range=(100, 200), seed=5)
    a, b = build_requests(spec), build_requests(spec)
    assert a == b and a != build_requests(WorkloadSpec(**{**spec.__dict__, "seed": 6}))
    assert all(5 <= len(r.prompt) <= 40 and 1 <= r.max_tokens <= 9 for r in a)
    assert all(100 <= t < 200 for r in a for t in r.prompt)
    assert build_requests(spec, n=3, seed_offset=1) != a[:3]  # warm-up prompts differ


def test_shared_prefix_requests_start_with_one_of_n_system_prompts():
    spec = WorkloadSpec(num_requests=10, prompt_len=Lengths.fixed(4), shared_prefix=SharedPrefix(3, 50))
    reqs = build_requests(spec)
    assert [r.prefix for r in reqs] == [i % 3 for i in range(10)]
    heads = {r.prefix: r.prompt[:50] for r in reqs}
    assert len({tuple(h) for h in heads.values()}) == 3
    assert all(r.prompt[:50] == heads[r.prefix] and len(r.prompt) == 54 for r in reqs)
    assert len({tuple(r.prompt[50:]) for r in reqs}) == 10  # each question its own


def test_text_prompts_have_one_word_per_drawn_token():
    reqs = build_requests(WorkloadSpec(num_requests=3, prompt_len=Lengths.fixed(12), prompt_format="text"))
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in reqs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_requests=0), "num_requests"), (dict(prompt_format="bytes"), "prompt_format"),
    (dict(token_range=(5, 5)), "token_range"), (dict(warmup=-1), "warmup"), (dict(request_timeout_s=0), "request_timeout_s"),
])
def test_spec_refuses_bad_values(kwargs, field):
    with pytest.raises(WorkloadError) as err:
        WorkloadSpec(**kwargs)
    assert err.value.field == field
    with pytest.raises(WorkloadError, match="ttft_ms"):
        SLO(0, 10)


def test_cli_refuses_bad_flags_naming_them(capsys):
    for argv, words in ((["--prompt-len", "fixed:0"], "prompt_len: value"),
                        (["--shared-prefix", "8"], "shared_prefix:"),
                        (["--slo-ttft-ms", "100"], "go together")):
        with pytest.raises(SystemExit):
            loadgen_main(argv)
        assert words in capsys.readouterr().err
