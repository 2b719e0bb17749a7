"""bench/peers.py without building llama.cpp: the build's reuse and commands, llama-server's command line, the
GGUF files joined through specdec.models.default_pair, a fake llama-server answering recorded JSON, and the report."""

import hashlib
import json
import sys
import textwrap

import pytest

from bench import peers
from bench.stress import free_port
from specdec.models.default_pair import GGUFSource

# llama-server's /completion answer with the draft, in the shape of 0.3.36's llama.cpp (server_slot_stats::to_json
# in tools/server/server-common.cpp), trimmed to the fields bench.peers reads and a few beside them
RECORDED = {
    "content": "    if n <= 1:\n        return False\n",
    "tokens": [262, 421, 308, 2651, 220, 16, 510, 286, 470, 3557, 198],
    "stop": True,
    "stop_type": "limit",
    "tokens_predicted": 11,
    "tokens_evaluated": 19,
    "timings": {"cache_n": 0, "prompt_n": 19, "prompt_ms": 301.5, "prompt_per_token_ms": 15.87,
                "prompt_per_second": 63.0, "predicted_n": 11, "predicted_ms": 452.1, "predicted_per_token_ms": 41.1,
                "predicted_per_second": 24.33, "draft_n": 16, "draft_n_accepted": 9},
}


def test_server_command_target_alone_and_with_the_draft(tmp_path):
    server, target, draft = tmp_path / "llama-server", tmp_path / "t.gguf", tmp_path / "d.gguf"
    alone = peers.server_command(server, target, 8123, threads=2, context=4096)
    assert alone[:3] == [str(server), "-m", str(target)]
    assert alone[alone.index("--port") + 1] == "8123" and alone[alone.index("-t") + 1] == "2"
    assert alone[alone.index("-np") + 1] == "1" and alone[alone.index("-c") + 1] == "4096"
    assert "-md" not in alone and "--spec-draft-n-max" not in alone
    speculative = peers.server_command(server, target, 8123, threads=2, context=4096, draft=draft, draft_max=8)
    assert speculative[:len(alone)] == alone
    assert speculative[speculative.index("-md") + 1] == str(draft)
    assert speculative[speculative.index("-td") + 1] == "2"
    assert speculative[speculative.index("--spec-draft-n-max") + 1] == "8"
    # this llama.cpp's default speculative type is none: with -md alone it loads the draft and never drafts
    assert speculative[speculative.index("--spec-type") + 1] == "draft-simple"


def test_the_build_is_the_server_target_native_without_curl_and_is_reused(tmp_path, monkeypatch):
    build = peers.Build(tmp_path / "llama.cpp")
    configure, compile_ = build.commands(jobs=2)
    assert configure[:5] == ["cmake", "-S", str(build.source), "-B", str(build.build_dir)]
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"} <= set(configure)
    assert compile_ == ["cmake", "--build", str(build.build_dir), "--target", "llama-server", "-j2"]
    assert build.source.parts[-3:] == (f"llama_cpp_python-{peers.LLAMA_CPP_PYTHON}", "vendor", "llama.cpp")

    def no_commands(*args, **kwargs):
        raise AssertionError(f"ran {args}: the built server should have been reused")

    monkeypatch.setattr(peers.subprocess, "run", no_commands)
    build.server.parent.mkdir(parents=True)
    build.server.write_text("#!/bin/sh\n")
    with pytest.raises(AssertionError):  # not executable: not a build to reuse
        peers.build_server(build)
    build.server.chmod(0o755)
    assert peers.build_server(build) == build.server


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """Two importable part packages holding bytes, like the PyPI ones, and a source whose size and hash fit."""
    chunks = [b"GGUF" + bytes(range(256)), b"the rest" * 40]
    for i, chunk in enumerate(chunks, start=1):
        package = tmp_path / "site" / f"peerpart{i}"
        package.mkdir(parents=True)
        (package / "part.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'part.bin')\n")
        sys.modules.pop(f"peerpart{i}", None)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    joined = b"".join(chunks)
    return GGUFSource("fake", "target", "peerpart", 2, "fake.gguf", len(joined), hashlib.sha256(joined).hexdigest())


def test_gguf_files_are_joined_by_default_pair_and_reused(fake_source, tmp_path, monkeypatch):
    folder = tmp_path / "gguf"
    path = peers.gguf_file(fake_source, folder)
    assert path == folder / "fake.gguf" and hashlib.sha256(path.read_bytes()).hexdigest() == fake_source.sha256
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf"]  # no partial file left

    def no_join(*args):
        raise AssertionError("joined again")

    monkeypatch.setattr(peers.default_pair, "join_parts", no_join)
    assert peers.gguf_file(fake_source, folder) == path
    path.write_bytes(b"cut short")  # a wrong size is joined again
    with pytest.raises(AssertionError, match="joined again"):
        peers.gguf_file(fake_source, folder)


def test_a_completion_run_from_recorded_timings():
    run = peers.completion_run(RECORDED, wall_seconds=0.8)
    assert run["new_tokens"] == 11 and run["decode_tokens_per_second"] == 24.33
    assert run["tokens_per_second"] == pytest.approx(11 / 0.8)
    assert run["drafted"] == 16 and run["accepted"] == 9 and run["acceptance_rate"] == pytest.approx(9 / 16)
    assert run["token_ids"] == RECORDED["tokens"]
    target_only = json.loads(json.dumps(RECORDED))
    del target_only["timings"]["draft_n"], target_only["timings"]["draft_n_accepted"]
    assert "acceptance_rate" not in peers.completion_run(target_only, wall_seconds=0.8)


FAKE_SERVER = """
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"status": "ok"})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(sys.argv[2], "a") as log:
                log.write(json.dumps(request) + "\\n")
            self.answer(json.loads(sys.argv[3]))

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_fake_llama_server_is_started_asked_greedily_and_stopped(tmp_path):
    script, requests_log = tmp_path / "fake_server.py", tmp_path / "requests.jsonl"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    port = free_port()
    command = [sys.executable, str(script), str(port), str(requests_log), json.dumps(RECORDED)]
    with peers.LlamaServer(command, port, tmp_path / "server.log") as server:
        run = server.complete([1, 2, 3], tokens=11)
        process = server.process
    assert process.poll() is not None  # stopped on leaving
    assert run["decode_tokens_per_second"] == 24.33 and 0 < run["tokens_per_second"]
    request = json.loads(requests_log.read_text())
    assert request == peers.completion_body([1, 2, 3], 11)
    assert request["prompt"] == [1, 2, 3] and request["temperature"] == 0 and request["top_k"] == 1
    assert request["ignore_eos"] is True and request["cache_prompt"] is False and request["n_predict"] == 11


def test_a_sampled_run_asks_llama_cpp_for_the_same_distribution_as_ours():
    """T and top-p as given, and nothing else between the logits and the draw: llama.cpp's own min_p (0.05 unless
    set) and top_k (40) would truncate the distribution ours samples from."""
    body = peers.completion_body([1, 2], 8, temperature=0.7, top_p=0.9, seed=2)
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["seed"] == 2
    assert body["min_p"] == 0.0 and body["top_k"] == 0
    assert peers.decoding({"temperature": 0.7, "top_p": 0.9}) == "sampled at T=0.7 top-p 0.9 (seed: the repeat)"


def test_a_speculative_server_that_drafted_nothing_is_refused(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    target_only = json.loads(json.dumps(RECORDED))
    del target_only["timings"]["draft_n"], target_only["timings"]["draft_n_accepted"]
    port = free_port()
    command = [sys.executable, str(script), str(port), str(tmp_path / "requests.jsonl"), json.dumps(target_only)]
    with peers.LlamaServer(command, port, tmp_path / "server.log") as server:
        assert "drafted" not in server.complete([1], tokens=11)
        with pytest.raises(RuntimeError, match="did not speculate"):
            server.complete([1], tokens=11, speculative=True)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    command = [sys.executable, "-c", "print('error: unknown argument --spec-draft-n-max'); raise SystemExit(1)"]
    with pytest.raises(RuntimeError, match="unknown argument"):
        with peers.LlamaServer(command, free_port(), tmp_path / "server.log"):
            pass


def runs_of(configuration, prompt, rates, ids, acceptance=None):
    return [{"configuration": configuration, "prompt": prompt, "repeat": i, "new_tokens": 4,
             "decode_tokens_per_second": rate, "tokens_per_second": rate / 2, "token_ids": ids,
             **({"acceptance_rate": acceptance} if acceptance is not None else {})} for i, rate in enumerate(rates)]


def test_summary_and_table_rows():
    runs = (runs_of("llama.cpp/target", "code", [20.0, 30.0, 25.0], [1, 2, 9, 9])
            + runs_of("llama.cpp/draft", "code", [22.0, 24.0, 26.0], [1, 2, 9, 9], acceptance=0.5)
            + runs_of("specdec/target", "code", [3.0, 4.0, 5.0], [1, 2, 3, 4]))
    summary = peers.summarise(runs)
    assert list(summary) == ["llama.cpp/target", "llama.cpp/draft", "specdec/target"]
    assert summary["llama.cpp/target"]["code"] == {"tokens_per_second": 12.5, "decode_tokens_per_second": 25.0,
                                                   "repeats": 3, "same_prefix_as_ours": 2}
    assert summary["llama.cpp/draft"]["code"]["acceptance_rate"] == 0.5
    assert summary["specdec/target"]["code"]["same_prefix_as_ours"] == 4
    report = {"date": "today", "command": "python -m bench.peers --repeats 3", "machine": {"cpu": "x", "cuda": None},
              "load_average": {"before": 3.0, "after": 2.5},
              "llama_cpp_python": "0.3.36", "llama_server_version": "version: 1 (abc)",
              "server_commands": {"target": "llama-server -m t.gguf"}, "prompts": ["code"], "tokens": 4,
              "repeats": 3, "threads": 2, "gamma": 4, "summary": summary}
    table = peers.markdown(report)
    assert "`python -m bench.peers --repeats 3`" in table and "`llama-server -m t.gguf`" in table
    assert "load average 3.0 before, 2.5 after" in table and "gamma 4 (google-adaptive: chosen each round), 2 torch threads" in table
    assert "greedy, EOS ignored" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[1] == "| llama.cpp | target | 25.0 | 12.5 | - | 2/4 |"
    assert rows[2] == "| llama.cpp | draft | 24.0 | 12.0 | 0.50 | 2/4 |"
    assert rows[3] == "| specdec | target | 4.0 | 2.0 | - | 4/4 |"
    separator = table.splitlines()[table.splitlines().index(rows[0]) + 1]
    assert all(line.count("|") == rows[0].count("|") for line in rows + [separator])


def test_our_weights_name_the_pairs_form_and_an_optional_4bit_draft():
    assert peers.pair_form("shipped") == {"weights": "shipped", "draft_quantization": "int8"}
    assert peers.pair_form("shipped+int4") == {"weights": "shipped", "draft_quantization": "int4"}
    assert peers.pair_form("float+int4") == {"weights": "float", "draft_quantization": "int4"}
    for bad in ("shipped+int2", "int4", "shipped+int8"):
        with pytest.raises(ValueError, match="--weights"):
            peers.pair_form(bad)
