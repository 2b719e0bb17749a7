"""Decoder layers in native code (specdec/cpu/decoder.py) against the fused forward they replace, on the default
pair: ms per forward of each model, then target-only and Google with each, paired on the same prompts.

    python -m bench.native_step --out bench/results/native-step

One pair is loaded; both models' fused forwards are switched between the two (`FusedForward.native`), so every
run uses the same weights. Each prompt runs target-only and Google with the fused layers, then with the native
ones (the machine's speed drifts, so only ratios within a prompt are compared; the order alternates between
prompts); greedy, EOS ignored, the draft-confidence stop at the service's default for this pair (0.6), decode
tokens/s past the first round. The tokens must be the same in all four runs of a prompt (the native layers are
bitwise the fused ones). Writes results.json and results.md.
"""

import argparse
import json
import sys
import time

STEPS = ("fused", "native")


def step_ms(forwards: dict, configs: dict, widths=(1, 5), repeats=20) -> dict:
    """{"<role>-<fused|native>-<n>": median ms} of each model's forward of n tokens after 300 cached ones, with each
    step (`bench.forwards.forward_ms_by_path`, interleaved)."""
    from bench.forwards import forward_ms_by_path

    natives = {role: forward.native for role, forward in forwards.items()}

    def use(step: str):
        def switch(role: str) -> None:
            forwards[role].native = natives[role] if step == "native" else None
        return switch

    try:
        return forward_ms_by_path(forwards, configs, {step: use(step) for step in STEPS}, widths, repeats)
    finally:
        for role, forward in forwards.items():
            forward.native = natives[role]


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
    forwards = {"draft": fused_forward(draft), "target": fused_forward(target)}
    if any(forward is None or forward.native is None for forward in forwards.values()):
        raise SystemExit("the pair takes no native layers here (no decoder kernel, or not grouped Llama/Qwen2)")
    natives = {role: forward.native for role, forward in forwards.items()}

    def use(step: str) -> None:
        for role, forward in forwards.items():
            forward.native = natives[role] if step == "native" else None

    steps = step_ms(forwards, {"draft": draft.config, "target": target.config})
    print(json.dumps(steps), file=sys.stderr)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    prompts = args.prompts or list(items)
    settings = {"gamma": args.gamma, "temperature": 0, "eos_token_id": [],
                "draft_confidence_threshold": args.threshold}
    for step in STEPS:  # warm-up: the first calls build what later ones reuse
        use(step)
        for method in ("target", "google"):
            decoder.generate(encode(tokenizer, items[prompts[0]]), max_new_tokens=8, method=method, **settings)
    rows = []
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            ids = encode(tokenizer, items[prompt])
            row, tokens = {"prompt": prompt, "repeat": repeat}, []
            for step in STEPS if (index + repeat) % 2 == 0 else STEPS[::-1]:
                use(step)
                for method in ("target", "google"):
                    result = decoder.generate(ids, max_new_tokens=args.tokens, method=method, **settings)
                    row[f"{method}-{step}"] = result.stats.decode_tokens_per_second
                    tokens.append(result.token_ids)
                    if method == "google":
                        row[f"google-{step}-acceptance"] = result.stats.acceptance_rate
            use("native")
            row["same-output"] = all(t == tokens[0] for t in tokens)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return steps, rows


def report(steps: dict, rows: list[dict], command: str, when: str) -> tuple[dict, str]:
    from bench.machine import machine_info
    from bench.summary import ratios

    summary = {
        "target-native / target-fused": ratios(rows, "target-native", "target-fused"),
        "google-native / google-fused": ratios(rows, "google-native", "google-fused"),
        "google-fused / target-fused": ratios(rows, "google-fused", "target-fused"),
        "google-native / target-native": ratios(rows, "google-native", "target-native"),
    }
    machine = machine_info()
    lines = [f"# Native decoder layers against the fused forward, paired, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}", "",
             "Forward after 300 cached tokens, median ms: " + "; ".join(
                 f"{role} {n} token{'s' if n != '1' else ''}: fused {steps[f'{role}-fused-{n}']:.1f}, native "
                 f"{steps[f'{role}-native-{n}']:.1f}" for role in ("draft", "target")
                 for n in sorted({k.split('-')[2] for k in steps})), "",
             "Default pair, shipped weights, greedy, EOS ignored, draft-confidence stop 0.6, decode tokens/s past the "
             "first round. Ratios: median over prompts and repeats of the ratio within each (range).", "",
             "| ratio | median | range |", "|---|---|---|"]
    lines += [f"| {name} | {r['median']:.2f}x | {r['low']:.2f}-{r['high']:.2f}x |" for name, r in summary.items()]
    same = sum(r["same-output"] for r in rows)
    lines += ["", f"Greedy output the same in all four runs on {same} of {len(rows)} prompts (it must be: the native "
                  "layers are bitwise the fused ones, and Google's greedy output is target-only's).", "",
              "| prompt | repeat | target fused | target native | google fused (acceptance) | google native |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['repeat']} | {r['target-fused']:.1f} | {r['target-native']:.1f} | "
              f"{r['google-fused']:.1f} ({r['google-fused-acceptance']:.2f}) | {r['google-native']:.1f} |"
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
