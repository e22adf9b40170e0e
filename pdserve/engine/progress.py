"""How far this process's engines have got inside their steps: decoder layers computed.

A worker's liveness (pdserve/router/liveness.py) reads progress from its ``Stats`` answers. Steps
alone are too coarse: one prefill step of 2,048 tokens of long prompts took more than the
router's 10 s no-progress bound on an AVX2-only EPYC (Zen 3) core, so a busy worker read as hung
and its prompts moved to a decode worker that then had to prefill them all. Layers are fine
enough on any processor (a layer is a thirtieth of a step or less), and a wedged forward pass
or a stopped process still computes none.

The count is the layers run in Python (``DecoderStack`` and the families' own loops call
``layer_done``) plus those the CPU kernels' whole-stack call ran (``decoder_layers_done``).
On a GPU a Python layer is counted when it is queued, not when it has run; the step's end
(the engine's step count) is what shows there that the device moves.
"""

from __future__ import annotations

_python_layers = 0


def layer_done() -> None:
    """One decoder layer computed (or queued on a device) by Python code."""
    global _python_layers
    _python_layers += 1  # a lost increment under a race only delays a reading by a layer


def layers_done() -> int:
    """Decoder layers this process has computed since it started, every engine together."""
    from pdserve.engine.kernels import cpu_kernels

    kernels = cpu_kernels.torch_ops().decoder_layers_done() if cpu_kernels.is_loaded() else 0
    return _python_layers + kernels
