"""Logging is configured in every pdserve process (pdserve/wire/logs.py), as text or JSON, and the
autoscaler's decisions reach the ``pdserve serve`` console with their inputs."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.wire.logs import JsonFormatter, LogConfig, LogConfigError, configure

ROOT = Path(__file__).resolve().parents[2]

# `pdserve serve` itself (pdserve.cli.main), with LocalCluster replaced by a stand-in that runs
# one real autoscaler round over an empty cluster (both pools below min_replicas: a scale-up
# each) and then presses Ctrl-C. No Ray, no model: what is tested is that the serve process
# configures logging from its settings, so the autoscaler's lines are printed.
SERVE_ONE_ROUND = """
import os, signal, sys, time
import pdserve.cluster.local
from pdserve.cluster.autoscaler import Autoscaler
from pdserve.cli import main

class OneRound:
    def __init__(self, config):
        self.config, self.address, self.http_address, self.admin_address = config, "127.0.0.1:1", None, "127.0.0.1:1"
    def addresses(self, pool): return []
    def push_membership(self): pass
    def scale_up(self, pool): pass
    def scale_down(self, pool): pass
    def drain(self, grace_s): return 0
    def stop_supervising(self): pass
    def ray_lost(self): return False
    def stop(self): pass
    def start(self):
        Autoscaler(self, self.config.autoscaling).step(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
        return self.address

pdserve.cluster.local.LocalCluster = OneRound
sys.exit(main(sys.argv[1:]))
"""


def test_the_autoscalers_decisions_appear_under_pdserve_serve_as_json(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("autoscaling:\n  prefill: {min_replicas: 1}\n  decode: {min_replicas: 1}\n")
    out = subprocess.run([sys.executable, "-c", SERVE_ONE_ROUND, "serve", "--config", str(config),
                          "--log-format", "json"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    decisions = [r for r in records if r["logger"] == "pdserve.cluster.autoscaler" and "'action': 'up'" in r["message"]]
    assert {r["process"] for r in decisions} == {"controller"}, out.stderr[-3000:]
    by_pool = {("prefill" if "'pool': 'prefill'" in r["message"] else "decode"): r["message"] for r in decisions}
    assert set(by_pool) == {"prefill", "decode"}, decisions
    assert "'current': 0" in by_pool["prefill"] and "'desired': 1" in by_pool["prefill"]
    assert "queued_prompt_tokens" in by_pool["prefill"] and "_target" in by_pool["prefill"]  # its inputs
    assert "kv_usage" in by_pool["decode"]


def test_json_lines_carry_level_process_logger_and_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x.y").makeRecord("x.y", logging.ERROR, __file__, 1, "failed %d", (3,),
                                                     sys.exc_info())
    line = json.loads(JsonFormatter("router").format(record))
    assert (line["level"], line["process"], line["logger"], line["message"]) == ("error", "router", "x.y", "failed 3")
    assert "ValueError: boom" in line["exception"] and line["time"].endswith("Z")


def test_configure_sets_the_level_and_replaces_its_own_handler(capsys):
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        configure(LogConfig("warning"), "prefill-0")
        configure(LogConfig("warning", "text"), "prefill-0")  # again: still one handler of ours
        assert len(root.handlers) == len(before) + 1
        logging.getLogger("t").info("hidden")
        logging.getLogger("t").warning("shown")
        err = capsys.readouterr().err
        assert "hidden" not in err and "prefill-0 WARNING t: shown" in err
    finally:
        root.handlers[:], root.level = before, level


def test_unknown_level_or_format_names_the_setting():
    with pytest.raises(LogConfigError, match="log_level"):
        LogConfig("loud")
    with pytest.raises(LogConfigError, match="log_format"):
        LogConfig(format="xml")
