"""Which class builds each supported model family, by the config's ``model_type``.

One entry per family (``SUPPORTED_ARCHITECTURES`` in config.py names the architectures a
checkpoint may declare): the class builds the layers at a tensor-parallel rank's sizes and
knows how the checkpoint's tensor names map onto them. A family with its own file registers
here; nothing else dispatches on the family.
"""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.deepseek import DeepseekForCausalLM
from pdserve.engine.model import CausalLM
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.qwen3 import Qwen3ForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,  # Llama, Mistral, Qwen2, SmolLM: model.py
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": Qwen3ForCausalLM,  # qwen3.py: per-head q/k norm
    "qwen3_moe": Qwen3ForCausalLM,  # and routed experts (moe.py)
    "deepseek_v2": DeepseekForCausalLM,  # deepseek.py: latent attention (MLA), DeepSeek's MoE
    "deepseek_v3": DeepseekForCausalLM,
}


def build_model(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> CausalLM:
    """An unfilled model of ``cfg``'s family holding ``tp``'s share (build it on the meta
    device, then ``load_hf_weights``)."""
    return FAMILIES[cfg.model_type](cfg, tp)


def check_split(cfg: ModelConfig, size: int) -> None:
    """Raise ``ShardError`` (naming the field and ``size``) unless ``size`` tensor-parallel
    ranks split this model evenly: what building its family's model would raise, without one."""
    tp = TensorParallel(0, size)
    for n, what in FAMILIES[cfg.model_type].split_dims(cfg):
        tp.share(n, what)
