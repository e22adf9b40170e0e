"""lm-evaluation-harness, unmodified, against the shared float32 cluster: its ``local-completions``
model runs a loglikelihood task (tests/serving/lmeval: 16 multiple-choice items written for
this test) through /v1/completions (``echo`` with prompt ``logprobs``, batched token prompts),
and every item's scores equal transformers' on the same weights.

lm-eval runs as its own process (lm_eval.simple_evaluate) so that HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are in
force from its first import: the task's data is a local JSONL and its tokenizer is the model's
local directory, and nothing may reach a hub.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.loader import materialize

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lmeval"
TASK = "pdserve_mc"
# Each item's loglikelihood is a sum over its choice's tokens (at most 3 here). The engine and
# transformers run float32 kernels that sum in different orders; a prompt token's logprob
# agrees within 1e-4 (tests/serving/test_openai_fields.py), so a sum within 3e-4 (measured:
# 5.6e-5 at worst). 1e-3 leaves room and is still far below the gap between choices (checked
# below: no near ties; the smallest gap is 0.17).
LL_TOL = 1e-3
GREEDY = {True: True, False: False, "True": True, "False": False}  # is_greedy, as a bool or as str(bool)


# lm-eval's own entry point, simple_evaluate, in a child process. Its CLI would index every
# built-in task first (14 s here); a TaskManager given only this folder skips that.
DRIVER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
base_url, tokenizer, task_dir, out = sys.argv[1:]
model_args = dict(model="smollm2", base_url=base_url, tokenizer_backend="huggingface", tokenizer=tokenizer,
                  tokenized_requests=True, max_retries=1, max_length=2048)
res = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["%s"], batch_size=16,
                              task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                              log_samples=True)
with open(out, "w") as f:
    json.dump({"results": res["results"], "samples": res["samples"]}, f, default=str)
""" % TASK


def run_lm_eval(base_url: str, tokenizer_dir: Path, out: Path) -> tuple[dict, list[dict]]:
    """lm-eval's aggregated scores for the task and its per-item samples, by doc_id."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets-cache"), HF_HOME=str(out / "hf-home"))
    cmd = [sys.executable, "-c", DRIVER, f"{base_url}/v1/completions", str(tokenizer_dir), str(TASK_DIR),
           str(out / "lm_eval.json")]
    done = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    doc = json.loads((out / "lm_eval.json").read_text())
    return doc["results"][TASK], sorted(doc["samples"][TASK], key=lambda s: s["doc_id"])


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """A causal model's context / continuation split as lm-eval documents it: trailing spaces
    move to the continuation, the whole is encoded once and split at the context's length."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def hf_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log P(continuation | context) under transformers, and whether it is greedy."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
    rows = logp[len(ctx) - 1:-1]  # (len(cont), V): each row predicts the next continuation token
    picked = rows[torch.arange(len(cont)), torch.tensor(cont)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_lm_eval_local_completions_scores_equal_transformers(cluster, reference, tmp_path):
    model, tok = reference
    scores, samples = run_lm_eval(f"http://{cluster.http_address}", materialize("default"), tmp_path)
    items = [json.loads(line) for line in (TASK_DIR / "items.jsonl").read_text().splitlines()]
    assert [s["doc_id"] for s in samples] == list(range(len(items)))

    ref_acc, ref_acc_norm = [], []
    for item, sample in zip(items, samples):
        context = f"Question: {item['question']}\nAnswer:"
        ref = [hf_loglikelihood(model, *encode_pair(tok, context, " " + c)) for c in item["choices"]]
        ours = [(float(ll), GREEDY[greedy]) for ll, greedy in sample["filtered_resps"]]
        assert len(ours) == len(ref)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(ours, ref):
            assert abs(ll - ref_ll) < LL_TOL, (item["question"], ours, ref)
            assert greedy == ref_greedy, (item["question"], ours, ref)
        # acc: the most likely choice; acc_norm: the most likely per character of the choice
        # (lm-eval divides by len(choice), the delimiter not counted)
        raw = [r[0] for r in ref]
        per_char = [ll / len(c) for ll, c in zip(raw, item["choices"])]
        for scores_ in (raw, per_char):  # a gap within the tolerance could flip either
            top = sorted(scores_)
            assert top[-1] - top[-2] > 2 * LL_TOL, f"near tie in {item['question']!r}: pick other choices"
        best, norm = raw.index(max(raw)), per_char.index(max(per_char))
        ref_acc.append(float(best == item["answer"]))
        ref_acc_norm.append(float(norm == item["answer"]))
        assert (sample["acc"], sample["acc_norm"]) == (ref_acc[-1], ref_acc_norm[-1]), item["question"]

    assert scores["acc,none"] == pytest.approx(sum(ref_acc) / len(items))
    assert scores["acc_norm,none"] == pytest.approx(sum(ref_acc_norm) / len(items))
    assert 0 < sum(ref_acc) < len(items)  # the items are neither all right nor all wrong: acc is informative
