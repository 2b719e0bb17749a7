"""A decode step after a long context: the library's DynamicCache (every layer copies its whole cache each step,
torch.cat) against ours (`kv_cache.GrowingLayer`: new positions written in place), each model of the default pair.

    python -m bench.cache_growth --contexts 64,1024,3072 --out bench/results/cache-growth

Per context length and model: a random prompt of that many tokens is prefilled, then `--steps` greedy decode
steps are timed (after 3 untimed ones), the two caches taking turns `--repeats` times; the tokens both decode
are compared. Writes results.json and results.md.
"""

import argparse
import json
import statistics
import sys
import time


def step_ms(model, cache, context: int, steps: int) -> tuple[float, list[int]]:
    """Milliseconds per greedy decode step after a random prompt of `context` tokens, and the tokens decoded."""
    import torch

    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(context))
    tokens = []
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        for i in range(3 + steps):
            if i == 3:
                start = time.perf_counter()
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits
    return (time.perf_counter() - start) / steps * 1e3, tokens


def measure(args) -> list[dict]:
    import torch
    from transformers import DynamicCache

    from specdec.kv_cache import growing_cache
    from specdec.models.pair import load_pair

    torch.set_num_threads(args.threads)
    draft, target, _ = load_pair(device="cpu")
    rows = []
    for role, model in (("draft", draft), ("target", target)):
        for context in args.contexts:
            times = {"library": [], "growing": []}
            decoded = {}
            for _ in range(args.repeats):
                for name, make in (("library", lambda: DynamicCache(config=model.config)),
                                   ("growing", lambda: growing_cache(model.config))):
                    ms, decoded[name] = step_ms(model, make(), context, args.steps)
                    times[name].append(ms)
            row = {"model": role, "context": context, **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                   "same_tokens": decoded["library"] == decoded["growing"]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def report(rows: list[dict], command: str, when: str) -> str:
    lines = [f"# A decode step after a long context, {when}", "", f"Command: `{command}`", "",
             "The default pair (shipped weights), ms per greedy decode step, median over repeats; library: "
             "transformers' DynamicCache (torch.cat each step); growing: specdec's GrowingLayer (in place).", "",
             "| model | context | library ms | growing ms | growing / library | same tokens |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['context']} | {r['library_ms']:.1f} | {r['growing_ms']:.1f} | "
              f"{r['growing_ms'] / r['library_ms']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.machine import command_line, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")], default=[64, 1024, 3072])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/cache-growth")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = measure(args)
    command = command_line("bench.cache_growth", argv)
    markdown = report(rows, command, when)
    save_results(args.out, {"command": command, "when": when, "rows": rows}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
