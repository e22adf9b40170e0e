"""The engine: a model, its paged KV cache, a scheduler and a model runner.

``step()`` is the whole loop body: schedule -> run -> postprocess. Requests enter with
``add_request`` (token ids in; the serving layers tokenize) and leave through the outputs of
``step`` or through ``abort``. Two entry points exist for disaggregation: a prefill-only
request (``hold_kv=True``) stops after its first token in state HELD, keeping its KV
blocks until ``free_held`` (or ``abort``); a prefilled request (``add_prefilled``) gets
blocks for KV that another worker computed and joins the decode batch on ``kv_ready``.
A decoding request can leave the same way a prefill-only one does (``hold_running``): HELD,
its KV kept for another worker, which takes it up with ``add_prefilled`` (an elastic worker
changing role hands its streams over so, ``pdserve.elastic_worker``).

With ``tensor_parallel_size`` N > 1 this is rank 0 of N processes (``pdserve.engine.distributed.group``):
the other ranks only run each step's forward on their shares; ``close`` stops them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Sequence as Seq

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import capture_sizes
from pdserve.engine.errors import InvalidRequestError, RankLost, SequenceFailed
from pdserve.engine.sampling.grammar_jobs import GrammarJobs, compiler_for
from pdserve.engine.attention.kv_cache import cache_spec_of
from pdserve.engine.kv_tier.engine_tier import build_kv_tier
from pdserve.engine.lora.manager import LoRAManager, fingerprint_of, users_of
from pdserve.engine.memory import MemoryProbe
from pdserve.engine.runner.memory_profile import size_cache, start_memory
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.core.outputs import Completion, RequestOutput, error_output, generate_all, token_output
from pdserve.engine.core.request_state import RequestState
from pdserve.engine.request_checks import check_first_token, check_here
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.core.sequence import FinishReason, Sequence, SeqStatus
from pdserve.engine.core.step_isolation import isolate_or_abort
from pdserve.engine.core.step_trace import StepShape
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.engine.distributed.group import FOLLOWER_ENTRY, RankGroup, exit_worker, load_on_ranks
from pdserve.engine.spec.decoding import SpecDecoding
from pdserve.engine.spec.proposer import SpecStats

log = logging.getLogger(__name__)


class LLMEngine:
    """``detokenize=False`` builds no detokenizer: outputs carry token ids only and stop
    strings are refused. Workers run so, since the router detokenizes (and applies stop
    strings) for the client once, across prefill and decode. ``model_dir``: where to load a
    tokenizer from when a structured-output request needs one and ``tokenizer`` is None."""

    def __init__(self, model: CausalLM, model_cfg: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None = None, detokenize: bool = True, model_dir: str | None = None,
                 ranks: RankGroup | None = None, memory: MemoryProbe | None = None):
        """``ranks``: the other ranks of a tensor-parallel worker (``from_config`` starts them);
        ``memory``: where a cache sized by a share of the device is measured (None: the model's device)."""
        self.config = config
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.detokenize = detokenize and tokenizer is not None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(config.max_model_len or model_cfg.max_model_len, model_cfg.max_model_len)
        self.ranks = ranks
        self.tensor_parallel_size = model.tp.size
        self.cache_spec = cache_spec_of(model_cfg, config.cache.block_size, self.dtype, self.tensor_parallel_size)
        self.cache_size = size_cache(model, model_cfg, self.cache_spec, config, self.max_model_len, memory, ranks)
        num_blocks = self.cache_size.num_blocks
        log.info(self.cache_size.line())
        shared = ranks is not None and ranks.caches is not None  # rank 0's part of every rank's caches
        self.kv_cache = ranks.caches[0] if shared else self.cache_spec.allocate(num_blocks, self.device)
        self.blocks = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_cache)
        self.kv_tier = build_kv_tier(config, model, model_cfg, self.kv_cache, self.blocks)  # None: off (kv_tier/)
        eos = model_cfg.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer and tokenizer.eos_token_id is not None else ())
        self.lora = None if config.lora is None else LoRAManager(model, config.lora, self.dtype, self.device, ranks)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, tuple(eos), config.lora)
        graph_sizes = capture_sizes(config.scheduler.max_num_seqs) if config.cuda_graphs else ()
        # Speculative decoding (``config.speculative``; None: off): pdserve/engine/spec/decoding.py.
        self.spec = SpecDecoding.of(config, model_cfg, self.max_model_len)
        self.runner = ModelRunner(model, model_cfg, self.kv_cache, self.blocks, config.attention_backend, config.seed,
                                  graph_sizes, self.max_model_len, ranks, self.spec and self.spec.verify, self.lora,
                                  config.scheduler.max_num_batched_tokens if config.cuda_graphs else 0)
        self.runner.sampler.eos_token_ids = frozenset(eos)  # banned before min_tokens
        self._requests: dict[str, RequestState] = {}  # every request not yet ended, by id
        # Requests with a structured spec wait in ``grammars`` for its compile, off this thread
        # (``RequestState.kv_landed`` and ``unfit`` say where they stand meanwhile).
        self.grammars = GrammarJobs(compiler_for(tokenizer, model_dir, model_cfg.vocab_size, eos))
        self._pending: list[RequestOutput] = []  # outputs made between steps (a request ended there)
        # With ``keep_step_shape``, each step leaves what it ran in ``last_step_shape`` (a step
        # trace reads it); off, a step computes nothing for it.
        self.keep_step_shape = False
        self.last_step_shape: StepShape | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True, detokenize: bool = True,
                    on_rank_lost: Callable[[RankLost], None] = exit_worker,
                    memory: MemoryProbe | None = None, follower_entry: str = FOLLOWER_ENTRY) -> "LLMEngine":
        """Load the model named in ``config`` (weights, tokenizer) and build the engine; with
        ``tensor_parallel_size`` > 1, on its ranks (``distributed.group.load_on_ranks``: ``on_rank_lost``
        is what a lost rank does, by default end this process; ``follower_entry`` the module the
        other ranks run, a worker's serving each rank's KV-transfer agent); ``memory``: as ``__init__``'s."""
        with start_memory(config, memory) as memory:  # the device's turn: until the engine is built
            model, model_cfg, model_dir, ranks = load_on_ranks(config, progress, on_rank_lost, follower_entry, memory)
            # Without detokenizing, the tokenizer is needed only when the model config names no EOS.
            tokenizer = Tokenizer(model_dir) if detokenize or not model_cfg.eos_token_ids else None
            return cls(model, model_cfg, config, tokenizer, detokenize, str(model_dir), ranks, memory)

    @property
    def rank_caches(self) -> tuple[torch.Tensor, ...]:
        """Each tensor-parallel rank's cache, rank 0's first (``RankGroup.rank_caches``): what
        the worker's KV-transfer agents register, one each. One rank: its cache."""
        return (self.kv_cache,) if self.ranks is None else self.ranks.rank_caches()

    def close(self, graceful: bool = True) -> None:
        """Stop the other ranks of a tensor-parallel worker (``graceful``: no step runs, they are
        told to stop; else they are killed); write the blocks the KV tier holds pending."""
        if self.ranks is not None:
            self.ranks.close(graceful)
        if self.kv_tier is not None:
            self.kv_tier.close()

    # ---- requests ------------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` naming the field and the limit it breaks: the cheap
        checks that protect this engine (the router validated the request as a whole once,
        ``pdserve.engine.sampling.params.validate_request``). A structured spec is compiled after
        this, off the engine thread (``grammars``); one that does not compile ends its request
        with that error as its output (``SequenceFailed``), before it ever joins a batch."""
        check_here(prompt_token_ids, params, self.model_cfg.vocab_size, self.max_model_len, self.blocks,
                   self.detokenize, () if self.lora is None else self.lora)

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    hold_kv: bool = False) -> None:
        """Queue a request. ``hold_kv``: prefill only, keep the KV for a transfer."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, hold_kv=hold_kv,
                       lora_fingerprint=fingerprint_of(self.lora, params))
        if params.structured is None:
            self.scheduler.add(seq)
        else:
            self.grammars.submit(request_id, params.structured)  # joins the scheduler once compiled
        self._track(seq)

    def add_prefilled(self, request_id: str, prompt_token_ids: Seq[int], first_token: int,
                      params: SamplingParams, reuse_cached: bool = False) -> list[int]:
        """Register a request whose prompt KV another worker computed; return the block ids
        the KV must be written into. It decodes from ``first_token`` once ``kv_ready``.
        ``reuse_cached``: the leading blocks this engine's prefix cache holds are reused, and
        only the blocks past ``num_cached_tokens(request_id)`` need writing."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        check_first_token(first_token, self.model_cfg.vocab_size)
        seq = Sequence(request_id, list(prompt_token_ids) + [first_token], params,
                       num_prompt_tokens=len(prompt_token_ids), lora_fingerprint=fingerprint_of(self.lora, params))
        block_ids = self.scheduler.add_remote_prefilled(seq, reuse_cached)
        if params.structured is not None:
            self.grammars.submit(request_id, params.structured)  # its KV arrives meanwhile
        state = self._track(seq)
        if state.detok is not None:
            state.detok.add(first_token)  # its text was streamed by the prefill side
        return block_ids

    def num_cached_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of ``request_id`` whose KV the prefix cache gave it."""
        return self._requests[request_id].seq.num_cached_tokens

    def kv_ready(self, request_id: str, first_token: int | None = None) -> None:
        """The prompt's KV has landed; it decodes from the next step (once its grammar, if it
        has one, is compiled). ``first_token``: the token ``add_prefilled`` was given as a
        placeholder (streamed KV learns it last). A first token out of the vocabulary, or a
        grammar that did not compile, ends the request here: its output on the next step
        carries the error (its KV has landed, so its blocks are free to go)."""
        state = self._requests[request_id]
        seq, error, state.unfit = state.seq, state.unfit, None
        if first_token is not None and error is None:
            try:
                check_first_token(first_token, self.model_cfg.vocab_size)
            except InvalidRequestError as exc:
                error = SequenceFailed.of(request_id, exc)
        if error is not None:
            self._pending.append(self._fail(seq, error))
            return
        if first_token is not None:
            seq.token_ids[seq.num_prompt_tokens] = first_token
            if state.detok is not None:
                state.detok = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
                state.detok.add(first_token)
        if request_id in self.grammars:
            state.kv_landed = True  # it joins the batch with its grammar (_admit_compiled)
            return
        self.scheduler.kv_ready(request_id)

    def prompt_progress(self, request_id: str) -> int | None:
        """Tokens of a prompt whose KV is in its blocks now; None while it has no blocks yet
        (queued) or once it is gone."""
        seq = self._seq(request_id)
        return seq.num_computed_tokens if seq is not None and self.blocks.has(request_id) else None

    def _track(self, seq: Sequence) -> RequestState:
        detok = IncrementalDetokenizer(self.tokenizer, seq.params.stop) if self.detokenize else None
        state = self._requests[seq.seq_id] = RequestState(seq, detok)
        return state

    def _seq(self, request_id: str) -> Sequence | None:
        state = self._requests.get(request_id)
        return None if state is None else state.seq

    def abort(self, request_id: str, quarantine: Seq[int] = ()) -> bool:
        """Stop a request wherever it is and free its blocks, but quarantine ``quarantine``
        (blocks a cancelled read may still write: ``BlockManager.free``). False if it is unknown."""
        seq = self._seq(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT, quarantine)
        self._forget(seq)
        return True

    def held_block_ids(self, request_id: str) -> list[int]:
        """Block ids of a HELD request (prefill done, KV kept for another worker)."""
        seq = self._seq(request_id)
        if seq is None or not seq.is_held:
            raise KeyError(request_id)
        return list(self.blocks.block_table(request_id))

    def hold_running(self, request_id: str) -> tuple[list[int], int] | None:
        """Stop a decoding request here and keep its KV (HELD, as a prefill-only request after
        its first token), so that another worker reads it and decodes on from the newest
        token. Returns the blocks that hold the KV, in token order, and how many tokens they
        hold: all but the newest, which is sampled and not yet computed. None (nothing
        changes) unless the request is decoding with exactly that much computed: a prompt
        still computing, KV still arriving, or a preempted sequence has nothing whole to move."""
        seq = self._seq(request_id)
        if seq is None or seq.status is not SeqStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens - 1:
            return None
        self.scheduler.hold(seq)
        computed = seq.num_computed_tokens
        return list(self.blocks.block_table(request_id))[:self.blocks.blocks_needed(computed)], computed

    def free_held(self, request_id: str) -> bool:
        """Free the KV of a HELD request (after its transfer, abort or lease end). False if
        ``request_id`` is not HELD."""
        seq = self._seq(request_id)
        return seq is not None and seq.is_held and self.abort(request_id)

    @property
    def num_held(self) -> int:
        return sum(1 for state in self._requests.values() if state.seq.is_held)

    # ---- LoRA adapters (docs/lora.md) -----------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` as ``name`` (``InvalidRequestError``s: ``LoRAManager.add``)."""
        LoRAManager.of(self.lora).add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Unload ``name``; False if it is not loaded; refused while requests use it (``LoRAManager.remove``)."""
        return self.lora is not None and self.lora.remove(name, users_of(name, self._requests.values()))

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else self.lora.names()

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or len(self.grammars) > 0 or bool(self._pending)

    def has_runnable(self) -> bool:
        """True when a ``step`` would run or hand out something (sequences waiting for KV or
        for their grammar do not count; a grammar just compiled, or an output made between
        steps, does)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending or self.grammars.has_done())

    def step(self) -> list[RequestOutput]:
        """Run one step.

        A fault the sampler pins on one sequence (its grammar, its penalties, NaN logits)
        ends that sequence alone: its output has finish reason "error" and ``error`` set,
        and the other sequences get exactly the tokens they would have got without it.

        A step that raises is run again in parts (``pdserve.engine.core.step_isolation``): a
        sequence that raises alone ends alone, the same way; the others go on with the tokens
        they would have got. If no part runs, nothing pins the fault on any of them: they
        are aborted, their blocks freed, and ``StepFailed`` names them; the engine goes on
        with everything else.

        With nothing to run but grammars compiling, it first waits for one of them (a
        caller that steps in a loop, as ``generate`` does, neither spins nor steps empty); an
        engine thread never finds it so (it steps only when ``has_runnable``)."""
        self._admit_compiled()
        if not self.has_runnable() and len(self.grammars):
            self.grammars.wait()
            self._admit_compiled()
        out = self.scheduler.schedule(self.spec and self.spec.propose)
        self.last_step_shape = StepShape.of(out) if self.keep_step_shape and not out.empty else None
        if out.empty:
            return self._take_pending()
        started = time.perf_counter()
        try:
            sampled = self.runner.run(out)
        except RankLost:
            raise  # the worker is lost as a whole: no part of the step can run again
        except Exception as exc:
            sampled = isolate_or_abort(self.runner.run, out, exc, self._requests, self.abort)
        self.scheduler.observe_step(out, time.perf_counter() - started)  # the time-sized chunk's input
        errors = self._end_failed(sampled.failed)
        lengths = {item.seq.seq_id: item.seq.num_tokens for item in out.seqs if item.draft is not None}
        self.scheduler.update_from_output(out, sampled)
        if self.spec is not None:
            self.spec.observe(out, sampled)
        return self._take_pending() + errors + self._postprocess(out, lengths)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler (or, with their KV landed, the
        decode batch); those whose compile failed or ran past its deadline end."""
        for request_id, result in self.grammars.done():
            state = self._requests.get(request_id)
            if state is None:
                continue
            seq = state.seq
            if isinstance(result, InvalidRequestError):
                error = SequenceFailed.of(request_id, result)
                if seq.status is SeqStatus.WAITING_FOR_KV and not state.kv_landed:
                    state.unfit = error  # its KV is still arriving: it ends on kv_ready
                else:
                    self._pending.append(self._fail(seq, error))
                continue
            self.runner.sampler.attach(request_id, result, seq.params.structured.resumed_tokens)
            if seq.status is not SeqStatus.WAITING_FOR_KV:
                self.scheduler.add(seq)
            elif state.kv_landed:
                state.kv_landed = False
                self.scheduler.kv_ready(request_id)

    def _take_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _end_failed(self, failed: dict[str, SequenceFailed]) -> list[RequestOutput]:
        """Finish each sequence whose own fault the step found, with its error."""
        return [self._fail(self._requests[rid].seq, error) for rid, error in failed.items() if rid in self._requests]

    def _fail(self, seq: Sequence, error: SequenceFailed) -> RequestOutput:
        """End ``seq`` with finish reason "error": its last output, which carries ``error``."""
        log.warning("request %s ended alone: %s", seq.seq_id, error)
        self.scheduler.finish(seq, FinishReason.ERROR)
        self._forget(seq)
        return error_output(seq, error)

    def _postprocess(self, out: SchedulerOutput, lengths: dict[str, int]) -> list[RequestOutput]:
        """Each sampled sequence's output: its new tokens (several for a speculating one, whose
        token count before the step is in ``lengths``), their text, and its end."""
        results = []
        for item in out.seqs:
            seq = item.seq
            state = self._requests.get(seq.seq_id)
            if not item.sample or state is None:
                continue
            num_new = seq.num_tokens - lengths.get(seq.seq_id, seq.num_tokens - 1)
            text, hit_stop = state.text_of(seq.token_ids[seq.num_tokens - num_new:], seq)
            if hit_stop and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP)
            results.append(token_output(seq, text, num_new))
            if seq.is_finished:
                self._forget(seq)
            elif seq.is_held:  # stays (HELD) until freed (free_held, abort); nothing samples it again
                state.detok = None
                self.runner.sampler.forget(seq.seq_id)
        return results

    def _forget(self, seq: Sequence) -> None:
        self._requests.pop(seq.seq_id, None)
        self.runner.sampler.forget(seq.seq_id)
        self.grammars.cancel(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)

    # ---- convenience ---------------------------------------------------------------
    def generate(self, prompts: Iterable[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 progress: bool = False) -> list[Completion]:
        """Run the given prompts to completion, batched; outputs in prompt order."""
        return generate_all(self.add_request, self.step, prompts, params, progress)

    # ---- observability -------------------------------------------------------------
    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculation's counters since start (None: it is off)."""
        return self.spec.stats if self.spec is not None else None

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

