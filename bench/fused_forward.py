"""The fused forward (specdec/fused_forward.py) against the library's, paired on the same prompts: target-only and
Google on the default pair as `load_pair` loads it, each prompt run through both forwards one after the other.

    python -m bench.fused_forward --out bench/results/fused-forward

After a warm-up, each prompt runs target-only and Google (gamma 4) with the library's forward, then with the fused
one; greedy, EOS ignored, decode tokens/s (past the first round). The machine's speed drifts, so only ratios
within a prompt are compared. The two forwards give the same logits bitwise, so each pair of runs must give the
same tokens: the report counts any that do not. Writes results.json and results.md.
"""

import argparse
import contextlib
import json
import sys
import time

PATHS = ("library", "fused")
METHODS = ("target", "google")


@contextlib.contextmanager
def forward_path(path: str):
    """The models' forward for the duration: "fused" (as the engine has it) or the library's own."""
    from specdec import kv_cache

    if path == "fused":
        yield
        return
    original = kv_cache.fused_forward
    kv_cache.fused_forward = lambda model: None
    try:
        yield
    finally:
        kv_cache.fused_forward = original


def measure(args) -> list[dict]:
    import torch

    from bench.prompts import DEFAULT_PROMPTS, encode, load_prompts
    from specdec.engine import SpeculativeDecoder
    from specdec.models.pair import load_pair

    torch.set_num_threads(args.threads)
    items = load_prompts(DEFAULT_PROMPTS, args.limit)
    draft, target, tokenizer = load_pair(device="cpu", draft_quantization=args.draft_quantization)
    decoder = SpeculativeDecoder(draft, target, tokenizer)

    def run(ids, method):
        return decoder.generate(ids, max_new_tokens=args.tokens, method=method, gamma=args.gamma, temperature=0,
                                eos_token_id=[])

    for path in PATHS:  # warm-up: the first calls build what later ones reuse (the fused forward's joined weights)
        with forward_path(path):
            for method in METHODS:
                run(encode(tokenizer, items[0]), method)
    rows = []
    for repeat in range(args.repeats):
        for item in items:
            ids = encode(tokenizer, item)
            row = {"prompt": item["id"], "repeat": repeat}
            for method in METHODS:
                tokens = {}
                for path in PATHS:
                    with forward_path(path):
                        result = run(ids, method)
                    row[f"{method}-{path}"] = result.stats.decode_tokens_per_second
                    tokens[path] = result.token_ids
                row[f"{method}-same-tokens"] = tokens["library"] == tokens["fused"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def report(rows: list[dict], command: str, when: str, args) -> tuple[dict, str]:
    from bench.machine import machine_info
    from bench.summary import ratios

    summary = {f"{method}: fused / library": ratios(rows, f"{method}-fused", f"{method}-library")
               for method in METHODS}
    summary.update({f"google / target, {path}": ratios(rows, f"google-{path}", f"target-{path}") for path in PATHS})
    differ = {method: sum(not r[f"{method}-same-tokens"] for r in rows) for method in METHODS}
    machine = machine_info()
    lines = [f"# The fused forward against the library's, paired, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}, torch threads {args.threads}", "",
             f"Default pair as `load_pair` loads it (draft_quantization {args.draft_quantization}), greedy, EOS "
             f"ignored, {args.tokens} new tokens, gamma {args.gamma}; decode tokens/s past the first round. Ratios: "
             "median over prompts and repeats of the ratio within each (range in brackets).", "",
             "| ratio | median | range |", "|---|---|---|"]
    lines += [f"| {name} | {r['median']:.2f}x | {r['low']:.2f}-{r['high']:.2f}x |" for name, r in summary.items()]
    lines += ["", f"Runs whose tokens differ between the two forwards: target-only {differ['target']}, Google "
                  f"{differ['google']}, of {len(rows)}.", "",
              "| prompt | repeat | target, library | target, fused | Google, library | Google, fused |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['repeat']} | {r['target-library']:.1f} | {r['target-fused']:.1f} | "
              f"{r['google-library']:.1f} | {r['google-fused']:.1f} |" for r in rows]
    return {"summary": summary, "tokens_differ": differ}, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.machine import command_line, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of bench/prompts.jsonl")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-quantization", default="int8")
    parser.add_argument("--out", default="bench/results/fused-forward")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = measure(args)
    command = command_line("bench.fused_forward", argv)
    summary, markdown = report(rows, command, when, args)
    save_results(args.out, {"command": command, "when": when, **summary, "runs": rows}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
