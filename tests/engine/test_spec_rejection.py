"""Rejection sampling (pdserve/engine/spec/rejection.py) keeps the target's distribution: on a
tiny vocabulary, the tokens it emits follow the target's p (after temperature and top-k) for a
fixed proposal q, point mass or full, at the first position and after it. Seeded: deterministic."""

import pytest
import torch

from pdserve.engine.core.scheduler import ScheduledSeq
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.sampling.sampler import Sampler
from pdserve.engine.spec.proposer import Proposal
from pdserve.engine.spec.rejection import verify

VOCAB = 8
TRIALS = 6_000
PARAMS = SamplingParams(temperature=0.7, top_k=6, max_tokens=64)  # p is after both
CHI2_DF7_P001 = 24.32  # chi-square quantile, 7 degrees of freedom, p = 0.001


def target(logits: torch.Tensor) -> torch.Tensor:
    """The request's p, computed here by hand: temperature, then the top 6 tokens renormalized."""
    scaled = logits / PARAMS.temperature
    keep = scaled.topk(PARAMS.top_k, dim=-1).indices
    masked = torch.full_like(scaled, float("-inf")).scatter(-1, keep, scaled.gather(-1, keep))
    return torch.softmax(masked, dim=-1)


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic over the tokens p can emit; infinite when a token it forbids was emitted."""
    if counts[p == 0].sum() > 0:
        return float("inf")
    live = p > 0
    expected = p[live] * counts.sum()
    return float(((counts[live] - expected) ** 2 / expected).sum())


def run_trials(logits: torch.Tensor, q: torch.Tensor | None, guesses: torch.Tensor) -> list[list[int]]:
    """``verify`` over TRIALS sequences in one batch, each guessing ``guesses[i]`` (k tokens)."""
    k = guesses.shape[1]
    items = []
    for i in range(TRIALS):
        seq = Sequence(f"s{i}", [1, 2, 3], PARAMS)
        items.append(ScheduledSeq(seq, 1 + k, True, Proposal(guesses[i].tolist(), q)))
    kept, failed = verify(Sampler(torch.device("cpu"), seed=11), logits.repeat(TRIALS, 1), items)
    assert not failed
    return [kept[f"s{i}"] for i in range(TRIALS)]


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)) * 1.5  # (1 + k, V), k = 2


@pytest.mark.parametrize("proposal", ["point-mass", "full"])
def test_emitted_tokens_follow_the_target(logits, proposal):
    g = torch.Generator().manual_seed(3)
    if proposal == "point-mass":  # a deterministic proposer: always the same guesses, one p gives little mass
        q = None
        guesses = torch.tensor([[int(target(logits)[0].argsort()[-2]), 4]]).repeat(TRIALS, 1)
    else:  # guesses drawn from a q unlike p (uniform over a part of the vocabulary, zero elsewhere)
        q = torch.zeros(2, VOCAB)
        q[0, :5], q[1, 2:] = 1 / 5, 1 / 6
        guesses = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=g) for i in range(2)], 1)
    kept = run_trials(logits, q, guesses)
    p = target(logits)
    first = torch.bincount(torch.tensor([t[0] for t in kept]), minlength=VOCAB).double()
    assert chi2(first, p[0].double()) < CHI2_DF7_P001
    # After the first guess was kept, the next token follows p at row 1 (the target given it).
    second = [t[1] for t in kept if len(t) > 1]
    assert len(second) > TRIALS // 20  # enough to test
    assert chi2(torch.bincount(torch.tensor(second), minlength=VOCAB).double(), p[1].double()) < CHI2_DF7_P001
    # A proposal equal to nothing p likes is mostly rejected; one close to p mostly kept: not all of either.
    lengths = torch.tensor([len(t) for t in kept])
    assert 0 < (lengths == 1).sum() < TRIALS and (lengths == 3).sum() > 0


def test_the_check_fails_a_rule_that_ignores_the_request_processing(logits):
    """The statistic can fail: tokens drawn from the raw softmax (no temperature, no top-k)
    instead of p."""
    raw = torch.softmax(logits[0], dim=-1)
    drawn = torch.multinomial(raw, TRIALS, replacement=True, generator=torch.Generator().manual_seed(1))
    assert chi2(torch.bincount(drawn, minlength=VOCAB).double(), target(logits)[0].double()) > CHI2_DF7_P001


def test_greedy_keeps_guesses_while_they_are_the_argmax(logits):
    best = logits.argmax(dim=-1).tolist()
    seq = Sequence("g", [1, 2], SamplingParams(max_tokens=8))
    right = ScheduledSeq(seq, 3, True, Proposal([best[0], best[1]]))
    kept, _ = verify(Sampler(torch.device("cpu")), logits, [right])
    assert kept["g"] == best  # both kept, then the bonus argmax
    wrong = ScheduledSeq(seq, 3, True, Proposal([best[0], (best[1] + 1) % VOCAB]))
    kept, _ = verify(Sampler(torch.device("cpu")), logits, [wrong])
    assert kept["g"] == best[:2]  # the second replaced by the argmax there


def test_seeded_requests_draw_the_same_whatever_the_batch(logits):
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=8)
    items = [ScheduledSeq(Sequence(f"r{i}", [1], params), 3, True, Proposal([1, 2])) for i in range(2)]
    other = ScheduledSeq(Sequence("x", [1], SamplingParams(temperature=1.0)), 3, True, Proposal([3, 4]))
    alone, _ = verify(Sampler(torch.device("cpu")), logits, items[:1])
    batched, _ = verify(Sampler(torch.device("cpu")), logits.repeat(2, 1), [other, items[1]])
    assert alone["r0"] == batched["r1"]
