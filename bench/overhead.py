"""Rounds bound by overhead: eager against compiled (specdec/compiled.py), in-process against the running service,
the engine's time per round outside the forwards, and Hugging Face `generate` and assisted generation on the
same models, side by side (assisted generation both as it runs with scikit-learn installed, refitting its
confidence threshold every round, and without, the threshold fixed; "vs HF assisted" is against the faster).
Greedy, gamma 4, the model drafter, token verification; generated tokens only. Methods: target-only, Google, and
Google with the draft's confidence stop at 0.4 (HF assisted generation's default threshold: like for like).

    python -m bench.overhead                          # the tests' tiny pair (rounds bound by per-operation cost)
    python -m bench.overhead --pair default --tokens 64 --repeats 2   # the default pair (`make models`)

Each configuration loads the pair as the service does (`load_pair`, with `compile` false or true) and starts
`python serving.py` with the same settings beside it; then, `--repeats` times after one warm-up, it decodes the
prompt in-process and times `POST /predict` from the client, JSON and SSE, one after the other (paired, so that
the machine's drift falls on all alike), then the HTTP floor (bench/floor.py: the same wait and answer through
gunicorn's gevent worker with no service in it), what any service built this way pays on this machine. Writes
results.json and results.md to --out.
"""

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.floor import FloorServer
from bench.machine import machine_info
from bench.methods import MODES, run_hf
from bench.stress import Server, save_pair
from specdec import SpeculativeDecoder
from specdec.models.pair import load_pair
from specdec.text import encode_prompt

PROMPT = "def fibonacci(n):\n    "
# label: the engine's keywords, the same in-process and in the request (the service's own defaults, such as the
# default pair's confidence stop, never apply); google-c0.4 stops the draft's run below 0.4 as HF's assisted
# generation does by default (assistant_confidence_threshold), the like-for-like row beside it
METHODS = {"target": {"method": "target"},
           "google": {"method": "google", "draft_confidence_threshold": 0.0},
           "google-c0.4": {"method": "google", "draft_confidence_threshold": 0.4}}
# HF assisted generation's rows (each its run_hf method) and their labels: as it runs with scikit-learn installed,
# and without (bench.methods.fixed_confidence_threshold)
ASSISTED = {"hf_assisted": "assisted generation",
            "hf_assisted_fixed_threshold": "assisted generation, threshold fixed (as without scikit-learn)"}


def in_process(decoder: SpeculativeDecoder, ids: list[int], method: str, tokens: int) -> dict:
    """One in-process decode: tokens/s and the engine's per-round figures."""
    stats = decoder.generate(ids, max_new_tokens=tokens, gamma=4, temperature=0, seed=0, eos_token_id=[],
                             **METHODS[method]).stats
    forwards = stats.draft_seconds + stats.target_seconds
    return {"tokens_per_second": stats.tokens_per_second, "new_tokens": stats.new_tokens, "rounds": stats.rounds,
            "seconds": stats.total_seconds,
            "ms_per_round": 1e3 * stats.total_seconds / stats.rounds,
            "ms_per_round_outside_forwards": 1e3 * (stats.total_seconds - forwards) / stats.rounds,
            "acceptance_rate": stats.acceptance_rate}


def through_service(server: Server, method: str, tokens: int, stream: bool) -> dict:
    """One `POST /predict` timed from the client: generated tokens over the request's wall time (EOS ignored, as
    in-process), and where the rest goes: the engine's own tokens/s inside the service (its stats' total_seconds,
    from the stream's start to its end) and the request's milliseconds outside it (parsing, encoding, HTTP).

    The client is the standard library's `http.client` on a new connection, as curl makes one: a lean client, so
    that the time it takes is the service's. `requests` spends about 1 ms of Python of its own on each call on
    these CPUs (1.4 against 0.4 ms for a GET of a bare gunicorn app), charged to the service before 2026-12-06."""
    body = {"prompt": PROMPT, "max_new_tokens": tokens, "gamma": 4, "temperature": 0, "seed": 0, "stream": stream,
            "ignore_eos": True, "cache_prompt": False,  # exactly `tokens`, the prompt prefilled each time
            **METHODS[method]}  # in-process's work
    payload = json.dumps(body).encode()
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        connection.request("POST", "/predict", body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()  # a stream's writes are read as they arrive (chunked), parsed at the end
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"POST /predict answered {response.status}: {data[:500]!r}")
    if stream:
        events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
        answer = json.loads(events[-1].removeprefix(b"data: "))
    else:
        answer = json.loads(data)
    seconds = time.perf_counter() - started
    completion, engine_seconds = answer["usage"]["completion_tokens"], answer["stats"]["total_seconds"]
    return {"tokens_per_second": completion / seconds, "engine_tokens_per_second": completion / engine_seconds,
            "ms_outside_engine": 1e3 * (seconds - engine_seconds), "seconds": seconds,
            "engine_seconds": engine_seconds, "bytes": len(data)}


def through_floor(floor: FloorServer, work_seconds: float, answer_bytes: int, new_tokens: int) -> dict:
    """The HTTP floor (bench/floor.py) for a request whose work takes `work_seconds` (an in-process run's, or a
    service run's engine time) and whose answer is `answer_bytes` long: its tokens/s as if it had generated
    `new_tokens`, its share of the work's speed, and the milliseconds any service built this way adds."""
    seconds = floor.wait(work_seconds, answer_bytes)
    return {"tokens_per_second": new_tokens / seconds, "vs_in_process": work_seconds / seconds,
            "ms_outside_work": 1e3 * (seconds - work_seconds), "seconds": seconds}


def medians(runs: list[dict]) -> dict:
    """Each numeric figure's median over the runs (those that are None, as target-only's acceptance rate, left
    out)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]
            if isinstance(runs[0][key], (int, float))}


def repeated(measure_once, repeats: int, *args) -> dict:
    """The medians of `repeats` runs of measure_once(*args) after a warm-up (bench/gpu.py's stages, one kind at a
    time)."""
    measure_once(*args)
    return medians([measure_once(*args) for _ in range(repeats)])


def hugging_face(draft_dir: str, target_dir: str, ids: list[int], tokens: int, repeats: int,
                 device: str = "cpu") -> dict:
    """HF `generate` and assisted generation on the models exactly as `from_pretrained` loads them (float32 on
    CPU, bfloat16 on CUDA, as `load_pair` chooses)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    target.generation_config.eos_token_id = None  # as ours: exactly `tokens` new tokens
    draft.generation_config.eos_token_id = None
    rows = {}
    for name, method in (("hf_generate", "hf_target"), *((name, name) for name in ASSISTED)):
        run_hf(method, draft, target, ids, tokens, MODES["greedy"], 0)
        runs = [run_hf(method, draft, target, ids, tokens, MODES["greedy"], 0) for _ in range(repeats)]
        rows[name] = {"tokens_per_second": statistics.median(r["new_tokens"] / r["total_seconds"] for r in runs)}
    return rows


def measure(args, draft_dir: str, target_dir: str, folder: Path) -> dict:
    """Per path: the in-process decoder and the service loaded side by side, and their runs interleaved (in-process,
    JSON, SSE, for each method, `repeats` times after a warm-up), so that a drift in the machine's speed falls on
    all three alike; each service row's ratio is the median of its paired ratios to the in-process run beside it."""
    results = {}
    for name in args.paths:
        compiled = name == "compiled"
        draft, target, tokenizer = load_pair(draft_dir, target_dir, device=args.device, compile=compiled,
                                             draft_quantization=args.draft_quantization)
        decoder = SpeculativeDecoder(draft, target, tokenizer)
        ids = encode_prompt(tokenizer, PROMPT, False)
        server = floor = None
        if not args.no_service:
            floor = FloorServer(folder / f"{name}-floor.log").wait_ready()
            threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
            server = Server(folder / f"{name}.log", env=threads, draft_model=draft_dir, target_model=target_dir,
                            device=args.device, compile=str(compiled).lower(),
                            draft_quantization=args.draft_quantization,
                            max_new_tokens_limit=max(args.tokens, 1024),
                            **({} if args.stream_interval is None else {"stream_interval": args.stream_interval})
                            ).wait_ready(timeout=1200)
        try:
            runs: dict[str, list[dict]] = {}
            for repeat in range(args.repeats + 1):  # the first is a warm-up
                for method in args.methods:
                    row = {"in-process": in_process(decoder, ids, method, args.tokens)}
                    if server is not None:
                        for stream in (False, True):
                            row[f"service-{'sse' if stream else 'json'}"] = run = \
                                through_service(server, method, args.tokens, stream)
                            run["vs_in_process"] = run["tokens_per_second"] / row["in-process"]["tokens_per_second"]
                        row["floor"] = through_floor(floor, row["in-process"]["seconds"], row["service-json"]["bytes"],
                                                     row["in-process"]["new_tokens"])
                        for kind in ("service-json", "service-sse"):  # the service's wall time over the floor's
                            row[kind]["vs_floor"] = row["floor"]["seconds"] / row[kind]["seconds"]
                    if repeat:
                        for kind, run in row.items():
                            runs.setdefault(f"{name}/{method}/{kind}", []).append(run)
            results.update({key: medians(rows) for key, rows in runs.items()})
        finally:
            for running in (server, floor):
                if running is not None:
                    running.stop()
        del decoder, draft, target
    results.update(hugging_face(draft_dir, target_dir, ids, args.tokens, args.repeats, args.device))
    return results


def figure(rate: float) -> str:
    """A tokens/s figure: whole above 100 (the tiny pair's), one decimal below (the default pair's)."""
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}"


def markdown(report: dict) -> str:
    """One row per path and method: in-process figures, then the service's (JSON, SSE) as tokens/s and the
    share of in-process; HF's rows last."""
    rows = report["results"]
    hf_generate = rows["hf_generate"]["tokens_per_second"]
    # assisted generation: the faster of its two configurations (older reports have one)
    assisted = {name: rows[name]["tokens_per_second"] for name in ASSISTED if name in rows}
    hf_assisted = max(assisted.values())

    def service(key):
        row = rows.get(key)
        if row is None:
            return "-"
        engine = row.get("engine_tokens_per_second")  # older reports lack the split
        split = "" if engine is None else f"; engine {engine:.0f}, +{row['ms_outside_engine']:.1f} ms"
        floor = "" if "vs_floor" not in row else f", {row['vs_floor']:.2f}x of the floor"  # older reports lack it
        return f"{figure(row['tokens_per_second'])} ({row['vs_in_process']:.2f}x{floor}{split})"

    def floor(key):
        row = rows.get(key)
        if row is None:
            return "-"
        return f"{figure(row['tokens_per_second'])} ({row['vs_in_process']:.2f}x, +{row['ms_outside_work']:.1f} ms)"

    lines = [f"`{report['command']}` ({report['date']}, {report['machine'].get('cpu')}, "
             f"{report['pair']} pair, {report['tokens']} new tokens, greedy, gamma 4)", "",
             "| path | method | tokens/s in-process | vs HF generate | vs HF assisted (the faster) | ms per round "
             "(outside forwards) | service JSON (vs in-process; engine's own tokens/s in the service, ms per request "
             "outside it) | service SSE | HTTP floor (bench/floor.py: the same wait, no service; vs in-process, "
             "ms per request over the work) |", "|---|---|---|---|---|---|---|---|---|"]
    for path in ("eager", "compiled"):
        for method in METHODS:
            row = rows.get(f"{path}/{method}/in-process")
            if row is None:  # a path not measured (--paths)
                continue
            rate = row["tokens_per_second"]
            lines.append(f"| {path} | {method} | {figure(rate)} | {rate / hf_generate:.2f}x | {rate / hf_assisted:.2f}x "
                         f"| {row['ms_per_round']:.2f} ({row['ms_per_round_outside_forwards']:.2f}) "
                         f"| {service(f'{path}/{method}/service-json')} | {service(f'{path}/{method}/service-sse')} "
                         f"| {floor(f'{path}/{method}/floor')} |")
    lines.append(f"| HF | generate | {figure(hf_generate)} | 1.00x | | | | | |")
    lines += [f"| HF | {ASSISTED[name]} | {figure(rate)} | | {rate / hf_assisted:.2f}x | | | | |"
              for name, rate in assisted.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-quantization", default=None,
                        help="default: none for the tiny pair (compiled whole), auto (the service's) for the default pair")
    parser.add_argument("--no-service", action="store_true", help="in-process rows only")
    parser.add_argument("--paths", type=lambda v: v.split(","), default=["eager", "compiled"],
                        help="eager, compiled or both (comma-separated)")
    parser.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS),
                        help=f"a subset of {', '.join(METHODS)} (comma-separated)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, in-process and in the service (default: 1 for tiny, 2 for default)")
    parser.add_argument("--stream-interval", type=float, default=None,
                        help="the service's stream_interval (default: config/default.toml's)")
    parser.add_argument("--out", default="bench/results/overhead")
    args = parser.parse_args(argv)
    if unknown := set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (choose from {', '.join(METHODS)})")
    if unknown := set(args.paths) - {"eager", "compiled"}:
        parser.error(f"--paths: unknown {', '.join(sorted(unknown))} (choose from eager, compiled)")
    for name in ("tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    args.draft_quantization = args.draft_quantization or ("none" if args.pair == "tiny" else "auto")
    args.threads = args.threads or (1 if args.pair == "tiny" else 2)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if args.pair == "tiny":
            draft_dir, target_dir = save_pair(folder)
        else:
            from specdec.models.default_pair import default_pair_paths

            draft_dir, target_dir = default_pair_paths(prepare=False)
        results = measure(args, draft_dir, target_dir, folder)
    report = {"command": "python -m bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
              "pair": args.pair, "tokens": args.tokens, "repeats": args.repeats, "threads": args.threads,
              "draft_quantization": args.draft_quantization, "results": results}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    table = markdown(report)
    (out / "results.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
