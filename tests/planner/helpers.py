"""Builders shared by the planner tests: a cost model with round numbers, requests, clusters."""

from __future__ import annotations

from pdserve.planner.cost import CostModel
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.layout import ClusterSpec, Layout
from pdserve.planner.simulator import Simulator
from pdserve.planner.trace import TraceRequest
from pdserve.planner.worker import EngineLimits

# A small model on a made-up device with round numbers, so expected times are easy to write.
TINY = ModelSpec("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, max_model_len=4096)
DEVICE = HardwareProfile("dev", peak_flops=1e11, flops_efficiency=1.0, peak_mem_bw=1e9, mem_bw_efficiency=1.0,
                         mem_bytes=1e9, kv_link_bw=1e8, kv_transfer_overhead_s=1e-3, interconnect_bw=1e9,
                         step_overhead_s=1e-3, overlap=True)


def cost(tp: int = 1, hw: HardwareProfile = DEVICE) -> CostModel:
    return CostModel(TINY, hw, tp)


def requests(*specs: tuple[float, int, int]) -> list[TraceRequest]:
    """(arrival, prompt tokens, output tokens) triples."""
    return [TraceRequest(t, p, o) for t, p, o in specs]


def simulate(layout: Layout, reqs: list[TraceRequest], limits: EngineLimits = EngineLimits(), autoscaler=None,
             closed_loop: int | None = None, hw: HardwareProfile = DEVICE, **spec_kw):
    spec = ClusterSpec(layout, cost(layout.tp_prefill, hw), cost(layout.tp_decode, hw), limits, **spec_kw)
    return Simulator(spec, reqs, autoscaler, closed_loop=closed_loop).run()
