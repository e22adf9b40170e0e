"""RoPE's inverse frequencies (pdserve/engine/layers/rotary.py) against transformers' own, bit for
bit: the tables built from them are what every attention layer rotates by."""

import pytest
import torch

from pdserve.engine.layers.rotary import RotaryEmbedding, inverse_frequencies


@pytest.mark.parametrize("head_dim,theta,factor", [(64, 10000.0, 8.0), (256, 1_000_000.0, 8.0), (128, 5e5, 2.5)])
def test_linear_scaling_divides_every_frequency_as_transformers_does(head_dim, theta, factor):
    """``linear`` (Gemma 3's global layers): transformers' frequencies, then ``/= factor``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": theta})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["linear"](config, torch.device("cpu"))
    ours = inverse_frequencies(head_dim, theta, {"rope_type": "linear", "factor": factor})
    assert attention_factor == 1.0 and torch.equal(ours, theirs)
    torch.testing.assert_close(ours * factor, inverse_frequencies(head_dim, theta, None))


def test_linear_scaling_slows_the_rotation_by_its_factor():
    """Position 8p of a factor-8 table turns as far as position p of the unscaled one."""
    scaled = RotaryEmbedding(64, 4096, 10000.0, {"type": "linear", "factor": 8.0})
    plain = RotaryEmbedding(64, 4096, 10000.0)
    positions = torch.tensor([0, 1, 7, 100])
    cos_scaled, _ = scaled.tables(positions * 8, torch.float32)
    cos_plain, _ = plain.tables(positions, torch.float32)
    torch.testing.assert_close(cos_scaled, cos_plain, rtol=1e-4, atol=1e-4)
