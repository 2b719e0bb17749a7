"""What the engine in a process of its own (vLLM's layout) would give the service: a measurement, not a mode.

Today one worker process holds both the event loop that speaks HTTP and the engine's OS thread, so the loop's
Python (reading the request, detokenizing and rendering a stream's events, writing them) runs under the same
interpreter lock as the engine's rounds, and slows them (bench/README.md, "Rounds bound by overhead"). Here the
engine runs in a second process that reads requests from a Unix socket, decodes on the service's own engine
(`create_app`'s decoder, loaded as the service loads it) and writes the token ids back: once at the end for a
JSON answer, for a stream every `stream_interval` the rounds decoded since. The front process is a bare WSGI app
under gevent's server (no Flask, no validation, no metrics: what is left of the service's per-request work is
tokenizing the prompt, detokenizing and rendering with the service's own `Completion` and event template), and a
client in a third process times `POST /predict` on a new connection each time, as `bench.one_process` does.

Paired as in `bench.one_process`: the direct decode (the same parameters, in the engine process, on the same
thread) alternates with each request; `vs_direct` is its seconds over the request's wall time, and
`engine_vs_direct` over the engine's own seconds inside the request. The front's missing work makes `vs_direct`
an upper bound of what a split service would reach; `engine_vs_direct` is what the split gives the engine itself.

    python -m bench.split --repeats 20 --methods target,google
"""

import sys

if "--engine-fd" not in sys.argv:  # the front process runs as gunicorn's gevent worker does; the engine, unpatched
    from gevent import monkey

    monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

HEADER = struct.Struct("!I")


def send(sock, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(HEADER.pack(len(data)) + data)


def receive(sock) -> dict:
    """The next message; an error the engine process reported is raised here."""
    message = _receive(sock)
    if "error" in message:
        raise RuntimeError(f"the engine process failed: {message['error']}")
    return message


def _receive(sock) -> dict:
    def exactly(n: int) -> bytes:
        parts = []
        while n:
            part = sock.recv(n)
            if not part:
                raise ConnectionError("the other process has gone")
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    return json.loads(exactly(HEADER.unpack(exactly(HEADER.size))[0]))


# --- the engine process ---------------------------------------------------------------------------------------

def engine_main(fd: int, config: dict, tokens: int, threads: int) -> None:
    """Load the pair as the service does, then answer the front's messages one at a time, on the engine thread."""
    import torch

    from bench.overhead import METHODS
    from specdec.params import SamplingParams
    from specdec.serve import create_app

    torch.set_num_threads(threads)
    service = create_app(config).extensions["specdec"]
    if not service.wait_until_loaded(3600):
        raise RuntimeError("the pair did not load")
    sock = socket.socket(fileno=fd)
    eos = service.models.eos_token_ids
    interval = service.settings.stream_interval

    def params(method: str) -> SamplingParams:
        return SamplingParams(max_new_tokens=tokens, gamma=4, temperature=0.0, seed=0, ignore_eos=True,
                              cache_prompt=False, **METHODS[method])

    def direct(message: dict) -> None:
        result = service.decoder.generate(message["ids"], params=params(message["method"]), eos_token_id=eos)
        send(sock, {"seconds": result.stats.total_seconds})

    def decode(message: dict) -> None:  # the service's stream loop, its rounds written to the socket
        stream = service.decoder.stream(message["ids"], params=params(message["method"]), eos_token_id=eos)
        clock, rounds, streaming = time.perf_counter, [], message["stream"]
        last = clock()
        try:
            while True:
                try:
                    chunk = next(stream)
                except StopIteration as end:
                    result = end.value
                    break
                rounds.append([chunk.token_ids, chunk.sources])
                if streaming and clock() - last >= interval:
                    send(sock, {"rounds": rounds})
                    rounds, last = [], clock()
        finally:
            stream.close()
        send(sock, {"rounds": rounds, "end": True, "engine_seconds": result.stats.total_seconds})

    send(sock, {"ready": True})
    while True:
        try:
            message = receive(sock)
        except ConnectionError:
            return
        try:
            service.engine.call(direct if message["op"] == "direct" else decode, message)
        except Exception as error:  # noqa: BLE001 - told to the front, which raises it (it would wait forever)
            send(sock, {"end": True, "error": f"{type(error).__name__}: {error}"})


# --- the front process ----------------------------------------------------------------------------------------

def front_app(tokenizer, engine_socket):
    """`POST /predict` {"prompt", "method", "stream"}: the prompt tokenized, decoded by the engine process, its
    text assembled and rendered as the service does (`Completion`, the /predict event template)."""
    from gevent.lock import Semaphore

    from specdec.serve.generation import _text_events, sse
    from specdec.text import Completion, concatenates, decoder_of, encode_prompt

    decode_text, concatenative, lock = decoder_of(tokenizer), concatenates(tokenizer), Semaphore()

    def chunks(rounds):
        return [SimpleNamespace(token_ids=ids, sources=sources, logprobs=None) for ids, sources in rounds]

    def app(environ, start_response):
        body = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
        ids = encode_prompt(tokenizer, body["prompt"], False)
        completion = Completion(decode_text, ids, (), concatenative)
        streaming = bool(body.get("stream"))
        lock.acquire()  # one request at a time (batch size 1)
        send(engine_socket, {"op": "decode", "ids": ids, "method": body["method"], "stream": streaming})
        if not streaming:
            try:
                message = receive(engine_socket)
            finally:
                lock.release()
            completion.extend(chunks(message["rounds"]), decode_text)
            completion.finish()
            answer = json.dumps({"text": completion.text, "finish_reason": "length",
                                 "stats": {"total_seconds": message["engine_seconds"]}}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(answer)))])
            return [answer]

        def events():
            try:
                while True:
                    message = receive(engine_socket)
                    if message.get("end"):
                        break
                    yield _text_events(completion.feed_rounds(chunks(message["rounds"]), decode_text),
                                       False).encode()
            finally:
                lock.release()
            texts = completion.feed_rounds(chunks(message["rounds"]), decode_text)
            completion.finish()
            yield (_text_events(texts, True) + sse({"text": completion.take(), "finish_reason": "length",
                                                   "stats": {"total_seconds": message["engine_seconds"]}})).encode()

        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return events()

    return app


def main(argv=None) -> int:
    from bench.machine import machine_info
    from bench.one_process import markdown
    from bench.overhead import METHODS, PROMPT

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", choices=("true", "false"), default="true")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS))
    parser.add_argument("--out", default=None, help="a folder for results.json and results.md")
    parser.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)  # the engine process
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_fd is not None:
        engine_main(args.engine_fd, json.loads(args.config), args.tokens, 1)
        return 0
    if unknown := set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (choose from {', '.join(METHODS)})")

    with tempfile.TemporaryDirectory() as scratch:
        from bench.stress import save_pair

        draft_dir, target_dir = save_pair(Path(scratch))
        results = measure(args, draft_dir, target_dir, list(args.methods), PROMPT)
    report = {"command": "python -m bench.split " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
              "pair": "tiny", "compile": args.compile, "tokens": args.tokens, "repeats": args.repeats,
              "results": results}
    table = markdown(report).replace("| service vs direct | engine in the service vs direct | ms per request "
                                     "outside the engine |", "| split front vs direct | engine in the split vs "
                                     "direct | ms per request outside the engine |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (out / "results.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


def measure(args, draft_dir: str, target_dir: str, methods: list[str], prompt: str) -> dict:
    from gevent.pywsgi import WSGIServer
    from gevent.subprocess import PIPE, Popen
    from transformers import AutoTokenizer

    from bench.one_process import CLIENT, paired_ratios, post
    from bench.stress import free_port

    config = {"draft_model": draft_dir, "target_model": target_dir, "device": "cpu", "compile": args.compile,
              "draft_quantization": "none", "max_new_tokens_limit": max(args.tokens, 1024), "log_level": "warning"}
    front_end, engine_end = socket.socketpair()
    engine = Popen([sys.executable, "-m", "bench.split", "--engine-fd", str(engine_end.fileno()),
                    "--tokens", str(args.tokens), "--config", json.dumps(config)], pass_fds=[engine_end.fileno()])
    engine_end.close()
    if not receive(front_end).get("ready"):
        raise RuntimeError("the engine process did not start")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    from specdec.text import encode_prompt

    ids = encode_prompt(tokenizer, prompt, False)
    port = free_port()
    server = WSGIServer(("127.0.0.1", port), front_app(tokenizer, front_end), log=None)
    server.start()
    client = Popen([sys.executable, "-c", CLIENT, str(port)], stdin=PIPE, stdout=PIPE, text=True)

    def direct(method: str) -> float:
        send(front_end, {"op": "direct", "ids": ids, "method": method})
        return receive(front_end)["seconds"]

    def request(method: str, kind: str) -> tuple[float, float]:
        wall, engine, _ = post(client, kind, {"prompt": prompt, "method": method, "stream": kind == "sse"})
        return wall, engine

    try:
        return paired_ratios(args.repeats, methods, args.tokens, direct, request)
    finally:
        client.stdin.close()
        client.wait()
        server.stop()
        front_end.close()
        engine.wait()


if __name__ == "__main__":
    raise SystemExit(main())
