"""The benchmark behind `make bench`: generated tokens/s of every method on the committed prompt sets.

Prompt sets: `default` (bench/prompts.jsonl: completion, instructions, chat, summaries) and `grounded`
(bench/prompts_grounded.jsonl: rewriting given code, fixing a bug and returning the file, quoting a passage,
extending a repetitive structure), each greedy and sampled (T=0.7, top-p 0.9).

Our methods are named drafter-verification: `model-token` (Google speculative sampling with the draft model),
`model-block`, `lookup-token`, `lookup-block`, `hybrid-token`, `hybrid-block`; an `-adaptive` suffix picks the
draft length adaptively, `-deepmind` the DeepMind variant (`google`, `deepmind` and `adaptive` are the
model-token ones), `-g8` sets gamma to 8 for this method alone, and `-c0.5` the draft model's confidence stop
(draft_confidence_threshold) to 0.5, where the methods without it take SamplingParams' default; for lookup and
hybrid, `-k8` sets the lookup's max_tokens to 8, and for hybrid `-h3` its hybrid_min_match to 3 and `-x` turns
on extend, over the run's `--lookup` settings (so one run can interleave lookup settings per prompt); `target` and
`draft` decode with one model alone. Hugging Face baselines run `generate` on the models exactly as
`from_pretrained` loads them: `hf_lookup` (its prompt lookup, prompt_lookup_num_tokens=10), `hf_assisted`
(assisted generation with the draft), and on request `hf_target` and `hf_assisted_own_memory`
(assisted generation with the library's layers on weights copied into the process's memory, as ours are) and
`hf_assisted_fixed_threshold` (assisted generation without refitting the assistant's confidence threshold after
every round, as it runs where scikit-learn is not installed; bench.methods.fixed_confidence_threshold).
For every speculative run, the blocks it drafted are also scored under both verification rules
(EXPECTED_ACCEPTED): block verification's gain in accepted tokens per round on the same proposals.
Only generated tokens count, never prompt tokens. Results go to JSON, a Markdown table and a PNG plot, with
the command, the machine, the date and prompt lookup's settings (`--lookup KEY=VALUE,...` changes them);
`--from-runs` rebuilds them from the runs of earlier reports.

This module is the command line and the plan of runs; bench/methods.py runs the methods, bench/summary.py
summarises the runs, bench/report.py and bench/plot.py write the table and the plot.
"""

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from bench.forwards import verification_cost
from bench.machine import machine_info
from bench.methods import (
    EXTRA_METHODS,
    HF_ALL,
    HF_METHODS,
    HF_PROMPT_LOOKUP_TOKENS,
    MODES,
    OUR_METHODS,
    measured_models,
    our_method,
    ours_draft,
    ours_target,
    run_hf,
    run_ours,
    stock_layers,
)
from bench.plot import plot, plottable
from bench.prompts import PROMPT_SETS, encode, load_prompts
from bench.report import markdown
from bench.summary import summarise
from specdec.engine import LookupSettings, SpeculativeDecoder
from specdec.kv_cache import input_device
from specdec.models.pair import load_pair
from specdec.models.quantization import DRAFT_QUANTIZATIONS


def startup_profile(args) -> dict:
    """load_pair and the service's warm-up in a fresh process (bench/startup.py): load seconds, the weights'
    bytes, steady and peak resident memory, and each step's seconds. The benchmark's own process holds more (the
    stock pair for Hugging Face's baselines and our copies), so its memory says nothing about a start."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "startup.json"
        command = [sys.executable, "-m", "bench.startup", "--json", str(out), "--device", args.device,
                   "--dtype", args.dtype, "--draft-quantization", args.draft_quantization]
        command += [flag for name, flag in (("draft", "--draft"), ("target", "--target")) if getattr(args, name)
                    for flag in (flag, getattr(args, name))]
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def mode_list(text: str) -> list[str]:
    """--modes: names from MODES, comma-separated."""
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(unknown) or '(none)'}; use {', '.join(MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None, help="draft model (default: the default pair)")
    parser.add_argument("--target", default=None, help="target model (default: the default pair)")
    parser.add_argument("--prompt-sets", default=",".join(PROMPT_SETS),
                        help=f"comma-separated, of {', '.join(PROMPT_SETS)}, or NAME=PATH for another JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each set")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="as the service's default max_new_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--modes", default="greedy,sampling", type=mode_list,
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--methods", default=",".join(OUR_METHODS + HF_METHODS),
                        help=f"comma-separated; also available: {', '.join(EXTRA_METHODS)}, and any of ours with "
                             "the suffixes -adaptive, -deepmind, -g<gamma>, -c<threshold>, and for lookup and hybrid "
                             "-k<max_tokens>, -h<hybrid_min_match>, -x (extend)")
    parser.add_argument("--sweep-gammas", default="", help="gammas for a greedy sweep of model-token ('' for none)")
    parser.add_argument("--sweep-prompts", type=int, default=4, help="prompts of each set used by the gamma sweep")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-quantization", default="auto", choices=DRAFT_QUANTIZATIONS,
                        help="our methods' draft, as load_pair gives it (HF baselines always use the stock draft)")
    parser.add_argument("--lookup", type=lookup_settings, default=LookupSettings(),
                        help="prompt lookup's settings, as KEY=VALUE,... of specdec.drafters.LookupSettings "
                             "(e.g. hybrid_min_match=3,extend=true); unnamed ones keep their defaults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-runs", default=None,
                        help="comma-separated results.json files: summarise their runs instead of running")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--no-startup", dest="startup", action="store_false",
                        help="skip the start-up profile (load time and resident memory, in a fresh process)")
    return parser


def prompt_sets(spec: str) -> dict[str, Path]:
    sets = {}
    for item in (part for part in spec.split(",") if part):
        name, _, path = item.partition("=")
        sets[name] = Path(path) if path else PROMPT_SETS[name]
    return sets


def lookup_settings(text: str) -> LookupSettings:
    """`--lookup`'s KEY=VALUE,... as LookupSettings; an unknown key or a bad value is an argparse error."""
    fields = {field.name: field for field in dataclasses.fields(LookupSettings)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in fields:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        key, value = key.strip(), value.strip().lower()
        if fields[key].type in (bool, "bool"):
            if value not in ("true", "false", "1", "0"):
                raise argparse.ArgumentTypeError(f"{key}: expected true or false, got {value!r}")
            values[key] = value in ("true", "1")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{key}: expected an integer, got {value!r}") from None
    try:
        return LookupSettings(**values)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def measure(args, methods: list[str], modes: list[str],
            sets: dict[str, Path]) -> tuple[list[dict], dict, dict, dict]:
    """Run the plan; (runs, the verification cost by width, {set: number of prompts}, `measured_models`)."""
    sweep_gammas = [int(g) for g in args.sweep_gammas.split(",") if g]
    prompts = {name: load_prompts(path, args.limit) for name, path in sets.items()}
    # prompt-major: every method, Hugging Face's included, runs on a prompt before the next prompt, so a shared
    # machine's drift in speed lands on all methods alike instead of on whichever ran last
    plan = [(name, mode, method, i, rep, None) for name in prompts for mode in modes
            for i in range(len(prompts[name])) for rep in range(args.repeats) for method in methods]
    plan += [(name, "greedy", "model-token", i, 0, g) for name in prompts
             for i in range(min(args.sweep_prompts, len(prompts[name]))) for g in sweep_gammas if "greedy" in modes]
    planned = {step[2] for step in plan}
    verify_width = max([args.gamma] + sweep_gammas + [HF_PROMPT_LOOKUP_TOKENS, 10]) + 1
    decoder = None
    if planned & set(HF_ALL):
        # the stock pair for Hugging Face's baselines, and copies of it for ours
        draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                                             cpu_kernels=False, draft_quantization="none")
        cost = {"stock": verification_cost(target, verify_width)}
        if planned - set(HF_ALL):
            decoder = SpeculativeDecoder(ours_draft(draft, args.draft_quantization), ours_target(target),
                                         tokenizer, lookup=args.lookup)
            if decoder.target_model is not target:
                cost["ours"] = verification_cost(decoder.target_model, verify_width)
    else:  # ours alone: the pair as load_pair gives it to the service, with no stock pair held beside it
        draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                                             draft_quantization=args.draft_quantization)
        decoder = SpeculativeDecoder(draft, target, tokenizer, lookup=args.lookup)
        with stock_layers(target) as stock:
            cost = {"stock": verification_cost(stock, verify_width)}
        if input_device(target).type == "cpu":
            cost["ours"] = verification_cost(target, verify_width)
    encoded = {name: [encode(tokenizer, item) for item in items] for name, items in prompts.items()}
    # HF on weights in the process's memory: our target's copy with stock layers, and a float copy of the draft
    own_draft = copy.deepcopy(draft) if "hf_assisted_own_memory" in planned and input_device(draft).type == "cpu" \
        else draft

    runs = []
    for name, mode, method, i, rep, sweep_gamma in tqdm(plan, desc="bench", unit="run", file=sys.stderr):
        seed = args.seed + 1000 * rep + i
        ids = encoded[name][i]
        if method == "hf_assisted_own_memory":
            with stock_layers(decoder.target_model) as own_target:
                stats = run_hf(method, own_draft, own_target, ids, args.max_new_tokens, MODES[mode], seed)
        elif method in HF_ALL:  # both models as from_pretrained loads them
            stats = run_hf(method, draft, target, ids, args.max_new_tokens, MODES[mode], seed)
        else:
            stats = run_ours(method, decoder, ids, args.max_new_tokens, MODES[mode], seed, sweep_gamma or args.gamma)
        runs.append({"set": name, "mode": mode, "method": method, "prompt": prompts[name][i]["id"], "repeat": rep,
                     "sweep_gamma": sweep_gamma, **{k: v for k, v in stats.items() if k != "method"}})
    return runs, cost, {name: len(items) for name, items in prompts.items()}, \
        measured_models(target, decoder.draft_model if decoder else None)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in HF_ALL:
            our_method(method, args.gamma)  # an unknown name fails here, before any model loads
    modes = args.modes
    settings = {name: getattr(args, name) for name in ("max_new_tokens", "repeats", "gamma")}
    if args.from_runs:
        earlier = [json.loads(Path(path).read_text(encoding="utf-8")) for path in args.from_runs.split(",")]
        runs = [run for report in earlier for run in report["runs"]]
        runs_from = [f"`{report['command']}` ({report['date']})" for report in earlier]
        lookup = earlier[0].get("lookup")
        cost = earlier[0].get("verification_cost", {})
        startup = earlier[0].get("startup")
        models = {"dtype": earlier[0].get("dtype"),
                  "draft_quantization": earlier[0].get("draft_quantization", args.draft_quantization)}
        # what the runs were measured with, not this command's defaults
        settings = {name: earlier[0].get(name, value) for name, value in settings.items()}
        sizes: dict[str, int] = {}
        for run in runs:
            run.setdefault("set", "default")
            sizes.setdefault(run["set"], len({r["prompt"] for r in runs if r.get("set", "default") == run["set"]}))
    else:
        startup = startup_profile(args) if args.startup else None  # first, while nothing else is resident
        runs, cost, sizes, models = measure(args, methods, modes, prompt_sets(args.prompt_sets))
        runs_from, lookup = None, dataclasses.asdict(args.lookup)  # the decoder's, as measure() makes it

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.benchmark"] + (argv if argv is not None else sys.argv[1:])),
              "machine": machine_info(), "draft": args.draft or "default", "target": args.target or "default",
              **models, "prompts": sizes,
              **settings, "runs_from": runs_from, "lookup": lookup, "startup": startup, "verification_cost": cost,
              "summary": {name: summarise([r for r in runs if r["set"] == name], settings["gamma"]) for name in sizes},
              "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(report), encoding="utf-8")
    written = [out / "results.json", out / "results.md"]
    (out / "results.png").unlink(missing_ok=True)  # an earlier run's plot would pass for this one's
    drawn = plottable(report)
    if drawn:
        plot(report, out / "results.png")
        written.append(out / "results.png")
    print(markdown(report))
    print("wrote " + ", ".join(map(str, written))
          + ("" if drawn else " (no plot: without our target-only there is no speedup to draw)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
