"""Load generator for pdserve's own benchmarks (issue 14); works against any OpenAI-compatible
server. It streams completions and reports TTFT, TPOT and ITL at p50/p90/p99, throughput and
goodput (requests/s meeting both a TTFT and a TPOT SLO, DistServe's definition).

    .venv/bin/python benchmarks/loadgen.py --base-url http://127.0.0.1:8000 --rate 2 -n 32
    .venv/bin/python benchmarks/loadgen.py --rate 4 --burstiness 0.5 \\
        --prompt-len chat-prompt --output-len chat-output:0.25          # bursty, long-tailed chat mix
    .venv/bin/python benchmarks/loadgen.py --concurrency 8 -n 48           # closed loop
    .venv/bin/python benchmarks/loadgen.py --shared-prefix 8:1500 --prompt-len uniform:16:48 --rate 1
    .venv/bin/python benchmarks/loadgen.py --api-key "$KEY_B" --flood-api-key "$KEY_A" --rate 1 -n 32

Arrivals: --rate R alone is Poisson (open loop, ``inf`` sends all at once); --burstiness K
makes the gaps gamma with shape K and the same mean (K < 1 burstier, as vllm bench serve);
--concurrency C is a closed loop of C clients; --max-concurrency caps an open loop in flight.
Lengths (--prompt-len, --output-len): fixed:N, uniform:LOW:HIGH, lognormal:MEAN:SIGMA[:MIN:MAX],
chat-prompt[:SCALE] / chat-output[:SCALE] (log-normal with ShareGPT's means, 161 and 338
tokens, sigma 1.0 and 0.8, means scaled by SCALE). --shared-prefix N:L puts one of N system
prompts of L tokens (round robin) before each request's own prompt.
Prompts are random token ids from --token-range (exact lengths) or, with --text, words. The
same --seed gives the same prompts: a server with a prefix cache answers a repeated run from
its cache, so give each run its own seed unless the cache is what you measure.

--api-key sends a key (``Authorization: Bearer``). --flood-api-key KEY measures tenant
isolation (docs/security.md#tenants; benchmarks/load/flood.py): the workload runs alone, then
again while the tenant of KEY floods the server with --flood-concurrency clients (past its
limits in the server's --api-keys-file), and the report gives the measured tenant's TTFT p50
both ways, their ratio, and the flood's 429s.

Writes --out-dir/loadgen.json (spec, summary, every request's record; times in seconds from
the start, latencies in the summary in ms) and loadgen.png (TTFT / TPOT / ITL CDFs and output
tokens per second); with --flood-api-key, tenant_flood.json (both runs and the flood's counts)
and the plot of the run under the flood.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.load import (SLO, Arrivals, SharedPrefix, WorkloadError, WorkloadSpec,  # noqa: E402
                             parse_lengths, run)
from benchmarks.load.flood import FloodSpec, isolation  # noqa: E402
from benchmarks.load.report import plot, text, write_json  # noqa: E402
from benchmarks.load.runner import json_safe  # noqa: E402


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload flags, shared with benchmarks/goodput.py."""
    ap.add_argument("-n", "--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s of an open loop; inf: all at once")
    ap.add_argument("--burstiness", type=float, default=None,
                    help="gamma arrivals with this shape (1 = Poisson, < 1 burstier)")
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop)")
    ap.add_argument("--prompt-len", default="fixed:256")
    ap.add_argument("--output-len", default="fixed:64")
    ap.add_argument("--shared-prefix", default=None, metavar="N:L", help="N system prompts of L tokens")
    ap.add_argument("--text", action="store_true", help="text prompts (words) instead of token ids")
    ap.add_argument("--token-range", default="1000:10000", metavar="LOW:HIGH", help="ids prompts draw from here")
    ap.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _pair(text: str, name: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise WorkloadError(name, f"{text!r} is not two integers A:B")
    return int(parts[0]), int(parts[1])


def spec_from_args(args, slo: SLO | None = None, **overrides) -> WorkloadSpec:
    """A WorkloadSpec from the flags of ``add_workload_args``; ``overrides`` replace fields."""
    if args.concurrency is not None:
        arrivals = Arrivals("closed", concurrency=args.concurrency)
    else:
        kind = "poisson" if args.burstiness is None else "gamma"
        arrivals = Arrivals(kind, rate=args.rate, burstiness=args.burstiness or 1.0,
                            max_concurrency=args.max_concurrency)
    prefix = SharedPrefix(*_pair(args.shared_prefix, "shared_prefix")) if args.shared_prefix else None
    fields = dict(num_requests=args.num_requests, arrivals=arrivals,
                  prompt_len=parse_lengths(args.prompt_len, "prompt_len"),
                  output_len=parse_lengths(args.output_len, "output_len"), shared_prefix=prefix,
                  prompt_format="text" if args.text else "ids", token_range=_pair(args.token_range, "token_range"),
                  model=args.model, ignore_eos=not args.no_ignore_eos, slo=slo, warmup=args.warmup, seed=args.seed,
                  request_timeout_s=args.timeout)
    return WorkloadSpec(**{**fields, **overrides})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    add_workload_args(ap)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "loadgen")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--api-key", default=None, help="the key every request sends (Authorization: Bearer)")
    ap.add_argument("--flood-api-key", default=None,
                    help="measure tenant isolation: run alone, then under a flood from this key's tenant")
    ap.add_argument("--flood-concurrency", type=int, default=32, help="the flood's clients (closed loop)")
    ap.add_argument("--flood-pause-s", type=float, default=None,
                    help="a flood client's wait after a 429 (default: its Retry-After, as OpenAI's clients do; "
                         "0: hammer)")
    args = ap.parse_args(argv)
    if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
        ap.error("--slo-ttft-ms and --slo-tpot-ms go together (goodput needs both)")
    if math.isnan(args.rate):
        ap.error("--rate: must be a number of requests/s or inf")
    try:
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms is not None else None
        spec = spec_from_args(args, slo)
    except WorkloadError as exc:
        ap.error(str(exc))
    if args.flood_api_key:
        return _isolation(args, spec)
    results = run(spec, args.base_url, progress=not args.no_progress, api_key=args.api_key)
    print(text(results))
    out = write_json(results, args.out_dir / "loadgen.json")
    print(f"wrote {out}" + ("" if args.no_plot else f" and {plot(results, args.out_dir / 'loadgen.png')}"))
    return 0 if results.summary.failed == 0 else 1


def _isolation(args, spec) -> int:
    """--flood-api-key: the measured run alone and under the flood, compared."""
    flooder = FloodSpec(args.flood_api_key, args.flood_concurrency, args.flood_pause_s)
    result = isolation(spec, args.base_url, args.api_key, flooder, progress=not args.no_progress)
    print(text(result.flooded))
    print(result.text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "tenant_flood.json"
    out.write_text(json.dumps(json_safe(result.to_dict()), indent=1))
    print(f"wrote {out}" + ("" if args.no_plot else f" and {plot(result.flooded, args.out_dir / 'loadgen.png')}"))
    return 0 if result.alone.summary.failed == 0 and result.flooded.summary.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
