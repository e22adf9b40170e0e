"""Which proposer a ``SpeculativeConfig`` names, built for one engine."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.proposer import Proposer


def make_proposer(spec: SpeculativeConfig, engine_config: EngineConfig, model_cfg: ModelConfig) -> Proposer:
    """The proposer of ``spec.method``: ``ngram`` (a lookup in the sequence itself) or
    ``draft_model`` (a small model of the target's vocabulary, loaded beside it)."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from pdserve.engine.spec.draft import DraftProposer  # built on its own branch (issue 57)

        return DraftProposer.from_config(spec, engine_config, model_cfg)
    raise ValueError(f"speculative method must be ngram or draft_model, got {spec.method!r}")
