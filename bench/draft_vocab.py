"""The draft over part of its vocabulary (`draft_vocab_size`, specdec/models/draft_vocab.py), paired on the same
prompts: Google with the draft's whole output layer against it over its first N ids (and the special tokens).

    python -m bench.draft_vocab --sizes 32768,65536 --out bench/results/draft-vocab

The default pair is loaded once with the whole vocabulary; each size's output layer is a view of the same
weights, swapped in before its runs. After a warm-up, each prompt runs target-only, then Google with the whole
vocabulary and with each size (greedy, EOS ignored, decode tokens/s past the first round). Greedy output is the
target's whatever the draft, so every run of a prompt must give the same tokens: the report counts any that do
not. Writes results.json and results.md.
"""

import argparse
import json
import statistics
import sys
import time


def measure(args) -> list[dict]:
    import torch

    from bench.prompts import DEFAULT_PROMPTS, encode, load_prompts
    from specdec.engine import SpeculativeDecoder
    from specdec.models.draft_vocab import partial_head
    from specdec.models.pair import load_pair

    torch.set_num_threads(args.threads)
    items = load_prompts(DEFAULT_PROMPTS, args.limit)
    draft, target, tokenizer = load_pair(device="cpu", draft_vocab_size=0)
    full = draft.get_output_embeddings()
    heads = {0: full, **{size: partial_head(full, tokenizer, size) for size in args.sizes}}
    decoder = SpeculativeDecoder(draft, target, tokenizer)

    def run(ids, method, size=0):
        draft.set_output_embeddings(heads[size])
        return decoder.generate(ids, max_new_tokens=args.tokens, method=method, gamma=args.gamma, temperature=0,
                                eos_token_id=[])

    for size in heads:  # warm-up
        run(encode(tokenizer, items[0]), "google", size)
    rows = []
    for repeat in range(args.repeats):
        for item in items:
            ids = encode(tokenizer, item)
            reference = run(ids, "target")
            row = {"prompt": item["id"], "repeat": repeat, "target": reference.stats.decode_tokens_per_second,
                   "differ": 0}
            for size in heads:
                result = run(ids, "google", size)
                row[f"google-{size}"] = result.stats.decode_tokens_per_second
                row[f"acceptance-{size}"] = result.stats.acceptance_rate
                row["differ"] += result.token_ids != reference.token_ids
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    draft.set_output_embeddings(full)
    return rows


def report(rows: list[dict], sizes: list[int], command: str, when: str) -> tuple[dict, str]:
    from bench.machine import machine_info
    from bench.summary import ratios

    summary = {"google / target, whole vocabulary": ratios(rows, "google-0", "target")}
    for size in sizes:
        summary[f"google {size} / google whole"] = ratios(rows, f"google-{size}", "google-0")
        summary[f"google {size} / target"] = ratios(rows, f"google-{size}", "target")
    acceptance = {size: statistics.mean(r[f"acceptance-{size}"] for r in rows) for size in [0, *sizes]}
    differ = sum(r["differ"] for r in rows)
    machine = machine_info()
    lines = [f"# The draft over part of its vocabulary, paired, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}", "",
             "Default pair (shipped weights, the draft's whole output layer or its first N ids and the special "
             "tokens), greedy, EOS ignored, decode tokens/s past the first round, Google gamma 4. Ratios: median "
             "over prompts of the ratio within each (range in brackets).", "",
             "| ratio | median | range |", "|---|---|---|"]
    lines += [f"| {name} | {r['median']:.2f}x | {r['low']:.2f}-{r['high']:.2f}x |" for name, r in summary.items()]
    lines += ["", "Mean acceptance: " + ", ".join(f"{'whole' if size == 0 else size} {value:.3f}"
                                                  for size, value in acceptance.items()) + ".",
              f"Runs whose tokens differ from target-only's: {differ}.", "",
              "| prompt | target | " + " | ".join(f"google {'whole' if s == 0 else s} (acceptance)"
                                                   for s in [0, *sizes]) + " |",
              "|---|---|" + "---|" * (len(sizes) + 1)]
    lines += [f"| {r['prompt']} | {r['target']:.1f} | " + " | ".join(
        f"{r[f'google-{s}']:.1f} ({r[f'acceptance-{s}']:.2f})" for s in [0, *sizes]) + " |" for r in rows]
    return {"summary": summary, "acceptance": acceptance, "differ": differ}, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.machine import command_line, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda v: [int(s) for s in v.split(",")], default=[32768, 65536])
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of bench/prompts.jsonl")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/draft-vocab")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = measure(args)
    command = command_line("bench.draft_vocab", argv)
    summary, markdown = report(rows, args.sizes, command, when)
    save_results(args.out, {"command": command, "when": when, **summary, "runs": rows}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
