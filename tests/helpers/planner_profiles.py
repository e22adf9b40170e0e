"""The planner tests' model and hardware: SmolLM2-135M on one CPU core (tests/planner)."""

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import get_model

SMOL = get_model("SmolLM2-135M")
# One CPU core as the stored profile measures one (round numbers near profiles/cpu.json's): a
# 256-token prompt's prefill takes about 0.7 s, a decode step of a few streams some 15 ms.
CORE = HardwareProfile("core", peak_flops=1e11, flops_efficiency=1.0, peak_mem_bw=3e10, mem_bw_efficiency=1.0,
                       mem_bytes=1.3e9, kv_link_bw=1e10, kv_transfer_overhead_s=0.012, interconnect_bw=1e10,
                       step_overhead_s=0.003, seq_overhead_s=0.0009, overlap=False)
