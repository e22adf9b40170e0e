"""The roles an elastic worker can hold, and the core of it that takes each role's new requests.

- ``prefill``: its prefill core (``PrefillWorker``) takes prompts for the decode pool.
- ``decode``: its decode core (``DecodeWorker``) takes streams, their KV read from a prefill worker
  (or prefilled on it when the router's conditional disaggregation says so).
- ``mixed``: its decode core takes streams, and the router lets it prefill the ones it takes
  itself, as a colocated worker does (``pdserve.router.local_prefill``). A decode worker's
  ``Decode`` call already prefills with ``local_prefill``: decode <-> mixed changes no core.

Plain constants, so that the controller reads them without loading an engine.
"""

ROLES = ("prefill", "decode", "mixed")
CORE = {"prefill": "prefill", "decode": "decode", "mixed": "decode"}
# The pool whose slots, KV and streams a role's worker counts in (the router's ``SERVES``).
POOL = {"prefill": "prefill", "decode": "decode", "mixed": "decode"}
# How long a decode role's streams may finish on their own when the worker leaves that role
# (a switch, or retiring from the cluster) before they move with their KV to the rest of the
# pool: a move costs a stream tens of milliseconds, so no switch waits for its longest answer.
HAND_OVER_AFTER_S = 1.0
