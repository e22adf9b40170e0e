"""The ``pdserve`` command, the one entry point of the installed package.

    pdserve serve [MODEL]            start a local cluster (router + workers as Ray actors)
    pdserve status --address RAY     the endpoints and processes of a cluster on a Ray cluster
    pdserve stop --address RAY       drain and stop it
    pdserve rollout --address RAY --pool POOL   restart every process of a pool in turn, losing no request
    pdserve rollout --address RAY --verify-kv on|off   the same for every worker, to a new verify_kv_transfers
    pdserve generate "PROMPT"        stream a completion from a running cluster
    pdserve worker --role ROLE       one role as a plain process, without Ray (pdserve/cluster/worker_cli.py)
    pdserve plan                     size prefill and decode pools (simulated; pdserve/planner/)
    pdserve profile                  fit the CPU cost profile to this machine's engine

It sits above every subpackage: the cluster's commands and the planner's register here, so
that ``pdserve.cluster`` needs nothing of ``pdserve.planner`` (which imports the cluster's
autoscaling policies).
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster import cli as cluster_cli
from pdserve.cluster import worker_cli
from pdserve.planner import cli as planner_cli


# Commands whose parsers need none of ``serve``'s or ``worker``'s settings: for them those two
# parsers are added without their flags, whose defaults import torch (1.5-2 s a run).
LIGHT_COMMANDS = frozenset({"generate", "status", "stop", "rollout", "set-role", "plan", "profile"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has no option with a value
    heavy = command not in LIGHT_COMMANDS
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {cluster_cli.version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = cluster_cli.add_commands(sub, serve_settings=heavy)
    planner_cli.add_plan_parser(sub)
    planner_cli.add_profile_parser(sub)
    worker_cli.add_worker_parser(sub, settings=heavy)
    commands.update(plan=planner_cli.run_plan, profile=planner_cli.run_profile, worker=worker_cli.run_worker,
                    serve=lambda args: cluster_cli.serve(args, choose_layout=_choose_layout))
    args = parser.parse_args(argv)
    return commands[args.command](args)


def _choose_layout(s):
    """``pdserve serve --layout auto``'s chooser: the planner's, imported only when auto runs,
    handed the settings it reads (``s``: ``pdserve.cluster.typed_settings.ServeSettings``)."""
    from pdserve.planner.auto_layout import choose_for_settings

    layout = s.layout
    return choose_for_settings({"model": s.engine.model, "layout_ttft_slo_s": layout.layout_ttft_slo_s,
                                "layout_tpot_slo_s": layout.layout_tpot_slo_s,
                                "layout_prompt_tokens": layout.layout_prompt_tokens,
                                "layout_output_tokens": layout.layout_output_tokens,
                                "kv_cache": s.engine.cache_config(), "dtype": s.engine.dtype})


if __name__ == "__main__":
    sys.exit(main())
