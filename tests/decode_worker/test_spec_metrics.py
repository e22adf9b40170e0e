"""A decode worker that speculates (``EngineConfig.speculative``, ngram) reports its engine's
counters: real worker and engine (the tiny Llama, float32), its engine thread running, a
repetitive prompt prefilled and decoded here. Its ``Stats`` carry the counters (WorkerStats
48-52) and its ``/metrics`` the ``pdserve:spec_decode_*`` families with the same values; the
counts agree with one another (no more tokens kept than proposed, each position kept no more
often than the one before it). (That speculation leaves the tokens unchanged is
tests/engine/test_spec_decoding.py's.)"""

import asyncio
import dataclasses
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling.params import SamplingParams
from pdserve.wire import worker_metrics
from tests.factories import decode_worker_config, engine_config

K, ANSWER = 3, 24
PROMPT = [11, 12, 13, 14, 15, 16] * 6  # a pattern the ngram proposer finds again and again


def engine(directory, speculative: SpeculativeConfig) -> LLMEngine:
    config = dataclasses.replace(engine_config(directory, num_blocks=64), speculative=speculative)
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, None, model_dir=str(model_dir))


async def served(worker: DecodeWorker) -> list[int]:
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    return [t async for item in worker.prefill_and_decode("spec-1", list(PROMPT), params)
            for t in getattr(item, "new_token_ids", [])]


def scrape(address: str, worker: str) -> dict[tuple[str, str | None], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("pdserve:spec_decode") and s.labels.get("worker") == worker}


def test_a_speculating_decode_worker_reports_consistent_counters_in_stats_and_metrics(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=3)
    worker = DecodeWorker(decode_worker_config(kv_transfer_backend="tcp", worker_id="decode-spec"),
                          engine=engine(directory, spec))
    worker.start()
    endpoint = worker_metrics.serve_worker("127.0.0.1", 0, worker_metrics.WorkerSource(
        "decode", "decode-spec", worker.stats, 16, "tiny"))
    try:
        tokens = asyncio.run(served(worker))
        stats = worker.stats()
        exported = scrape(endpoint.address, "decode-spec")
    finally:
        endpoint.stop()
        worker.stop()

    assert len(tokens) == ANSWER
    per_pos = list(stats.spec_accepted_per_pos)
    assert stats.spec_num_speculative_tokens == K and stats.spec_num_drafts > 0
    assert stats.spec_num_drafts <= stats.spec_num_draft_tokens <= K * stats.spec_num_drafts
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(per_pos) == stats.spec_num_accepted_tokens and len(per_pos) <= K
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos  # a guess kept only after the one before it
    assert exported == {
        ("pdserve:spec_decode_num_drafts_total", None): stats.spec_num_drafts,
        ("pdserve:spec_decode_num_draft_tokens_total", None): stats.spec_num_draft_tokens,
        ("pdserve:spec_decode_num_accepted_tokens_total", None): stats.spec_num_accepted_tokens,
        **{("pdserve:spec_decode_num_accepted_tokens_per_pos_total", str(i)): (per_pos[i] if i < len(per_pos) else 0)
           for i in range(K)}}
