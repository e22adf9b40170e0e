"""Runs one scheduled step through the model: inputs in, sampled tokens out.

Builds the packed token ids, positions and the ``AttentionContext`` (slot mapping, block
tables, lengths) from the scheduler's output, hands every attention layer its slice of the
cache, runs the forward, and samples the sequences that finished their
prompt or are decoding. With CUDA graphs (``graph_sizes``), a decode step that fits one
replays it instead of running the forward (pdserve/engine/cuda_graphs.py). A
speculating sequence (``ScheduledSeq.draft``) runs its newest token and its guesses, and every
one of those positions is a sampled row: their logits go to ``verify`` (pdserve/engine/spec/),
the other rows' to the sampler, in the same step.

In a tensor-parallel worker this is rank 0's runner: before each forward it hands the
prepared inputs and the rows it samples to the other ranks (``ranks``, a
``pdserve.engine.distributed.group.RankGroup``), which run the same forward on their shares. The LM
head is split by vocabulary rows, so every rank computes its slice of each logits rank 0
computes, gathered to rank 0, in one order: the sampled rows' right after the forward, then the
prompt logprobs' slices, each announced to the other ranks first (``RankGroup.logits``).
Sampling is rank 0's alone. A forward or logits call that raises there may have left the ranks
between two collectives, out of step for good: it is the worker's loss (``RankGroup.lost``),
not one request's fault. CUDA graphs at TP > 1 need NCCL (gloo's collectives run on the host and
cannot be captured): every rank builds the same graphs as rank 0 does, in the same order
(``RankGroup.graphs``), and a graphed step hands its padded inputs to the other ranks, which
replay their own graphs on them (``RankGroup.graph_step``); the all-reduces and the head's
gather to rank 0 are inside every rank's graph.

With LoRA (``lora``, a ``pdserve.engine.lora.manager.LoRAManager``), each step first names its
sequences' adapters, so that every token computes with its own (docs/lora.md), and hands them
to the other ranks with the step; a step with an adapter runs eagerly, never from a CUDA graph
(the graphs are captured without adapters).
"""

from __future__ import annotations

import logging
from itertools import accumulate, chain
from typing import Callable

import torch

from pdserve.engine.attention.base import AttentionContext, HostContext, host_context
from pdserve.engine.attention.select import select_attention
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.piecewise import PiecewiseGraphs, token_sizes, unsupported
from pdserve.engine.device import to_device
from pdserve.engine.errors import RankLost, SequenceFailed
from pdserve.engine.attention.kv_cache import cache_spec_of
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.parallel import SINGLE
from pdserve.engine.runner.prompt_logprobs import prompt_logprobs
from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.core.scheduler import SampledTokens, ScheduledSeq, SchedulerOutput
from pdserve.engine.distributed.group import RankGroup, uses_nccl

log = logging.getLogger(__name__)

# Speculative verification (``pdserve.engine.spec.rejection.verify``, handed in by the engine):
# (sampler, the logits (R, V) of the speculating rows, 1 + k rows each, their items) -> (each one's
# kept tokens: its accepted guesses then one token of the target's, the rows that failed).
Verify = Callable[[Sampler, torch.Tensor, list[ScheduledSeq]], tuple[dict[str, list[int]], dict[str, SequenceFailed]]]


def _no_verify(sampler: Sampler, logits: torch.Tensor, items: list[ScheduledSeq]):
    raise RuntimeError("a step scheduled guesses, but this runner was built without speculative verification")


class ModelRunner:
    """``graph_sizes``: decode batch sizes to capture CUDA graphs for, at start (empty: none;
    ignored, and logged, off CUDA or on a backend that is not graph-safe); ``max_model_len``
    sizes their block tables; ``verify``: how a speculating row's guesses are checked (None:
    no step of this runner's speculates); ``piecewise_tokens``: the step's token budget, up to
    which steps with prompt tokens replay piecewise graphs (pdserve/engine/piecewise.py; 0: none)."""

    def __init__(self, model: CausalLM, cfg: ModelConfig, cache: torch.Tensor, blocks: BlockManager,
                 attention_backend: str = "auto", seed: int = 0, graph_sizes: tuple[int, ...] = (),
                 max_model_len: int | None = None, ranks: RankGroup | None = None, verify: Verify | None = None,
                 lora=None, piecewise_tokens: int = 0):
        self.model = model
        self.lora = lora
        self.cfg = cfg
        self.cache = cache
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.device = cache.device
        self.ranks = ranks
        tp = ranks.tp if ranks is not None else SINGLE  # attention runs this rank's heads
        self.backend = select_attention(attention_backend, cfg, tp, self.device, self.block_size, cache.dtype)
        self._layer_caches = cache_spec_of(cfg, self.block_size, cache.dtype, tp.size).layer_caches(cache)
        self.sampler = Sampler(self.device, seed)
        self.verify = verify or _no_verify
        self.num_forward_tokens = 0  # tokens run through the model, for tests and metrics
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            self.graphs = self._capture(graph_sizes, max_model_len or cfg.max_model_len)
        self.piecewise: PiecewiseGraphs | None = (self._capture_pieces(token_sizes(piecewise_tokens))
                                                  if piecewise_tokens else None)

    @torch.inference_mode()
    def _capture(self, sizes: tuple[int, ...], max_model_len: int) -> DecodeGraphs | None:
        if self.device.type != "cuda":
            return None  # nothing to capture: the setting is for CUDA alone
        if not getattr(self.backend, "graph_safe", False):
            log.warning("CUDA graphs need a graph-safe attention backend (triton); this runner has %s, and "
                        "runs every step eagerly", self.backend.name)
            return None
        if self.ranks is not None and not uses_nccl(self.device, self.ranks.tp.size):
            log.warning("CUDA graphs at tensor_parallel_size %d need a GPU per rank (NCCL; gloo cannot be "
                        "captured): every step runs eagerly", self.ranks.tp.size)
            return None
        return self.build_graphs(sizes, -(-max_model_len // self.block_size))

    @torch.inference_mode()
    def _capture_pieces(self, sizes: tuple[int, ...]) -> PiecewiseGraphs | None:
        """The pieces of steps with prompt tokens, where they can be captured (else None, logged)."""
        if self.device.type != "cuda":
            why = "they are for CUDA"
        elif not getattr(self.backend, "graph_safe", False):
            why = f"the {self.backend.name} attention backend is not graph-safe"
        elif self.ranks is not None:
            why = "they run on one rank (gloo cannot be captured)"
        else:
            why = unsupported(self.model)
        if why is not None:
            log.info("steps with prompt tokens run eagerly, not from piecewise CUDA graphs: %s", why)
            return None
        self.model.bind_caches(self._layer_caches, self.backend)
        try:
            return PiecewiseGraphs(self.model, sizes, self.device)
        except Exception:  # a piece that cannot be captured (one that syncs with the host)
            log.warning("capturing piecewise CUDA graphs failed: steps with prompt tokens run eagerly", exc_info=True)
            return None

    def build_graphs(self, sizes: tuple[int, ...], width: int, capture: bool = True) -> DecodeGraphs:
        """The decode graphs of ``sizes`` rows and block tables ``width`` wide, on every rank
        (``capture=False``: their static buffers alone, run eagerly: the CPU, in tests)."""
        self.model.bind_caches(self._layer_caches, self.backend)
        if self.ranks is None:
            return DecodeGraphs(self._logits, sizes, width, self.block_size, self.device, capture)
        self.ranks.graphs(sizes, width, self.block_size, capture)
        return self._on_ranks(DecodeGraphs, self._logits, sizes, width, self.block_size, self.device, capture,
                              self.ranks.graph_step)

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Every row's logits (T, V) float32: a decode step's forward, as a graph captures it."""
        return self.model.compute_logits(self.model(input_ids, positions, ctx))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> SampledTokens:
        host, tokens, sample_idx = self._host_inputs(out)
        self.model.bind_caches(self._layer_caches, self.backend)
        if self.lora is not None:
            self.lora.begin_step([item.seq.params.lora_name for item in out.seqs],
                                 [item.num_new_tokens for item in out.seqs])
        try:
            logits, prompt_lps = self._replay(out, host, tokens), {}
            if logits is None:
                logits, prompt_lps = self._forward(out, host, tokens, sample_idx)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self.num_forward_tokens += tokens.shape[0]
        sampled = [s for s in out.seqs if s.sample]
        if not sampled:
            return SampledTokens({}, prompt_logprobs=prompt_lps)
        if any(s.draft is not None for s in sampled):
            return self._verify_and_sample(logits, sampled, prompt_lps)
        return self._sample(logits, sampled, prompt_lps)

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq], prompt_lps: dict) -> SampledTokens:
        """Each sampled row's next token from its logits row (N, V)."""
        rows = [SamplerRow(s.seq.seq_id, s.seq.params, s.seq.token_ids, s.seq.num_prompt_tokens) for s in sampled]
        drawn = self.sampler(logits, rows)
        ids = [r.seq_id for r in rows if r.seq_id not in drawn.failed]
        return SampledTokens(dict(zip(ids, drawn.token_ids)), dict(zip(ids, drawn.logprobs)) if drawn.logprobs else {},
                             dict(zip(ids, drawn.top_logprobs)) if drawn.top_logprobs else {}, prompt_lps,
                             dict(drawn.failed))

    def _verify_and_sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq], prompt_lps: dict) -> SampledTokens:
        """A step with speculating rows: their logits (1 + k rows each) go to ``verify``, the
        others' (one row each) to the sampler as in any step."""
        plain, plain_rows, spec, spec_rows, end = [], [], [], [], 0
        for item in sampled:
            n = 1 + len(item.draft_token_ids)
            if item.draft is None:
                plain.append(item)
                plain_rows.append(end)
            else:
                spec.append(item)
                spec_rows.extend(range(end, end + n))
            end += n
        result = self._sample(self._rows(logits, plain_rows), plain, prompt_lps) if plain else SampledTokens(
            {}, prompt_logprobs=prompt_lps)
        kept, failed = self.verify(self.sampler, self._rows(logits, spec_rows), spec)
        result.failed.update(failed)
        for seq_id, tokens in kept.items():
            result.token_ids[seq_id] = tokens[-1]
            result.accepted[seq_id] = tokens[:-1]
        return result

    def _rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits``' rows ``rows`` (on its device, the indices copied there without a wait)."""
        [index] = to_device([torch.tensor(rows, dtype=torch.long)], logits.device)
        return logits.index_select(0, index)

    def _forward(self, out: SchedulerOutput, host: HostContext, tokens: torch.Tensor, sample_idx: torch.Tensor):
        """The step run eagerly: (logits (N, V) float32 of the N sampled rows, or None when
        none is sampled; the prompt logprobs it computed). The sampled rows' logits come first:
        the other ranks compute their slices of them right after the forward."""
        ctx, positions, (input_ids, sample_rows) = host.to(self.device, [tokens, sample_idx])
        hidden, logits = self._on_ranks(self._hidden, input_ids, positions, ctx, sample_rows)

        def row_logits(start: int, stop: int) -> torch.Tensor:
            if self.ranks is not None:
                self.ranks.logits(start, stop)
            return self.model.compute_logits(hidden[start:stop])

        prompt_lps = prompt_logprobs(lambda start, stop: self._on_ranks(row_logits, start, stop),
                                     self.cfg.vocab_size, out)
        return logits, prompt_lps

    def _replay(self, out: SchedulerOutput, host: HostContext, tokens: torch.Tensor) -> torch.Tensor | None:
        """A decode step's logits from its CUDA graph, every row sampled; None: run it eagerly."""
        if self.graphs is None or not host.ctx.is_decode or not all(item.sample for item in out.seqs):
            return None
        if self.lora is not None and self.lora.state.active:
            return None  # the graphs hold the base model's step alone
        return self._on_ranks(self.graphs.run, host, tokens)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                sample_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward on every rank (rank 0 hands the inputs over first), then the sampled rows'
        logits: (hidden (T, H), logits (S, V) float32 or None when no row is sampled)."""
        if self.ranks is not None:
            lora = None if self.lora is None else self.lora.step_lora()  # the step's adapters, if any
            self.ranks.step(input_ids, positions, ctx, sample_rows, lora)
        hidden = None
        if self.piecewise is not None and (self.lora is None or not self.lora.state.active):
            hidden = self.piecewise.run(input_ids, positions, ctx)  # None: more tokens than its sizes
        if hidden is None:
            hidden = self.model(input_ids, positions, ctx)
        return hidden, self.model.compute_logits(hidden[sample_rows]) if sample_rows.numel() else None

    def _on_ranks(self, fn, *args):
        """``fn(*args)``, which runs collectives with the other ranks: where it raises, they may be
        left between two of them, out of step for good, which is the worker's loss."""
        if self.ranks is None:
            return fn(*args)
        try:
            return fn(*args)
        except RankLost:
            raise
        except Exception as exc:
            raise self.ranks.lost(exc) from exc

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        """Packed token ids (T,), positions (T,), the step's ``AttentionContext`` and the rows
        to sample, on the device. Every input of the step goes there in one copy that the host
        does not wait for."""
        host, tokens, sample_idx = self._host_inputs(out)
        ctx, positions, (input_ids, sample_rows) = host.to(self.device, [tokens, sample_idx])
        return input_ids, positions, ctx, sample_rows

    def _host_inputs(self, out: SchedulerOutput) -> tuple[HostContext, torch.Tensor, torch.Tensor]:
        """The step's context and positions, token ids (T,) and rows to sample, on the host.
        Python touches each sequence once (its token slice and block table)."""
        items = out.seqs
        starts = [item.seq.num_computed_tokens for item in items]
        query_lens = [item.num_new_tokens for item in items]  # a speculating one's guesses included
        # A speculating sequence runs its newest token, then its guesses (not in its tokens yet).
        tokens = list(chain.from_iterable(item.seq.token_ids[s:s + n] + item.draft_token_ids if item.draft else
                                          item.seq.token_ids[s:s + n] for item, s, n in zip(items, starts, query_lens)))
        tables = [self.blocks.block_table(item.seq.seq_id) for item in items]
        host = host_context(starts, query_lens, tables, self.block_size, decode=not out.is_prefill)
        # The last token of each sampled sequence; every token of a speculating one (its
        # guesses are verified from the logits at each).
        sample_idx = list(chain.from_iterable(range(end - len(item.draft_token_ids) - 1, end)
                                              for end, item in zip(accumulate(query_lens), items) if item.sample))
        return host, torch.tensor(tokens, dtype=torch.long), torch.tensor(sample_idx, dtype=torch.long)
