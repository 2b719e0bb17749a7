"""The service against a direct decode in one process: the service's app served by gevent's WSGI server (the
server gunicorn's gevent worker runs) in this process, the same decode run directly on the service's own engine
thread between its requests, and a client in a second process timing `POST /predict` (JSON and SSE) on a new
connection each time, as curl would.

Two processes' speeds differ here by more than the gap measured: in `bench.overhead` the service process's engine
has run 4% slower and 11% faster than the benchmark's own in-process decoder. Here both run in one process, on
one engine thread, interleaved request by request, so each paired ratio is the service's own cost:

- `vs_direct`: the direct decode's seconds (its stats' total_seconds, as in-process figures are taken) over the
  request's wall time from the client;
- `engine_vs_direct`: the same over the engine's own seconds inside the request (its stats).

The direct decode takes the very SamplingParams the service built for the same request (recorded in the
warm-up); which of the two runs first alternates between repeats. Medians over `--repeats` pairs, after one
warm-up round. Greedy, gamma 4, EOS ignored, no prompt cache.

With `--stages`, each JSON request is also timed stage by stage, from the client's clock and stamps taken in the
service (perf_counter: CLOCK_MONOTONIC, one clock for both processes): where the time outside the engine goes
(STAGES). The stamps wrap a few of the service's own functions for the run; they cost microseconds.

    python -m bench.one_process                       # the tests' tiny pair, compiled
    python -m bench.one_process --compile false --methods target,google --repeats 15
    python -m bench.one_process --methods target --stages
"""

from gevent import monkey

monkey.patch_all()  # first: the service's gunicorn worker runs patched, and so does this process

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

# the client: one request per line read ("json" or "sse", and the body), its wall time and stats written back
CLIENT = r"""
import http.client, json, sys, time
port = int(sys.argv[1])
for line in sys.stdin:
    kind, body = line.split(" ", 1)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/predict", body=body.encode(), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    ended = time.perf_counter()
    connection.close()
    answer = json.loads(data.split(b"data: ")[-1] if kind == "sse" else data)
    print(json.dumps({"status": response.status, "seconds": ended - started, "answer": answer,
                      "stamps": {"sent": started, "received": ended}}), flush=True)
"""

# --stages: a JSON request's stages, each between two stamps (the client's "sent" and "received", the service's
# from STAMPED's wrappers)
STAGES = (("HTTP in: connect, send, accept, the head parsed", "sent", "app"),
          ("Flask and its hooks, up to the route's body read", "app", "read"),
          ("body read, parsed and checked (pydantic)", "read", "encode"),
          ("prompt tokenized", "encode", "encoded"),
          ("engine set-up: queue slot, stream's checks, Generation", "encoded", "run"),
          ("hand-off to the engine thread", "run", "engine"),
          ("engine: decode, then detokenize", "engine", "engine_end"),
          ("hand-back to the request's greenlet", "engine_end", "ran"),
          ("JSON answer, metrics, log line (Flask's)", "ran", "app_end"),
          ("HTTP out: the answer written and read", "app_end", "received"))


def main(argv=None) -> int:
    from bench.machine import machine_info
    from bench.overhead import METHODS, PROMPT

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--compile", choices=("true", "false"), default="true")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 tiny, 2 default)")
    parser.add_argument("--stream-interval", type=float, default=None)
    parser.add_argument("--stop", default=None, help="a stop string sent with every request (one that never occurs "
                                                    "measures checking it every round)")
    parser.add_argument("--stages", action="store_true", help="also time each JSON request stage by stage")
    parser.add_argument("--out", default=None, help="a folder for results.json and results.md")
    args = parser.parse_args(argv)
    if unknown := set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (choose from {', '.join(METHODS)})")

    import torch

    torch.set_num_threads(args.threads or (1 if args.pair == "tiny" else 2))
    with tempfile.TemporaryDirectory() as scratch:
        if args.pair == "tiny":
            from bench.stress import save_pair

            draft_dir, target_dir = save_pair(Path(scratch))
        else:
            from specdec.models.default_pair import default_pair_paths

            draft_dir, target_dir = default_pair_paths(prepare=False)
        results = measure(args, draft_dir, target_dir, METHODS, PROMPT)
    report = {"command": "python -m bench.one_process " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
              "pair": args.pair, "compile": args.compile, "tokens": args.tokens, "repeats": args.repeats,
              "stop": args.stop,
              "results": results.pop("ratios"), "stages": results.pop("stages")}
    table = markdown(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (out / "results.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


def measure(args, draft_dir: str, target_dir: str, methods: dict, prompt: str) -> dict:
    """Serve the app here, start the client, and for each repeat and method: the direct decode, then the same
    decode requested as JSON and as SSE; the paired ratios' medians by method and kind."""
    from gevent.pywsgi import WSGIServer
    from gevent.subprocess import PIPE, Popen

    from bench.stress import free_port
    from specdec.params import SamplingParams
    from specdec.serve import create_app
    from specdec.text import encode_prompt

    config = {"draft_model": draft_dir, "target_model": target_dir, "device": "cpu", "compile": args.compile,
              "draft_quantization": "none" if args.pair == "tiny" else "auto",
              "max_new_tokens_limit": max(args.tokens, 1024), "log_level": "warning"}
    if args.stream_interval is not None:
        config["stream_interval"] = args.stream_interval
    app = create_app(config)
    service = app.extensions["specdec"]
    if not service.wait_until_loaded(3600):
        raise RuntimeError("the pair did not load")
    ids = encode_prompt(service.tokenizer, prompt, False)
    port = free_port()
    server = WSGIServer(("127.0.0.1", port), app, log=None)
    server.start()
    client = Popen([sys.executable, "-c", CLIENT, str(port)], stdin=PIPE, stdout=PIPE, text=True)

    requested = {}  # method -> the SamplingParams the service built for its request (recorded in the warm-up)
    stream = service.decoder.stream

    def recorded(*args, params=None, **kwargs):
        requested.setdefault(current["method"], params)
        return stream(*args, params=params, **kwargs)

    current = {}
    service.decoder.stream = recorded
    stamps = stamped(app) if args.stages else None
    staged: dict[str, list[dict]] = {}

    def direct(method: str) -> float:  # the request's very decode: its parameters, the service's end tokens
        params = requested.get(method) or SamplingParams(max_new_tokens=args.tokens, gamma=4, temperature=0.0,
                                                         seed=0, ignore_eos=True, cache_prompt=False,
                                                         **methods[method])
        return service.engine.call(lambda: service.decoder.generate(
            ids, params=params, eos_token_id=service.models.eos_token_ids).stats.total_seconds)

    def request(method: str, kind: str) -> tuple[float, float]:
        current["method"] = method  # the direct decode takes the parameters this request's stream records
        body = {"prompt": prompt, "max_new_tokens": args.tokens, "gamma": 4, "temperature": 0, "seed": 0,
                "ignore_eos": True, "cache_prompt": False, "stream": kind == "sse", **methods[method],
                **({"stop": [args.stop]} if args.stop else {})}
        if stamps is not None:
            stamps.clear()
        wall, engine, sent = post(client, kind, body)
        if stamps is not None and kind == "json":
            staged.setdefault(method, []).append(sent | stamps)
        return wall, engine

    try:
        ratios = paired_ratios(args.repeats, args.methods, args.tokens, direct, request)
        return {"ratios": ratios, "stages": {method: stage_medians(runs[1:]) for method, runs in staged.items()}
                if stamps is not None else None}
    finally:
        client.stdin.close()
        client.wait()
        server.stop()


def post(client, kind: str, body: dict) -> tuple[float, float, dict]:
    """One `POST /predict` ("json" or "sse") timed by the CLIENT process: (its wall seconds, the engine's own
    seconds from the answer's stats, the client's stamps)."""
    client.stdin.write(f"{kind} {json.dumps(body)}\n")
    client.stdin.flush()
    reply = json.loads(client.stdout.readline())
    if reply["status"] != 200:
        raise RuntimeError(f"POST /predict answered {reply['status']}: {reply['answer']}")
    return reply["seconds"], reply["answer"]["stats"]["total_seconds"], reply["stamps"]


def stamped(app) -> dict:
    """Wrap the service's functions that bound STAGES so that each call stamps its entry and exit (perf_counter)
    into the dict returned, the latest request's (clear it before each)."""
    from specdec.serve import routes
    from specdec.serve.generation import Generation
    from specdec.serve.service import Service

    stamps: dict[str, float] = {}

    def wrap(owner, name: str, entry: str, leaving: str | None = None) -> None:
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            stamps[entry] = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if leaving is not None:
                    stamps[leaving] = time.perf_counter()

        setattr(owner, name, wrapper)

    wrap(app, "wsgi_app", "app", "app_end")  # an instance attribute: this app's alone
    wrap(routes, "read_json_object", "read")  # as the route calls it (imported by name there)
    wrap(Service, "encode", "encode", "encoded")
    wrap(Generation, "run", "run", "ran")
    wrap(Generation, "_decode_all", "engine", "engine_end")
    return stamps


def stage_medians(runs: list[dict]) -> dict:
    """Each stage's median milliseconds over the runs (each a request's stamps), and the whole request's."""
    medians = {label: 1e3 * statistics.median(run[end] - run[start] for run in runs) for label, start, end in STAGES}
    return medians | {"whole request": 1e3 * statistics.median(run["received"] - run["sent"] for run in runs),
                      "requests": len(runs)}


def paired_ratios(repeats: int, methods: list[str], tokens: int, direct, request) -> dict:
    """For each method and kind, `repeats` pairs (after one warm-up) of `direct(method)` (its seconds) and
    `request(method, kind)` (wall and engine seconds), which of the two goes first alternating; the medians of
    the paired ratios by "method/kind"."""
    pairs: dict[str, list[dict]] = {}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for method in methods:
            for kind in ("json", "sse"):
                if repeat % 2:  # which of the two goes first alternates: whatever the order does falls on both
                    seconds = direct(method)
                    wall, engine = request(method, kind)
                else:
                    wall, engine = request(method, kind)
                    seconds = direct(method)
                if repeat:
                    pairs.setdefault(f"{method}/{kind}", []).append(
                        {"vs_direct": seconds / wall, "engine_vs_direct": seconds / engine,
                         "direct_tokens_per_second": tokens / seconds, "ms_outside_engine": 1e3 * (wall - engine)})
    return {key: {name: statistics.median(run[name] for run in runs) for name in runs[0]} | {"pairs": len(runs)}
            for key, runs in pairs.items()}


def markdown(report: dict) -> str:
    lines = [f"`{report['command']}` ({report['date']}, {report['machine'].get('cpu')}, {report['pair']} pair, "
             f"compile {report['compile']}, {report['tokens']} new tokens, greedy, gamma 4; medians of paired ratios)",
             "", "| method | kind | direct tokens/s | service vs direct | engine in the service vs direct | "
             "ms per request outside the engine | pairs |", "|---|---|---|---|---|---|---|"]
    for key, row in report["results"].items():
        method, kind = key.split("/")
        lines.append(f"| {method} | {kind.upper()} | {row['direct_tokens_per_second']:.0f} | {row['vs_direct']:.3f}x "
                     f"| {row['engine_vs_direct']:.3f}x | {row['ms_outside_engine']:.1f} | {row['pairs']} |")
    if report.get("stages"):
        methods = list(report["stages"])
        lines += ["", "A JSON request's stages, median ms (the stages' medians need not add up to the whole's):", "",
                  "| stage | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for label in [label for label, _, _ in STAGES] + ["whole request"]:
            lines.append(f"| {label} | " + " | ".join(f"{report['stages'][m][label]:.3f}" for m in methods) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
