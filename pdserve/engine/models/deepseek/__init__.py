"""The DeepSeek-V2 / V2-Lite / V3 family: latent attention (model.py), DeepSeek's mixture of
experts with shared experts and grouped routing (moe.py), and its config.json (config.py)."""

from pdserve.engine.models.deepseek.config import read_config
from pdserve.engine.models.deepseek.model import DeepseekForCausalLM
from pdserve.engine.models.family import Family

FAMILY = Family(architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                model_types=("deepseek_v2", "deepseek_v3"), model=DeepseekForCausalLM, read_config=read_config)
