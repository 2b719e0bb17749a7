"""The default pair's draft step as one native call per layer (specdec/cpu/decoder.py) against the fused forward
it replaces, paired on the same prompts: the draft's step in ms, then Google's decode tokens/s with each beside
the shipped target alone.

    python -m bench.native_step --out bench/results/native-step

One pair is loaded; its draft's fused forward is switched between the two (`FusedForward.native`), so both runs of
a prompt use the same weights. Each prompt runs target-only, then Google with the fused and with the native draft
step, one after the other (the machine's speed drifts, so only ratios within a prompt are compared); greedy, EOS
ignored, the draft-confidence stop at the service's default for this pair (0.6), decode tokens/s past the first
round. Writes results.json and results.md.
"""

import argparse
import json
import statistics
import sys
import time

STEPS = ("fused", "native")


def step_ms(forward, config, widths=(1, 5), repeats=20) -> dict:
    """Median ms of the draft's forward of n tokens after 300 cached ones, with each step."""
    import torch

    from specdec.kv_cache import growing_cache

    native, out = forward.native, {}
    ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
    for n in widths:
        for step in STEPS:
            forward.native = native if step == "native" else None
            cache = growing_cache(config)
            forward(ids, cache, 1)
            times = []
            for i in range(repeats + 3):
                start = time.perf_counter()
                forward(ids[:, i:i + n], cache, n)
                times.append(time.perf_counter() - start)
                cache.crop(-n)
            out[f"{step}-{n}"] = statistics.median(times[3:]) * 1000
    forward.native = native
    return out


def measure(args) -> tuple[dict, list[dict]]:
    import torch

    from bench.prompts import DEFAULT_PROMPTS, encode, load_prompts
    from specdec.engine import SpeculativeDecoder
    from specdec.fused_forward import fused_forward
    from specdec.models.pair import load_pair

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    items = {item["id"]: item for item in load_prompts(DEFAULT_PROMPTS)}
    draft, target, tokenizer = load_pair(device="cpu", weights="shipped")
    forward = fused_forward(draft)
    if forward is None or forward.native is None:
        raise SystemExit("the draft takes no native step here (no grouped kernel, or not a Llama/Qwen2 draft)")
    native = forward.native
    steps = step_ms(forward, draft.config)
    print(json.dumps(steps), file=sys.stderr)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    prompts = args.prompts or list(items)
    settings = {"gamma": args.gamma, "temperature": 0, "eos_token_id": [],
                "draft_confidence_threshold": args.threshold}
    for method in ("target", "google"):  # warm-up: the first calls build what later ones reuse
        decoder.generate(encode(tokenizer, items[prompts[0]]), max_new_tokens=8, method=method, **settings)
    rows = []
    for repeat in range(args.repeats):
        for prompt in prompts:
            ids = encode(tokenizer, items[prompt])
            row = {"prompt": prompt, "repeat": repeat}
            for name in ("target", *(f"google-{step}" for step in STEPS)):
                forward.native = None if name == "google-fused" else native
                result = decoder.generate(ids, max_new_tokens=args.tokens, method=name.split("-")[0], **settings)
                row[name] = result.stats.decode_tokens_per_second
                if name != "target":
                    row[f"{name}-acceptance"] = result.stats.acceptance_rate
                    row[f"{name}-ids"] = result.token_ids
            forward.native = native
            row["same-output"] = row.pop("google-fused-ids") == row.pop("google-native-ids")
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return steps, rows


def report(steps: dict, rows: list[dict], command: str, when: str) -> tuple[dict, str]:
    from bench.fused_forward import ratios
    from bench.machine import machine_info

    summary = {
        "google-native / google-fused": ratios(rows, "google-native", "google-fused"),
        "google-fused / target": ratios(rows, "google-fused", "target"),
        "google-native / target": ratios(rows, "google-native", "target"),
    }
    machine = machine_info()
    lines = [f"# The draft's step, native against fused, paired, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}", "",
             "Draft forward after 300 cached tokens, median ms: " + ", ".join(
                 f"{n} token{'s' if n != '1' else ''}: fused {steps[f'fused-{n}']:.1f}, native "
                 f"{steps[f'native-{n}']:.1f}" for n in sorted({k.split('-')[1] for k in steps})), "",
             "Default pair, shipped weights, greedy, EOS ignored, draft-confidence stop 0.6, decode tokens/s past the "
             "first round. Ratios: median over prompts and repeats of the ratio within each (range).", "",
             "| ratio | median | range |", "|---|---|---|"]
    lines += [f"| {name} | {r['median']:.2f}x | {r['low']:.2f}-{r['high']:.2f}x |" for name, r in summary.items()]
    same = sum(r["same-output"] for r in rows)
    lines += ["", f"Greedy output the same with both steps on {same} of {len(rows)} runs (it must be: both are "
                  "the target's greedy output).", "",
              "| prompt | repeat | target | google fused (acceptance) | google native (acceptance) |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['repeat']} | {r['target']:.1f} | {r['google-fused']:.1f} "
              f"({r['google-fused-acceptance']:.2f}) | {r['google-native']:.1f} ({r['google-native-acceptance']:.2f}) |"
              for r in rows]
    return {"steps_ms": steps, "summary": summary, "same_output": same}, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from bench.machine import command_line, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=lambda v: v.split(","), default=None,
                        help="ids of bench/prompts.jsonl, comma-separated (default: all)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threshold", type=float, default=0.6, help="the draft-confidence stop (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/native-step")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    steps, rows = measure(args)
    command = command_line("bench.native_step", argv)
    summary, markdown = report(steps, rows, command, when)
    save_results(args.out, {"command": command, "when": when, **summary, "runs": rows}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
