"""``pdserve serve --layout``: from the setting to the mode, pool sizes and elastic flags the
cluster starts with, before its config is built.

A named layout sets its mode (and, for ``elastic``, elastic roles with the role budget). ``auto``
(the default) asks a chooser, the planner's ``choose_for_settings`` that ``pdserve.cli`` hands
in (the planner sits above the cluster, so this package never imports it), which simulates the
layouts this machine can run and returns the settings of the best one. Auto steps aside, said
so in its log lines, wherever its prediction would not describe what starts: a layout setting
given (by flag, variable or file: the user's word wins), a Ray cluster joined by address (its
cores are not this machine's), a GPU (the stored profile is a CPU's), autoscaling (the pools
resize themselves), tensor parallelism or fixed threads per worker (the candidates run one
worker a core).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from pdserve.cluster.mode import AUTO, COLOCATED, DISAGGREGATED, ELASTIC
from pdserve.cluster.typed_settings import LayoutSettings, ServeSettings

# The settings that spell a layout one by one (``LayoutSettings`` fields); any of them given
# turns ``auto`` off.
LAYOUT_SETTINGS = ("mode", "prefill", "decode", "elastic_roles", "role_budget")
# Settings under which the planner's candidates (one single-threaded worker a core) are not what starts.
_AUTO_OFF = ("address", "autoscaling", "tensor_parallel_size", "prefill_tp", "decode_tp", "threads_per_worker")

# (settings) -> (the chosen layout's ``LayoutSettings`` fields, by name; log lines)
Chooser = Callable[[ServeSettings], tuple[dict[str, Any], list[str]]]

NAMED = {DISAGGREGATED: {"mode": DISAGGREGATED}, COLOCATED: {"mode": COLOCATED},
         ELASTIC: {"mode": DISAGGREGATED, "elastic_roles": True, "role_budget": True}}


def apply_layout(s: ServeSettings, given: frozenset[str], choose: Chooser | None,
                 gpu: Callable[[], bool] = lambda: False) -> tuple[ServeSettings, list[str]]:
    """``s`` with ``--layout`` applied (new settings; ``s`` is left as it is) and the lines to
    log. A layout setting given (``--mode`` ...) beats a named layout too, said so: the
    narrower word wins, whatever source each came from."""
    layout = s.layout
    if layout.layout != AUTO:
        named = NAMED[layout.layout]
        kept = [k for k, val in named.items() if k in given and getattr(layout, k) != val]
        lines = [f"layout {layout.layout} (given)"] + (
            [f"layout {layout.layout}: {', '.join(f'{k}={getattr(layout, k)!r}' for k in kept)} given, and kept"]
            if kept else [])
        return _with(s, {k: val for k, val in named.items() if k not in given}), lines
    explicit = [k for k in LAYOUT_SETTINGS if k in given]
    if explicit:
        return s, [f"layout auto: {', '.join(explicit)} given, so they set the layout"]
    why = _why_not_auto(s, given, choose, gpu)
    if why:
        return s, [f"layout auto: {why}; the default layout ({layout.prefill}P:{layout.decode}D)"]
    chosen, lines = choose(s)
    return _with(s, chosen), [f"layout auto: {line}" for line in lines]


def _with(s: ServeSettings, fields: dict[str, Any]) -> ServeSettings:
    """``s`` with these layout fields replaced (a name that is no ``LayoutSettings`` field raises)."""
    layout: LayoutSettings = dataclasses.replace(s.layout, **fields)
    return dataclasses.replace(s, layout=layout)


def _why_not_auto(s: ServeSettings, given: frozenset[str], choose: Chooser | None,
                  gpu: Callable[[], bool]) -> str | None:
    if choose is None:
        return "no planner to choose with"
    off = [k for k in _AUTO_OFF if k in given or (k == "autoscaling" and s.autoscaling is not None)]
    if off:
        return f"{', '.join(off)} set, which the simulated candidates do not describe"
    if gpu():
        return "a GPU is present, and the stored profile is a CPU's"
    return None
