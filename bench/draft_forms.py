"""The default pair's draft in two forms, paired on the same prompts: the shipped draft (its own 5- to 8-bit groups,
`draft_quantization = "int8"`) against it requantized to 4-bit groups (`"int4"`), beside the shipped target alone.

    python -m bench.draft_forms --out bench/results/draft-int4

After a warm-up, each prompt runs target-only, then Google and the draft alone with each form, one after the other
(the machine's speed drifts, so only ratios within a prompt are compared); greedy, EOS ignored, decode tokens/s
(past the first round); `--threshold` sets the draft-confidence stop (default none). Writes results.json and
results.md.
"""

import argparse
import json
import sys
import time

FORMS = ("int8", "int4")


def measure(args) -> list[dict]:
    import torch

    from bench.prompts import DEFAULT_PROMPTS, encode, load_prompts
    from specdec.engine import SpeculativeDecoder
    from specdec.models.pair import load_pair

    torch.set_num_threads(args.threads)
    items = {item["id"]: item for item in load_prompts(DEFAULT_PROMPTS)}
    drafts, target = {}, None
    for form in FORMS:  # one target for both: the int4 pair's own is dropped
        drafts[form], loaded, tokenizer = load_pair(device="cpu", weights="shipped", draft_quantization=form)
        target = loaded if target is None else target
    del loaded
    decoders = {form: SpeculativeDecoder(draft, target, tokenizer) for form, draft in drafts.items()}
    prompts = args.prompts or list(items)
    for decoder in decoders.values():  # warm-up: the first calls build what later ones reuse
        for method in ("target", "google", "draft"):
            decoder.generate(encode(tokenizer, items[prompts[0]]), max_new_tokens=8, method=method, gamma=args.gamma,
                             temperature=0, eos_token_id=[])
    rows = []
    for repeat in range(args.repeats):
        for prompt in prompts:
            ids = encode(tokenizer, items[prompt])
            row = {"prompt": prompt, "repeat": repeat}
            for name, form, method in (("target", "int8", "target"), *((f"google-{f}", f, "google") for f in FORMS),
                                       *((f"draft-{f}", f, "draft") for f in FORMS)):
                result = decoders[form].generate(ids, max_new_tokens=args.tokens, method=method, gamma=args.gamma,
                                                 temperature=0, eos_token_id=[],
                                                 draft_confidence_threshold=args.threshold)
                row[name] = result.stats.decode_tokens_per_second
                if method == "google":
                    row[f"{name}-acceptance"] = result.stats.acceptance_rate
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def report(rows: list[dict], command: str, when: str) -> tuple[dict, str]:
    from bench.machine import machine_info
    from bench.summary import ratios

    summary = {
        "google-int4 / google-int8": ratios(rows, "google-int4", "google-int8"),
        "draft-int4 / draft-int8": ratios(rows, "draft-int4", "draft-int8"),
        "google-int8 / target": ratios(rows, "google-int8", "target"),
        "google-int4 / target": ratios(rows, "google-int4", "target"),
    }
    lower = sum(r["google-int4-acceptance"] < r["google-int8-acceptance"] for r in rows)
    higher = sum(r["google-int4-acceptance"] > r["google-int8-acceptance"] for r in rows)
    machine = machine_info()
    lines = [f"# The draft's forms, paired, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}", "",
             "Default pair, shipped target; draft int8: its own GGUF groups; int4: requantized to 4-bit groups. "
             "Greedy, EOS ignored, decode tokens/s past the first round. Ratios: median over prompts and repeats of "
             "the ratio within each (range in brackets).", "",
             "| ratio | median | range |", "|---|---|---|"]
    lines += [f"| {name} | {r['median']:.2f}x | {r['low']:.2f}-{r['high']:.2f}x |" for name, r in summary.items()]
    lines += ["", f"Acceptance with the int4 draft: lower on {lower}, higher on {higher}, equal on "
                  f"{len(rows) - lower - higher} of {len(rows)} runs.", "",
              "| prompt | repeat | target | google int8 (acceptance) | google int4 (acceptance) | draft int8 | draft int4 |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['repeat']} | {r['target']:.1f} | {r['google-int8']:.1f} "
              f"({r['google-int8-acceptance']:.2f}) | {r['google-int4']:.1f} ({r['google-int4-acceptance']:.2f}) | "
              f"{r['draft-int8']:.1f} | {r['draft-int4']:.1f} |" for r in rows]
    return {"summary": summary, "acceptance_lower": lower, "acceptance_higher": higher}, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.machine import command_line, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=lambda v: v.split(","), default=None,
                        help="ids of bench/prompts.jsonl, comma-separated (default: all)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threshold", type=float, default=0.0,
                        help="the draft-confidence stop (the service's default for this pair: 0.6)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/draft-int4")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = measure(args)
    command = command_line("bench.draft_forms", argv)
    summary, markdown = report(rows, command, when)
    save_results(args.out, {"command": command, "when": when, **summary, "runs": rows}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
