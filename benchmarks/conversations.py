"""Multi-turn conversations (issue 44): what a follow-up turn costs when its decode worker keeps
the conversation's KV, against pdserve with that reuse off and against vLLM, in one run.

    bash benchmarks/peers/setup_vllm.sh          # vLLM's venv (the peer); hf_dir.py runs if needed
    .venv/bin/python benchmarks/conversations.py                      # 8 x 6, all three servers
    .venv/bin/python benchmarks/conversations.py --servers pdserve,pdserve-noreuse \\
        --conversations 2 --turns 3 --answer-tokens 16:24             # a quick check

Traffic (seeded, identical for every server): ``--conversations`` conversations, the i-th
starting at i / ``--rate`` s, each of ``--turns`` turns. A turn is an OpenAI streaming
``/v1/chat/completions`` request (``stream_options.include_usage``, temperature 0,
``min_tokens`` = ``max_tokens`` drawn from ``--answer-tokens``, so every server streams the
same lengths); its user message is ``--message-tokens`` random one-token words; the next turn
goes when the answer has streamed in full, with the messages so far, the answer's text as the
assistant's message, and a new user message.

Why ``min_tokens`` and not ``ignore_eos``: a chat model told to ignore its end token writes
``<|im_end|>`` and goes on with a made-up next turn; the streamed text drops those special
tokens, so the next turn's prompt, re-tokenized from the text, parts from the ids the server
generated at the first of them (about 100 tokens into an answer here) and every server recomputes
the rest (the first run of this benchmark did). ``min_tokens`` keeps the end token from being drawn
at all, so an answer's text re-tokenizes to its ids, as a real chat's answer (which ends at its
end token) does.

Servers, one at a time, each started and stopped here (benchmarks/serving_run.py's helpers):
``pdserve`` as ``make serve`` starts it (1 prefill + 1 decode worker, defaults: decode KV reuse
on), ``pdserve-noreuse`` (``--no-decode-kv-reuse``: follow-ups are prefilled by the prefill pool
and their KV moved, as before issue 44), and ``vllm`` (colocated, prefix caching on, its best
dtype here: bfloat16 with AVX-512 BF16 or AMX, else float32; ``--vllm-dtype``).

Per turn index, and pooled over turns 2 onward: TTFT p50/p99, ITL p50/p99 (gaps between
output chunks), prompt tokens computed (usage ``prompt_tokens`` less
``prompt_tokens_details.cached_tokens``), the new message's length (words drawn, and prompt
tokens added since the previous turn's prompt and answer), and for pdserve the KV bytes its
workers moved (``pdserve:kv_transfer_bytes_total``, summed over every worker's /metrics, as
``/metrics/targets`` lists them): the run's total and mean per turn, and per turn index the
mean over the turns that had the cluster to themselves (no other turn in flight; a low
``--rate`` or ``--conversations 1`` gives many). Ratios against vLLM, a JSON in
benchmarks/results/ and a plot in docs/benchmarks/ (TTFT and computed tokens by turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import processor  # noqa: E402
from benchmarks.conversations_report import plot, print_tables, ratios, summarize  # noqa: E402
from benchmarks.load.client import parse_event  # noqa: E402
from benchmarks.load.workload import WORDS, parse_lengths  # noqa: E402
from benchmarks.peers.hf_dir import PEERS, build as build_hf_dir  # noqa: E402
from benchmarks.serving_run import HOST, git_state, pdserve_server, start, vllm_server  # noqa: E402

SCHEMA = "pdserve-conversations-benchmark/1"
ARMS = ("pdserve", "pdserve-noreuse", "vllm")
NO_REUSE_FLAG = "--no-decode-kv-reuse"
MAX_MODEL_LEN = 8192  # the default model's own limit (pdserve's default); a conversation outgrows 2048


@dataclass(frozen=True)
class Conversation:
    start_s: float
    messages: tuple[str, ...]  # one user message a turn
    words: tuple[int, ...]  # their lengths, in one-token words
    answers: tuple[int, ...]  # max_tokens a turn


def conversations(args) -> list[Conversation]:
    """The seeded traffic: the same for every server."""
    rng = random.Random(args.seed)
    out = []
    for i in range(args.conversations):
        words = tuple(args.message_tokens.sample(rng, args.turns))
        answers = tuple(args.answer_tokens.sample(rng, args.turns))
        text = tuple(" ".join(rng.choice(WORDS) for _ in range(n)) for n in words)
        out.append(Conversation(i / args.rate, text, words, answers))
    return out


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    words: int
    max_tokens: int
    sent: float = 0.0  # seconds from the run's start
    chunks: list[float] = field(default_factory=list)  # arrivals of chunks with output
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server reported none
    completion_tokens: int | None = None
    kv_bytes: float | None = None  # moved while it ran, when no other turn was in flight
    overlapped: bool = False
    error: str | None = None


class KVBytes:
    """pdserve's ``kv_transfer_bytes_total`` summed over every worker /metrics/targets lists."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session, self.base_url, self.targets = session, base_url, []

    async def discover(self) -> None:
        async with self.session.get(f"{self.base_url}/metrics/targets") as resp:
            self.targets = [t for entry in await resp.json() for t in entry["targets"]]
        if not self.targets:
            raise RuntimeError("pdserve's /metrics/targets lists no worker")

    async def total(self) -> float:
        return sum(await asyncio.gather(*(self._one(t) for t in self.targets)))

    async def _one(self, target: str) -> float:
        async with self.session.get(f"http://{target}/metrics") as resp:
            text = await resp.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:kv_transfer_bytes_total"))


async def chat(session, url: str, model: str, messages: list[dict], turn: Turn, t0: float) -> None:
    """Stream one turn into ``turn``: chunk times, answer text, usage; errors into ``turn.error``."""
    body = {"model": model, "messages": messages, "max_tokens": turn.max_tokens, "temperature": 0,
            "min_tokens": turn.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    turn.sent = time.perf_counter() - t0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                turn.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for line in resp.content:
                event = parse_event(line)
                if event is None:
                    continue
                if "error" in event:
                    turn.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        turn.chunks.append(time.perf_counter() - t0)
                        turn.text += content
                if usage := event.get("usage"):
                    turn.prompt_tokens, turn.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    finally:
        turn.end = time.perf_counter() - t0


class InFlight:
    """Which turns ran alone: a turn that started or ended while another was in flight is
    marked ``overlapped`` (its KV-byte delta would mix in the other's)."""

    def __init__(self):
        self.turns: set[int] = set()
        self.by_id: dict[int, Turn] = {}

    def enter(self, turn: Turn) -> None:
        self._touch(turn)
        self.turns.add(id(turn))
        self.by_id[id(turn)] = turn

    def leave(self, turn: Turn) -> None:
        self.turns.discard(id(turn))
        self._touch(turn)

    def _touch(self, turn: Turn) -> None:
        if self.turns:
            turn.overlapped = True
            for other in self.turns:
                self.by_id[other].overlapped = True


async def converse(session, url, model, conv: Conversation, index: int, t0: float, kv: KVBytes | None,
                   flight: InFlight, bar) -> list[Turn]:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    messages, turns = [], []
    for k, (text, words, answer) in enumerate(zip(conv.messages, conv.words, conv.answers)):
        turn = Turn(index, k + 1, words, answer)
        messages.append({"role": "user", "content": text})
        flight.enter(turn)
        before = await kv.total() if kv else None
        await chat(session, url, model, messages, turn, t0)
        after = await kv.total() if kv else None
        flight.leave(turn)
        if kv and not turn.overlapped:
            turn.kv_bytes = after - before
        turns.append(turn)
        bar.update(1)
        if turn.error:
            bar.update(len(conv.messages) - k - 1)  # the conversation ends here
            break
        messages.append({"role": "assistant", "content": turn.text})
    return turns


async def drive(base_url: str, model: str, plan: list[Conversation], pdserve: bool, bar) -> dict:
    """Run every conversation against one server; its turns and (pdserve) the KV bytes moved."""
    url = f"{base_url}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        kv = None
        if pdserve:
            kv = KVBytes(session, base_url)
            await kv.discover()
        warm = Turn(-1, 0, 4, 8)  # unmeasured: the first request's one-off costs
        await chat(session, url, model, [{"role": "user", "content": "Hello there, how are you?"}], warm, 0.0)
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        total_before = await kv.total() if kv else None
        t0, flight = time.perf_counter(), InFlight()
        runs = await asyncio.gather(*(converse(session, url, model, c, i, t0, kv, flight, bar)
                                      for i, c in enumerate(plan)))
        wall = time.perf_counter() - t0
        total_after = await kv.total() if kv else None
    turns = [t for run in runs for t in run]
    return {"wall_s": wall, "turns": turns,
            "kv_bytes_total": None if kv is None else total_after - total_before}


def pick_vllm_dtype(flags: list[str]) -> str:
    """vLLM's best on this processor: bfloat16 where it has bf16 instructions, else float32."""
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def server_for(arm: str, args, reuse_flag: bool = True):
    """The arm's server, built by benchmarks/serving_run.py's helpers, with this benchmark's flags."""
    if arm == "vllm":
        server = vllm_server(args)
        server.cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
                       "--enable-prompt-tokens-details"]
    else:
        server = pdserve_server(args)
        if arm == "pdserve-noreuse" and reuse_flag:
            server.cmd.append(NO_REUSE_FLAG)
    server.name, server.log = arm, args.out_dir / f"{arm}_server.log"
    return server


def pdserve_has_reuse_flag(args) -> bool:
    out = subprocess.run([str(args.pdserve_bin), "serve", "--help"], capture_output=True, text=True).stdout
    return NO_REUSE_FLAG in out


def run_arm(arm: str, args, plan: list[Conversation], bar, step, reuse_flag: bool = True) -> dict:
    server = server_for(arm, args, reuse_flag)
    with server:
        startup, attempts = start(args, server, step)
        model = server.served_model()
        step(f"{arm}: healthy after {startup:.0f} s, serving '{model}'")
        bar.set_postfix_str(arm)
        base = f"http://{HOST}:{server.port}"
        got = asyncio.run(drive(base, model, plan, arm != "vllm", bar))
        step(f"{arm}: stopping")
    turns = got.pop("turns")
    return {"command": server.cmd, "startup_s": round(startup, 1), "start_attempts": attempts,
            "served_model": model, **got, **summarize(turns, got["kv_bytes_total"]),
            "turns": [turn_row(t) for t in turns]}


def turn_row(t: Turn) -> dict:
    """A turn as the results file keeps it (no chunk times: the summary has their percentiles)."""
    row = {k: v for k, v in asdict(t).items() if k not in ("chunks", "text")}
    return row | {"ttft_s": round(t.chunks[0] - t.sent, 4) if t.chunks else None, "chunks": len(t.chunks)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(ARMS), help=f"comma-separated, in this order; of {', '.join(ARMS)}")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rate", type=float, default=0.5, help="conversations started per second (a fixed rate)")
    ap.add_argument("--answer-tokens", default="uniform:128:512", help="max_tokens a turn (benchmarks/load lengths)")
    ap.add_argument("--message-tokens", default="uniform:16:64", help="one-token words in a user message")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pdserve-bin", type=Path, default=Path(sys.executable).parent / "pdserve")
    ap.add_argument("--pdserve-port", type=int, default=8300, help="pdserve's HTTP port")
    ap.add_argument("--pdserve-grpc-port", type=int, default=50351)
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_PEER_VENV", PEERS / "vllm-venv")))
    ap.add_argument("--hf-dir", type=Path, default=PEERS / "smollm2-hf")
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 with AVX-512 BF16 or AMX, else float32")
    ap.add_argument("--vllm-threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--start-attempts", type=int, default=3)
    ap.add_argument("--tag", default=None, help="names the outputs; default: the pdserve kernel path")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "conversations", help="server logs")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON; default benchmarks/results/conversations-TAG-DATE.json")
    ap.add_argument("--plot", type=Path, default=None, help="default docs/benchmarks/conversations-TAG-DATE.png")
    ap.add_argument("--note", default="", help="what else ran on the machine, stored with the results")
    args = ap.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers or set(args.servers) - set(ARMS):
        ap.error(f"--servers: {args.servers}; known: {', '.join(ARMS)}")
    for name in ("conversations", "turns"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if not args.rate > 0:
        ap.error(f"--rate: must be > 0 conversations/s, got {args.rate}")
    args.answer_tokens = parse_lengths(args.answer_tokens, "answer_tokens")
    args.message_tokens = parse_lengths(args.message_tokens, "message_tokens")
    return args


def new_doc(args, machine: dict) -> dict:
    doc = {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
           "machine": {**machine, "shared_note": args.note, "loadavg_before": os.getloadavg()},
           "workload": {"conversations": args.conversations, "turns": args.turns, "rate": args.rate,
                        "answer_tokens": asdict(args.answer_tokens), "message_tokens": asdict(args.message_tokens),
                        "seed": args.seed, "min_tokens": "= max_tokens", "temperature": 0},
           "vllm_dtype": args.vllm_dtype, "arms": {}}
    doc["reuse_flag"] = pdserve_has_reuse_flag(args) if "pdserve-noreuse" in args.servers else None
    if doc["reuse_flag"] is False:
        print(f"[conversations] this pdserve has no {NO_REUSE_FLAG}: it predates issue 44 and never reuses a "
              "decode worker's KV, so both pdserve arms run it as it is", flush=True)
    return doc


def run_all(args, doc: dict) -> None:
    """Every arm in turn, into ``doc["arms"]``; on failure what was measured goes to a partial file."""
    plan, t0 = conversations(args), time.monotonic()

    def step(msg: str) -> None:
        tqdm.write(f"[conversations {time.monotonic() - t0:5.0f} s] {msg}")

    try:
        with tqdm(total=len(args.servers) * args.conversations * args.turns, desc="turns", unit="turn") as bar:
            for arm in args.servers:
                doc["arms"][arm] = run_arm(arm, args, plan, bar, step, doc["reuse_flag"] is not False)
    except BaseException:  # the servers are stopped by now
        partial = args.out_dir / "conversations.partial.json"
        partial.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"[conversations] failed or interrupted; what was measured: {partial}", file=sys.stderr, flush=True)
        raise


def main() -> None:
    machine = processor.print_banner()
    args = parse_args()
    args.vllm_dtype = args.vllm_dtype or pick_vllm_dtype(machine["flags"])
    if "vllm" in args.servers:
        if not (args.vllm_venv / "bin" / "vllm").exists():
            sys.exit(f"missing {args.vllm_venv / 'bin' / 'vllm'}: run bash benchmarks/peers/setup_vllm.sh")
        if not (args.hf_dir / "config.json").exists():
            build_hf_dir(args.hf_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C and SIGTERM stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc = new_doc(args, machine)
    run_all(args, doc)
    doc["machine"]["loadavg_after"] = os.getloadavg()
    doc["ratios_over_vllm"] = ratios(doc)
    print_tables(doc)
    tag = args.tag or (machine["kernel_path"] or "torch").replace("_", "")
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = args.out or ROOT / "benchmarks" / "results" / f"conversations-{tag}-{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    png = args.plot or ROOT / "docs" / "benchmarks" / f"conversations-{tag}-{day}.png"
    plot(doc, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
