"""How a cluster splits the two phases of a request (``pdserve serve --mode``).

- ``disaggregated``: a prefill pool computes each prompt's KV, a decode pool pulls it and
  streams the tokens (the router may still let a decode worker prefill a short prompt:
  conditional disaggregation, pdserve/router/local_prefill.py).
- ``colocated``: no prefill pool; each worker prefills its own requests, the prompt's chunks
  mixed into its decode steps, as vLLM and SGLang run without disaggregation. The same
  engine and CLI, so a comparison of the two changes one thing.

``--layout`` names a whole layout (mode, and elastic roles or not); ``auto``, the default,
chooses one by simulation where no layout flag is given.
"""

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
MODES = (DISAGGREGATED, COLOCATED)

# ``pdserve serve --layout``: ``auto`` lets the planner pick one of the others for this machine
# at start (pdserve/planner/auto_layout.py; pdserve/cluster/layout_choice.py applies it);
# ``elastic`` is the disaggregated layout with elastic roles and the role budget.
AUTO, ELASTIC = "auto", "elastic"
LAYOUTS = (AUTO, DISAGGREGATED, COLOCATED, ELASTIC)
