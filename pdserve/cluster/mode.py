"""How a cluster splits the two phases of a request (``pdserve serve --mode``).

- ``disaggregated``: a prefill pool computes each prompt's KV, a decode pool pulls it and
  streams the tokens (the router may still let a decode worker prefill a short prompt:
  conditional disaggregation, pdserve/router/local_prefill.py).
- ``colocated``: no prefill pool; each worker prefills its own requests, the prompt's chunks
  mixed into its decode steps, as vLLM and SGLang run without disaggregation. The same
  engine and CLI, so a comparison of the two changes one thing.
"""

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
MODES = (DISAGGREGATED, COLOCATED)
