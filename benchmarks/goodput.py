"""Goodput against request rate (issue 14): the load generator (benchmarks/load) sweeps Poisson
(or, with --burstiness, gamma) arrival rates against one server and prints, per rate, the
requests per second that meet both a TTFT and a TPOT SLO (DistServe's goodput).

    .venv/bin/python benchmarks/goodput.py --rates 0.5,1,2                  # starts `pdserve serve`
    .venv/bin/python benchmarks/goodput.py --rates 0.5,1,2 -- --mode colocated   # serve flags after --
    .venv/bin/python benchmarks/goodput.py --base-url http://127.0.0.1:8000 --rates 1,2
    .venv/bin/python benchmarks/goodput.py --slo-from .bench/goodput/disagg/goodput.json -- --mode colocated
    .venv/bin/python benchmarks/goodput.py --compare A/goodput.json B/goodput.json [--plot P]  # runs side by side

Without --base-url it starts `pdserve serve --port P --grpc-port G` (the `pdserve` beside this
interpreter, this checkout's code on PYTHONPATH) with the flags after `--`, waits for /health,
runs the sweep, and stops the server's whole process tree, also on error or Ctrl-C.

SLOs. DistServe's chatbot SLOs (OPT-13B on A100s, ShareGPT) are TTFT 0.25 s and TPOT 0.1 s.
They are a small multiple of that model's unloaded latencies on that hardware: a decode step of
OPT-13B reads its 26 GB of fp16 weights at about 2 TB/s, 13 ms at the floor and some 25 ms in
practice, so 0.1 s is about 4x; a chat prompt's prefill takes some tens of ms, so 0.25 s is
about 5x (our estimates, not DistServe's numbers). A 135M model on two shared CPU cores is
nowhere near those absolute times, so the SLOs are scaled, not copied: this script measures the
server's unloaded TTFT and TPOT (p50 of --calibration-requests requests of the same workload,
one at a time) and sets SLO = --ttft-scale (5) x unloaded TTFT and --tpot-scale (4) x unloaded
TPOT. --slo-ttft-ms/--slo-tpot-ms set them directly; --slo-from reuses another run's SLOs, so
two servers (disaggregated, colocated) are judged by the same objectives.

The default workload is the chat mix with outputs scaled down (chat-prompt, chat-output:0.25:
log-normal, means 161 and ~85 tokens) so a sweep fits in minutes on this machine.

Writes --out-dir/goodput.json (SLO and how it was set, per rate the load generator's summary)
and goodput.png (goodput and SLO attainment against rate). The calibration runs first in any
case (its unloaded latencies are recorded) after --warmup (8) unmeasured requests one at a time,
since a fresh server's first requests are slower; the rates then run without warm-up, each with
its own prompts (see sweep), so no rate finds the previous one's prompts in a prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.load import SLO, Arrivals, WorkloadError, run  # noqa: E402
from benchmarks.load.metrics import percentile, tpot, ttft  # noqa: E402
from benchmarks.load.runner import json_safe  # noqa: E402
from benchmarks.loadgen import add_workload_args, spec_from_args  # noqa: E402
from benchmarks.serving_procs import ServerProcess  # noqa: E402

HOST = "127.0.0.1"
RATE_SEED_STRIDE = 1000  # rate i runs with --seed + 1000 * (i + 1); calibration with --seed


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def pdserve_server(args, extra: list[str]) -> ServerProcess:
    http, grpc = args.port or free_port(), args.grpc_port or free_port()
    cmd = [str(args.pdserve_bin), "serve", "--port", str(http), "--grpc-port", str(grpc), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return ServerProcess("pdserve", cmd, env, HOST, [http, grpc], args.out_dir / "server.log")


def calibrate(args, base_url: str) -> dict:
    """The server's unloaded latencies on this workload, and the SLOs scaled from them. It
    runs first, whatever sets the SLOs: its --warmup requests warm the server for the sweep."""
    spec = spec_from_args(args, num_requests=args.calibration_requests, arrivals=Arrivals("closed", concurrency=1))
    done = [r for r in run(spec, base_url, progress=False).records if r.ok]
    if not done:
        raise SystemExit("calibration: no request completed")
    ttft_ms = percentile([ttft(r) * 1000 for r in done], 50)
    tpot_ms = percentile([p * 1000 for p in map(tpot, done) if p is not None], 50)
    return {"how": f"{args.ttft_scale:g} x unloaded TTFT p50, {args.tpot_scale:g} x unloaded TPOT p50 "
                   f"({len(done)} requests one at a time)",
            "unloaded_ttft_ms": ttft_ms, "unloaded_tpot_ms": tpot_ms,
            "ttft_ms": args.ttft_scale * ttft_ms, "tpot_ms": args.tpot_scale * tpot_ms}


def choose_slo(args, base_url: str) -> dict:
    measured = calibrate(args, base_url)
    unloaded = {k: measured[k] for k in ("unloaded_ttft_ms", "unloaded_tpot_ms")}
    if args.slo_from:
        prior = json.loads(args.slo_from.read_text())["slo"]
        return {**prior, **unloaded, "how": f"from {args.slo_from}: {prior['how']}"}
    if args.slo_ttft_ms is not None:
        return {**unloaded, "how": "given", "ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    return measured


def sweep(args, base_url: str, slo: SLO) -> list[dict]:
    rows = []
    for i, rate in enumerate(tqdm(args.rates, desc="rates", unit="rate", disable=args.no_progress)):
        # Each rate its own prompts (same lengths' distribution): with one seed, every rate
        # after the first would find its prompts in the server's prefix cache. Seeds depend
        # on the rate's position only, so two servers swept alike see the same requests.
        spec = spec_from_args(args, slo, seed=args.seed + RATE_SEED_STRIDE * (i + 1), warmup=0)
        spec = replace(spec, arrivals=replace(spec.arrivals, rate=rate))
        results = run(spec, base_url, progress=not args.no_progress)
        rows.append({"rate": rate, **asdict(results.summary), "records": results.to_dict()["records"]})
        tqdm.write(line(rows[-1]))
    return rows


def line(row: dict) -> str:
    return (f"rate {row['rate']:6.2f} req/s: goodput {row['goodput_req_s']:5.2f} req/s "
            f"({100 * row['slo_attainment']:3.0f}% meet the SLO), throughput {row['req_s']:5.2f} req/s "
            f"{row['output_tok_s']:6.1f} tok/s, TTFT p50/p99 {row['ttft_ms']['p50']:7.1f}/{row['ttft_ms']['p99']:7.1f} "
            f"ms, TPOT p50/p99 {row['tpot_ms']['p50']:6.1f}/{row['tpot_ms']['p99']:6.1f} ms, "
            f"ITL p99 {row['itl_ms']['p99']:6.1f} ms, failed {row['failed']}")


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in doc["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rates, [r["goodput_req_s"] for r in doc["rows"]], marker="o", label="goodput")
    a.plot(rates, [r["req_s"] for r in doc["rows"]], marker=".", linestyle=":", label="throughput")
    a.plot(rates, rates, color="grey", linewidth=0.8, label="offered")
    a.set_xlabel("request rate (req/s)")
    a.set_ylabel("req/s")
    a.legend()
    b.plot(rates, [100 * r["slo_attainment"] for r in doc["rows"]], marker="o")
    b.set_ylim(0, 105)
    b.set_xlabel("request rate (req/s)")
    b.set_ylabel("% of requests meeting TTFT and TPOT SLOs")
    slo = doc["slo"]
    fig.suptitle(f"{doc['label']}: SLO TTFT {slo['ttft_ms']:.0f} ms, TPOT {slo['tpot_ms']:.1f} ms")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare(paths: list[Path], plot_path: Path | None) -> str:
    """Several sweeps' goodput.json (one SLO, the same rates) side by side: a markdown table of
    goodput (attainment) per rate, the last run against the best of the others, and a plot of
    goodput and ITL p99 against rate."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    rates = [r["rate"] for r in docs[0]["rows"]]
    def objective(d: dict) -> tuple:  # the SLO itself, not the unloaded latencies each run measured
        return d["slo"]["ttft_ms"], d["slo"]["tpot_ms"]

    if any([r["rate"] for r in d["rows"]] != rates for d in docs) or any(objective(d) != objective(docs[0]) for d in docs):
        raise SystemExit("--compare: the runs need the same rates and the same SLO")
    head = " | ".join(d["label"] for d in docs)
    out = [f"| rate req/s | {head} | {docs[-1]['label']} / best other |", "|" + "---|" * (len(docs) + 2)]
    for i, rate in enumerate(rates):
        cells = [f"{d['rows'][i]['goodput_req_s']:.2f} ({100 * d['rows'][i]['slo_attainment']:.0f}%)" for d in docs]
        best = max(d["rows"][i]["goodput_req_s"] for d in docs[:-1])
        ratio = docs[-1]["rows"][i]["goodput_req_s"] / best if best else float("nan")
        out.append(f"| {rate:g} | {' | '.join(cells)} | {ratio:.2f}x |")
    if plot_path is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for d in docs:
            a.plot(rates, [r["goodput_req_s"] for r in d["rows"]], marker="o", label=d["label"])
            b.plot(rates, [r["itl_ms"]["p99"] for r in d["rows"]], marker="o", label=d["label"])
        a.plot(rates, rates, color="grey", linewidth=0.8, label="offered")
        a.set_ylabel("goodput (req/s meeting both SLOs)")
        b.set_ylabel("ITL p99 (ms)")
        for ax in (a, b):
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        slo = docs[0]["slo"]
        fig.suptitle(f"SLO TTFT {slo['ttft_ms']:.0f} ms, TPOT {slo['tpot_ms']:.1f} ms")
        fig.tight_layout()
        fig.savefig(plot_path, dpi=90)
        plt.close(fig)
    return "\n".join(out)


def parse_args(argv):
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="an existing server (without /v1); default: start pdserve")
    ap.add_argument("--rates", default="0.5,1,2", help="comma-separated requests/s")
    add_workload_args(ap)
    # warm-up: a fresh server's first requests run slower (first-touch of KV pages, first use of
    # each shape), which would inflate the unloaded latencies the SLOs are scaled from
    ap.set_defaults(num_requests=24, prompt_len="chat-prompt", output_len="chat-output:0.25", warmup=8)
    ap.add_argument("--calibration-requests", type=int, default=4)
    ap.add_argument("--ttft-scale", type=float, default=5.0)
    ap.add_argument("--tpot-scale", type=float, default=4.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-from", type=Path, default=None, help="a goodput.json whose SLO to reuse")
    ap.add_argument("--pdserve-bin", type=Path, default=Path(sys.executable).parent / "pdserve")
    ap.add_argument("--port", type=int, default=0, help="HTTP port of the started server (0: a free one)")
    ap.add_argument("--grpc-port", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--label", default=None, help="names the run in the plot (default: the serve flags)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "goodput")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(own)
    if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
        ap.error("--slo-ttft-ms and --slo-tpot-ms go together")
    if args.concurrency is not None:
        ap.error("--concurrency: a goodput sweep varies the open-loop rate; use --max-concurrency to cap it")
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rates: {args.rates!r} is not comma-separated numbers")
    if not args.rates or min(args.rates) <= 0:
        ap.error("--rates: needs at least one rate, each > 0")
    if args.base_url and extra:
        ap.error(f"serve flags {extra} given with --base-url: they only apply to a server this script starts")
    try:
        spec_from_args(args)  # a bad workload flag fails here, before a server starts
    except WorkloadError as exc:
        ap.error(str(exc))
    args.label = args.label or (" ".join(["pdserve serve", *extra]) if not args.base_url else args.base_url)
    return args, extra


def main(argv: list[str] | None = None) -> int:
    from benchmarks.processor import print_banner

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--compare":  # --compare A/goodput.json B/goodput.json ... [--plot P]: no serving
        paths = argv[1:argv.index("--plot")] if "--plot" in argv else argv[1:]
        print(compare([Path(p) for p in paths], Path(argv[argv.index("--plot") + 1]) if "--plot" in argv else None))
        return 0

    print_banner()  # the processor and kernel path every figure below ran on
    args, extra = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    loadavg_start = os.getloadavg()  # the machine is shared: what else ran, before and after
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            server = stack.enter_context(pdserve_server(args, extra))
            print(f"starting {' '.join(server.cmd)}", flush=True)
            startup = server.wait_healthy(args.startup_timeout, lambda t: None)
            print(f"healthy after {startup:.0f} s", flush=True)
            base_url = f"http://{HOST}:{server.port}"
        slo_doc = choose_slo(args, base_url)
        slo = SLO(slo_doc["ttft_ms"], slo_doc["tpot_ms"])
        print(f"SLO: TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.1f} ms ({slo_doc['how']})", flush=True)
        rows = sweep(args, base_url, slo)
    doc = {"schema": "pdserve-goodput/1", "label": args.label, "base_url": base_url, "serve_flags": extra,
           "loadavg": {"start": loadavg_start, "end": os.getloadavg()}, "workload": asdict(spec_from_args(args, slo)), "slo": slo_doc, "rows": rows}
    out = args.out_dir / "goodput.json"
    out.write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    plot(doc, args.out_dir / "goodput.png")
    print("\n".join(line(r) for r in rows))
    print(f"wrote {out} and {args.out_dir / 'goodput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
