"""Everything a lent GPU should measure, in one short run (no downloads), stage by stage within a time budget.

The pair: the default pair from the cache (`make models`) where it is there; else, with --shapes DIR, the default
pair's own configs and tokenizer (`make gpu-shapes` copies them, a few MB) with random weights, which run every
forward at the real shapes but accept almost nothing; else (--tiny) the tests' tiny pair. Stages, most wanted first:

1. forwards: one forward's ms by width (1 to 9 new tokens after 512 cached), draft and target, eager;
2. eager: target-only and Google (gamma 4, greedy) tokens/s in-process, and ms per round outside the forwards;
3. hf: Hugging Face `generate` and assisted generation on the same models;
4. eager-service: the same two methods through the running service, JSON and SSE, and beside each the HTTP floor
   (bench/floor.py: what gunicorn's gevent worker adds to a request as long, with no service in it);
5. compiled: the compiled static-cache path (specdec/compiled.py; CUDA graphs on CUDA): its compile seconds, and
   target-only and Google in-process;
6. random-7b: a ~7B Llama-shape target and a ~0.5B draft, random weights, bfloat16: verification cost by gamma,
   and target-only / Google eager against compiled;
7. compiled-service: the compiled path through the running service;
8. int4: the target on torch's int4 kernel (`quantize = int4`; specdec/cuda/int4pack.py), the default target's
   shape and the ~7B one: forward ms by width against bfloat16, row-invariance, tokens/s and greedy equality.

Results go to --out after each stage, so a run cut short keeps what it measured. Random weights make acceptance
meaningless, so for them the summary also projects Google's tokens/s from the measured forward costs and an
acceptance length given with --acceptance-length (tokens per round; 4.0 is the default pair's on the CPU, greedy,
gamma 4, bench/results/overhead/default), and says it is a projection.

    python -m bench.gpu --shapes .gpu/shapes      # on a CUDA machine
    python -m bench.gpu --tiny --device cpu --budget 300   # a smoke run of the same code on CPU
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from bench import overhead
from bench.floor import FloorServer
from bench.forwards import forward_ms, forward_ms_by_width
from bench.machine import machine_info
from specdec import SpeculativeDecoder
from specdec.models.pair import load_pair
from specdec.text import encode_prompt

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv_heads)
    "target-7b": (4096, 11008, 32, 32, 32),
    "draft-0.5b": (1024, 2816, 24, 16, 16),
    "tiny-target": (64, 128, 2, 4, 4),
    "tiny-draft": (32, 64, 1, 4, 4),
}
WIDTHS = [1, 2, 3, 5, 9]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build(shape: str, vocab: int, device: str, dtype: torch.dtype):
    hidden, inter, layers, heads, kv = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def random_like(source: Path, out: Path, device: str, dtype: torch.dtype) -> str:
    """A model folder with `source`'s config and tokenizer and random weights."""
    config = AutoConfig.from_pretrained(source)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    del model
    return str(out)


class Run:
    """The run's settings, its clock, the pair it measures and the report it writes after each stage."""

    def __init__(self, args, folder: Path):
        self.args, self.folder, self.started = args, folder, time.monotonic()
        self.device = args.device
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        self.report = {"machine": machine_info(), "device": self.device, "budget_seconds": args.budget,
                       "stages": {}, "skipped": []}
        self.draft_dir = self.target_dir = None
        self.pair_name = None

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.report, indent=2, default=str) + "\n", encoding="utf-8")

    def options(self):
        return argparse.Namespace(device=self.device, tokens=self.args.tokens, repeats=self.args.repeats,
                                  no_service=False, threads=None, draft_quantization="none")

    def pair(self):
        if self.draft_dir is None:
            self.draft_dir, self.target_dir, self.pair_name = locate_pair(self)
            self.report["pair"] = self.pair_name
        return self.draft_dir, self.target_dir


def locate_pair(run: Run) -> tuple[str, str, str]:
    if run.args.tiny:
        return (*overhead.save_pair(run.folder), "tiny (the tests')")
    from specdec.models.default_pair import DRAFT, TARGET, default_pair_paths, is_ready, model_dir

    if all(is_ready(model_dir(source), source) for source in (DRAFT, TARGET)) and not run.args.shapes:
        return (*default_pair_paths(prepare=False), "default (from the cache)")
    if not run.args.shapes:
        raise SystemExit("no default pair in the cache: pass --shapes DIR (make gpu-shapes) or --tiny")
    shapes = Path(run.args.shapes)
    started = time.perf_counter()
    dirs = [random_like(shapes / name, run.folder / name, run.device, run.dtype) for name in ("draft", "target")]
    run.report["random_pair_seconds"] = time.perf_counter() - started
    return (*dirs, "the default pair's configs and tokenizer, random weights")


def stage_forwards(run: Run) -> dict:
    draft_dir, target_dir = run.pair()
    draft, target, _ = load_pair(draft_dir, target_dir, device=run.device, compile=False,
                                 draft_quantization="none")
    rows = {name: forward_ms_by_width(model, run.args.context, WIDTHS, torch.device(run.device), run.args.repeats)
            for name, model in (("draft", draft), ("target", target))}
    return {"context": run.args.context, "ms_by_width": rows}


def stage_compiled_forwards(run: Run) -> dict:
    """Each model's forward by width on the compiled static-cache path, after its compile (seconds), printed as
    it goes: the figure a short lease can still bring back."""
    from specdec.compiled import compile_model

    draft_dir, target_dir = run.pair()
    draft, target, _ = load_pair(draft_dir, target_dir, device=run.device, compile=False,
                                 draft_quantization="none")
    rows = {}
    for name, model in (("draft", draft), ("target", target)):
        started = time.perf_counter()
        if not compile_model(model, torch.device(run.device)):
            rows[name] = {"compiled": False}
            continue
        rows[name] = {"compile_seconds": time.perf_counter() - started,
                      "ms_by_width": static_forward_ms(model, run.args.context, WIDTHS, run.args.repeats)}
        print(f"compiled {name}: {json.dumps(rows[name])}", flush=True)
        run.report["stages"]["compiled-forwards"] = rows
        run.save()
    return {"context": run.args.context, **rows}


def static_forward_ms(model, context: int, widths: list[int], repeats: int) -> dict[int, float]:
    """Median ms of one forward over each width after `context` tokens, on the model's static cache."""
    from specdec.compiled import StaticCachedModel

    cached = StaticCachedModel(model.specdec_static)
    context = min(context, model.specdec_static.max_len - max(widths))
    cached.forward(torch.randint(0, model.config.vocab_size, (context,)).tolist())
    times: dict[int, list[float]] = {n: [] for n in widths}
    for _ in range(repeats + 2):
        for n in widths:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            start = time.perf_counter()
            cached.forward(list(range(1, n + 1)), keep=n)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            times[n].append((time.perf_counter() - start) * 1e3)
            cached.rollback(context)
    return {n: statistics.median(ms[2:]) for n, ms in times.items()}


def stage_in_process(run: Run, compiled: bool) -> dict:
    draft_dir, target_dir = run.pair()
    started = time.perf_counter()
    draft, target, tokenizer = load_pair(draft_dir, target_dir, device=run.device, compile=compiled,
                                         draft_quantization="none")
    row = {"load_seconds": time.perf_counter() - started,
           "compiled": [hasattr(m, "specdec_static") for m in (draft, target)],
           # the compiled code called past torch.compile's wrapper and guards (CPU only: CUDA keeps the guards)
           "called_directly": [hasattr(m, "specdec_static") and m.specdec_static.called_directly
                               for m in (draft, target)]}
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    ids = encode_prompt(tokenizer, overhead.PROMPT, False)
    for method in overhead.METHODS:
        row[method] = overhead.repeated(overhead.in_process, run.args.repeats, decoder, ids, method, run.args.tokens)
    if compiled and all(row["compiled"]):
        row["next_turn"] = next_turn(draft, target, tokenizer, run.args.repeats)
    return row


def next_turn(draft, target, tokenizer, repeats: int, new_tokens: int = 8) -> dict:
    """The compiled path's prompt cache: a conversation's next turn (its history, up to 900 tokens, then a short
    question), Google greedy, the time to its first token and the tokens cached, medians of `repeats`: starting
    from what the last request left in the static caches (`held`), from the prompt cache's copy (a request for
    another prompt in between wrote over the static caches: `copy`), and prefilled whole (`none`)."""
    decoder = SpeculativeDecoder(draft, target, tokenizer, prompt_cache_bytes=1 << 30)
    room = min(model.specdec_static.max_len for model in (draft, target))
    question = encode_prompt(tokenizer, "\nAnd the same in Rust?", False)
    history = (encode_prompt(tokenizer, overhead.PROMPT, False) * 1000)[: min(900, room // 2)]
    turn, other = history + question, question * 4
    settings = {"max_new_tokens": new_tokens, "method": "google", "gamma": 4, "temperature": 0.0}
    runs: dict[str, list] = {"held": [], "copy": [], "none": []}
    for _ in range(repeats):
        for path in runs:
            decoder.generate(history, max_new_tokens=1, temperature=0.0)  # the last turn: leaves the history held
            decoder.prompt_cache.clear()  # no copy of an earlier turn (which holds more than the history)
            if path == "copy":
                decoder.generate(other, max_new_tokens=1, temperature=0.0)
            stats = decoder.generate(turn, cache_prompt=path != "none", **settings).stats
            runs[path].append((stats.first_chunk_seconds, stats.cached_tokens or 0))
    return {"prompt_tokens": len(turn),
            **{path: {"first_token_seconds": statistics.median(seconds for seconds, _ in rows),
                      "cached_tokens": rows[-1][1]} for path, rows in runs.items()}}


def stage_hf(run: Run) -> dict:
    draft_dir, target_dir = run.pair()
    from transformers import AutoTokenizer

    ids = encode_prompt(AutoTokenizer.from_pretrained(target_dir), overhead.PROMPT, False)
    return overhead.hugging_face(draft_dir, target_dir, ids, run.args.tokens, run.args.repeats, run.device)


def stage_service(run: Run, compiled: bool) -> dict:
    draft_dir, target_dir = run.pair()
    started = time.perf_counter()
    name = "compiled" if compiled else "eager"
    server = overhead.Server(run.folder / f"{name}.log", draft_model=draft_dir, target_model=target_dir,
                             device=run.device, compile=str(compiled).lower(), draft_quantization="none",
                             max_new_tokens_limit=max(run.args.tokens, 1024))
    floor = FloorServer(run.folder / f"{name}-floor.log")
    try:
        server.wait_ready(timeout=max(60, run.left() - 30))
        floor.wait_ready()
        rows = {"ready_seconds": time.perf_counter() - started}
        for method in overhead.METHODS:
            for stream in (False, True):
                rows[f"{method}/{'sse' if stream else 'json'}"] = overhead.repeated(
                    overhead.through_service, run.args.repeats, server, method, run.args.tokens, stream)
            # what HTTP through gunicorn's gevent worker adds on this machine to a request as long, no service in it
            served = rows[f"{method}/json"]
            rows[f"{method}/floor"] = overhead.repeated(overhead.through_floor, run.args.repeats, floor,
                                                        served["engine_seconds"], int(served["bytes"]),
                                                        run.args.tokens)
        return rows
    finally:
        server.stop()
        floor.stop()
        shutil.copy(server.log_path, Path(run.args.out).parent / f"gpu-{name}-service.log")


def stage_random_7b(run: Run) -> dict:
    vocab = 512 if run.args.tiny else 32000
    target = build("tiny-target" if run.args.tiny else "target-7b", vocab, run.device, run.dtype)
    draft = build("tiny-draft" if run.args.tiny else "draft-0.5b", vocab, run.device, run.dtype)
    device = torch.device(run.device)
    one_draft = forward_ms(draft, run.args.context, 1, device, run.args.repeats)
    verify = forward_ms_by_width(target, run.args.context, list(range(1, 10)), device, run.args.repeats)
    prompt = torch.randint(0, vocab, (run.args.context,)).tolist()
    row = {"draft_one_token_ms": one_draft, "target_ms_by_width": verify,
           "eager": random_pair_rates(SpeculativeDecoder(draft, target), prompt, run.args.tokens)}
    from specdec.compiled import compile_model

    started = time.perf_counter()
    compiled = [compile_model(model, device) for model in (draft, target)]
    row["compile_seconds"] = time.perf_counter() - started
    row["compiled"] = random_pair_rates(SpeculativeDecoder(draft, target), prompt, run.args.tokens) \
        if all(compiled) else None
    return row


def stage_int4(run: Run) -> dict:
    """The target on torch's int4 kernel (specdec.cuda.int4pack, `quantize = int4`): the default pair's target
    shape and a ~7B Llama shape, random weights quantized to 4-bit groups in place. For each: forward ms by width in
    bfloat16 and int4, whether one layer's rows keep their bits whatever rows come with them, and target-only /
    Google (gamma 4, greedy, the 0.5B-shape draft in bfloat16) tokens/s with greedy speculative output compared to
    target-only's."""
    from specdec.cuda.int4pack import Int4PackLinear, int4pack_model

    draft_dir, target_dir = run.pair()
    device = torch.device(run.device)
    _, draft, _ = load_pair(draft_dir, draft_dir, device=run.device, compile=False, draft_quantization="none")
    rows = {}
    shapes = [("default-target", None), ("target-7b", "tiny-target" if run.args.tiny else "target-7b")]
    for name, shape in shapes:
        if run.left() < 60:
            rows[name] = {"skipped": "out of time"}
            break
        if shape is None:
            _, target, _ = load_pair(draft_dir, target_dir, device=run.device, compile=False,
                                     draft_quantization="none", cpu_kernels=False)
        else:
            target = build(shape, draft.config.vocab_size, run.device, run.dtype)
        row = {"bf16_ms_by_width": forward_ms_by_width(target, run.args.context, WIDTHS, device, run.args.repeats)}
        started = time.perf_counter()
        row["layers"] = int4pack_model(target)
        row["quantize_seconds"] = time.perf_counter() - started
        if not row["layers"]:
            rows[name] = {**row, "skipped": "no layer the kernel takes"}
            continue
        row["int4_ms_by_width"] = forward_ms_by_width(target, run.args.context, WIDTHS, device, run.args.repeats)
        layer = next(m for m in target.modules() if isinstance(m, Int4PackLinear))
        x = torch.randn(9, layer.in_features, device=device, dtype=layer.compute_dtype)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(9)])
        row["rows_keep_their_bits"] = all(torch.equal(layer(x[:n]), alone[:n]) for n in (2, 5, 9))
        room = min(target.config.max_position_embeddings, draft.config.max_position_embeddings) - run.args.tokens
        prompt = torch.randint(0, draft.config.vocab_size, (max(1, min(run.args.context, room)),)).tolist()
        decoder = SpeculativeDecoder(draft, target)
        outputs = {}
        for method in ("target", "google"):
            params = dict(max_new_tokens=run.args.tokens, method=method, gamma=4, temperature=0, eos_token_id=[])
            decoder.generate(prompt, **params)
            result = decoder.generate(prompt, **params)
            row[f"{method}_tokens_per_second"] = result.stats.tokens_per_second
            outputs[method] = result.token_ids
        row["google_acceptance_rate"] = result.stats.acceptance_rate  # the last run's: Google's
        row["greedy_google_equals_target"] = outputs["google"] == outputs["target"]
        rows[name] = row
        print(f"int4 {name}: {json.dumps(row)}", flush=True)
        run.report["stages"]["int4"] = rows
        run.save()
        del target, decoder
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def random_pair_rates(decoder: SpeculativeDecoder, prompt: list[int], tokens: int) -> dict:
    """Target-only and Google (gamma 4, greedy) tokens/s on a random pair, after a warm-up."""
    rates = {}
    for method in ("target", "google"):
        params = dict(max_new_tokens=tokens, method=method, gamma=4, temperature=0, eos_token_id=[])
        decoder.generate(prompt, **params)
        rates[method] = decoder.generate(prompt, **params).stats.tokens_per_second
    return rates


# name: (function, seconds it needs at least to be worth starting)
STAGES = {
    "forwards": (stage_forwards, 30),
    "eager": (lambda run: stage_in_process(run, False), 30),
    "hf": (stage_hf, 30),
    "int4": (stage_int4, 60),
    "eager-service": (lambda run: stage_service(run, False), 60),
    "compiled-forwards": (stage_compiled_forwards, 60),
    "compiled": (lambda run: stage_in_process(run, True), 90),
    "random-7b": (stage_random_7b, 90),
    "compiled-service": (lambda run: stage_service(run, True), 120),
}


def projection(report: dict, acceptance_length: float, gamma: int = 4) -> dict | None:
    """Google's tokens/s from the measured eager forwards, at a given acceptance length: each round costs gamma
    draft steps and one target forward over gamma+1 tokens; engine time outside the forwards is left out."""
    forwards = report["stages"].get("forwards", {}).get("ms_by_width")
    if not forwards or str(gamma + 1) not in {str(k) for k in forwards["target"]}:
        return None
    draft, target = ({int(k): v for k, v in forwards[name].items()} for name in ("draft", "target"))
    round_ms = gamma * draft[1] + target[gamma + 1]
    return {"acceptance_length": acceptance_length, "gamma": gamma, "round_ms": round_ms,
            "google_tokens_per_second": 1e3 * acceptance_length / round_ms,
            "target_only_tokens_per_second": 1e3 / target[1]}


def summary(report: dict) -> str:
    lines = [f"GPU run on {report['machine'].get('cuda') or report['machine']['cpu']} ({report['device']}), "
             f"pair: {report.get('pair')}; skipped: {report['skipped'] or 'none'}; "
             f"failed: {failed_stages(report) or 'none'}"]
    for name, row in report["stages"].items():
        lines.append(f"## {name}\n{json.dumps(row, indent=1, default=str)}")
    if report.get("projection"):
        lines.append(f"## projection (not a measurement)\n{json.dumps(report['projection'], indent=1)}")
    return "\n".join(lines)


def failed_stages(report: dict) -> list[str]:
    """The stages that raised (each reported with its error), or whose rows did."""
    return [name for name, row in report["stages"].items()
            if "error" in row or any(isinstance(part, dict) and "error" in part for part in row.values())]


def main(argv=None) -> int:
    """Runs every stage asked for (one that fails is reported and the next still runs); exit status 1 if any
    failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny pair and tiny random shapes")
    parser.add_argument("--shapes", default=None, help="draft/ and target/ folders: configs and tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--budget", type=float, default=520, help="seconds: a stage that would not fit is skipped")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, in the order to run")
    parser.add_argument("--acceptance-length", type=float, default=4.0)
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.stages.split(",") if name not in STAGES]:
        parser.error(f"--stages: unknown {', '.join(unknown)} (choose from {', '.join(STAGES)})")
    for name in ("context", "repeats", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    with tempfile.TemporaryDirectory() as scratch:
        run = Run(args, Path(scratch))
        for name in args.stages.split(","):
            function, needs = STAGES[name]
            if run.left() < needs:
                run.report["skipped"].append(name)
                continue
            started = time.perf_counter()
            try:
                row = function(run)
            except Exception as error:  # a stage that fails is reported; the next one still runs
                row = {"error": f"{type(error).__name__}: {error}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
            row["stage_seconds"] = time.perf_counter() - started
            run.report["stages"][name] = row
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            run.save()
        run.report["projection"] = projection(run.report, args.acceptance_length)
        run.save()
    print(summary(run.report))
    return 1 if failed_stages(run.report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
