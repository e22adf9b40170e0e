"""The DeepSeek-V2 / V2-Lite / V3 family: latent attention (model.py), DeepSeek's mixture of
experts with shared experts and grouped routing (moe.py), and its config.json (config.py)."""

from pdserve.engine.models.deepseek.config import read_config
from pdserve.engine.models.deepseek.model import DeepseekForCausalLM
from pdserve.engine.models.family import Family

FAMILY = Family(architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
                model_types=("deepseek_v2", "deepseek_v3"), model=DeepseekForCausalLM, read_config=read_config,
                published={
                    # MLA (q_lora 1536, kv_lora 512, RoPE 64, no-RoPE 128, v 128); the first 3 layers dense,
                    # then 256 routed experts, top 8 in the best 4 of 8 groups, and 1 shared expert. Its
                    # multi-token-prediction layer (num_nextn_predict_layers) is not served.
                    "DeepSeek-V3": dict(
                        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, n_group=8, topk_group=4,
                        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
                        rope_theta=10000, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=1,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
                })
