"""Structured outputs on the default pair: constrained target-only decoding against masked model drafting,
model drafting with the grammar's forced proposals, the hybrid with them, and unconstrained model drafting for
reference, on bench/prompts_structured.jsonl (extraction into a schema, generated records, tool calls with
tool_choice required, enums).

    python -m bench.structured [--limit N] [--repeats R] [--temperature T --top_p P] [--out DIR]

Per method: tokens/s of whole requests, past the first round, and past both models' prefill of the prompt
(`window`; paired with constrained target-only on the same prompts, with bootstrap intervals over prompts),
tokens per target forward, the share of tokens the grammar
forced, the grammar's time per token and its share of the time, and the share of finished outputs that parse
and validate against their schema (jsonschema). The runs are interleaved per prompt, so drifts of the machine
fall on every method alike.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from bench.prompts import STRUCTURED_PROMPTS, load_prompts
from bench.summary import paired_speedup
from specdec import SamplingParams, SpeculativeDecoder, load_pair
from specdec.engine import eos_token_ids
from specdec.grammar import Constraint, GrammarCompiler
from specdec.serve.structured import Tool, parse_tool_calls, tool_constraint
from specdec.text import encode_messages

# label: (method, drafter, constrained, forced proposals, draft confidence threshold)
METHODS = {
    "target (constrained)": ("target", "model", True, False, 0.0),
    "model, masked": ("google", "model", True, False, 0.0),
    "model + grammar": ("google", "model", True, True, 0.0),
    "model + grammar, stop 0.6": ("google", "model", True, True, 0.6),
    "hybrid + grammar": ("google", "hybrid", True, True, 0.0),
    "lookup + grammar": ("google", "lookup", True, True, 0.0),  # no draft model: no draft prefill, no draft steps
    "model (unconstrained)": ("google", "model", False, False, 0.0),
}
WINDOWS = ("whole", "past the first round", "past both prefills")
BASELINE = "target (constrained)"


def request(tokenizer, item):
    """(prompt ids, constraint, the schema an answer validates against, tools or None)."""
    tools = [Tool.model_validate(tool) for tool in item.get("tools", [])]
    messages = [{"role": "user", "content": item["prompt"]}]
    if tools:
        prompt = encode_messages(tokenizer, messages, tools=[tool.model_dump(exclude_none=True) for tool in tools])
        return prompt, tool_constraint(tools, "required", False, special=True), None, tools
    return encode_messages(tokenizer, messages), Constraint.json_schema(item["schema"]), item["schema"], None


def valid(text: str, schema, tools) -> bool:
    try:
        if tools:
            _, calls = parse_tool_calls(text)
            schemas = {tool.function.name: tool.function.parameters for tool in tools}
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            return len(calls) == 1
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
        return False


def variants(args) -> list[tuple[str, tuple, bool]]:
    """(label, METHODS' entry, AMX on) for each run of a prompt, in order."""
    chosen = [BASELINE, *[label for label in (args.methods or "").split(";") if label and label != BASELINE]]
    unknown = [label for label in chosen if label not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods: {', '.join(unknown)} (known: {'; '.join(METHODS)})")
    labels = chosen if args.methods else list(METHODS)
    out = [(label, METHODS[label], True) for label in labels]
    if args.without_amx:
        out += [(f"{label}, no AMX", METHODS[label], False) for label in labels if label != BASELINE]
    return out


def set_amx(on: bool) -> None:
    """The grouped kernel's AMX path on or off (nothing where the kernel is not built)."""
    from specdec.cpu.grouped import grouped_kernel

    if grouped_kernel():
        torch.ops.specdec_grouped.amx(on)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated prompt ids (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="as load_pair's (bfloat16 halves the pair's memory)")
    parser.add_argument("--methods", default=None, help="labels of METHODS separated by ; (default: all; the "
                        "constrained target-only baseline always runs)")
    parser.add_argument("--without-amx", action="store_true",
                        help="also run each speculative method with the grouped kernel's AMX path off, on the same "
                             "prompts (labels end in ', no AMX'; where the CPU has no AMX both runs are VNNI's)")
    parser.add_argument("--out", default=None, help="folder for runs.json (default: print only)")
    args = parser.parse_args(argv)

    draft, target, tokenizer = load_pair(dtype=args.dtype)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    eos = eos_token_ids(target, tokenizer)
    compiler = GrammarCompiler(tokenizer, decoder.vocab_size)
    runs = []
    items = load_prompts(STRUCTURED_PROMPTS, args.limit)
    if args.only:
        items = [item for item in items if item["id"] in args.only.split(",")]
    for item in items:
        prompt, constraint, schema, tools = request(tokenizer, item)
        start = time.perf_counter()
        grammar = compiler.compile(constraint)
        compile_seconds = time.perf_counter() - start
        for repeat in range(args.repeats):
            for label, (method, drafter, constrained, forced, threshold), amx in variants(args):
                set_amx(amx)
                params = SamplingParams(max_new_tokens=args.max_new_tokens, method=method, drafter=drafter,
                                        gamma=args.gamma, temperature=args.temperature, top_p=args.top_p,
                                        top_k=0, seed=repeat, grammar_drafter=forced,
                                        draft_confidence_threshold=threshold)
                result = decoder.generate(prompt, params=params, grammar=grammar if constrained else None,
                                          eos_token_id=eos)
                text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
                stats = result.stats
                # the stats' own "method" (google, target) under its name, the label as "method"
                runs.append({**stats.as_dict(), "engine_method": stats.method, "prompt": item["id"],
                             "category": item["category"], "repeat": repeat, "method": label,
                             "finish_reason": result.finish_reason,
                             "valid": valid(text, schema, tools) if result.finish_reason == "stop" else None,
                             "compile_seconds": compile_seconds,
                             "draft_prefill_after_first_chunk": decoder.first_token_alone(len(prompt))})
                print(f"{item['id']:<10} {label:<22} {stats.new_tokens:>4} tokens {stats.tokens_per_second:6.2f} "
                      f"tok/s {stats.tokens_per_target_forward:5.2f} tok/fwd forced {stats.forced_tokens} "
                      f"valid {runs[-1]['valid']}", flush=True)
    if args.out:  # before the report, so that a report's failure loses no runs
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "runs.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    report(runs)


def window(run: dict, which: str) -> tuple[int, float]:
    """(tokens, seconds) of one run in a window of its time: "whole"; "past the first round" (the target's prefill
    and the first token drawn from it); "past both prefills", which also leaves out the draft model's prefill of the
    prompt where it came after the first round (a prompt of `first_token_alone_from` tokens or more: its first
    token is drawn from the target's prefill alone, and the draft prefills in the second round)."""
    if which == "whole":
        return run["new_tokens"], run["total_seconds"]
    tokens, seconds = run["new_tokens"] - run["first_chunk_tokens"], run["total_seconds"] - run["first_chunk_seconds"]
    if which == "past both prefills" and run.get("draft_prefill_after_first_chunk"):
        seconds -= run["draft_prefill_seconds"]
    return tokens, seconds


def _ratio(runs, baseline, which: str):
    """Paired tokens/s ratio against the baseline, per prompt, in `window` `which`."""
    by_prompt = {}
    for run in runs:
        a, b = window(run, which), window(baseline[(run["prompt"], run["repeat"])], which)
        if a[0] > 0 and b[0] > 0 and a[1] > 0 and b[1] > 0:
            by_prompt.setdefault(run["prompt"], []).append((*a, *b))
    return paired_speedup(list(by_prompt.values())) if by_prompt else (None, [None, None])


def report(runs):
    baseline = {(r["prompt"], r["repeat"]): r for r in runs if r["method"] == BASELINE}
    print(f"\n{'method':<26} {'tok/s':>6} {'x target (90% CI)':>19} {'past 1st round':>19} {'past prefills':>19} "
          f"{'tok/fwd':>7} "
          f"{'forced':>6} {'grammar ms/tok':>14} {'grammar share':>13} {'valid':>9}")
    for label in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == label]
        tokens, seconds = sum(r["new_tokens"] for r in mine), sum(r["total_seconds"] for r in mine)
        forwards = sum(r["target_forwards"] for r in mine)
        ratios = [_x(*_ratio(mine, baseline, which)) for which in WINDOWS]
        forced = sum(r["forced_tokens"] or 0 for r in mine) / tokens
        grammar = sum(r["grammar_seconds"] or 0 for r in mine)
        finished = [r for r in mine if r["finish_reason"] == "stop"]
        validity = f"{sum(r['valid'] for r in finished)}/{len(finished)}"
        print(f"{label:<26} {tokens / seconds:6.2f} {ratios[0]:>19} {ratios[1]:>19} {ratios[2]:>19} "
              f"{tokens / forwards:7.2f} {forced:6.1%} {grammar / tokens * 1000:14.3f} {grammar / seconds:13.2%} "
              f"{validity:>9}")
    compiles = sorted({r["prompt"]: r["compile_seconds"] for r in runs}.values())
    print(f"\ncompile ms per grammar: median {statistics.median(compiles) * 1000:.2f}, max {compiles[-1] * 1000:.2f}")


def _x(ratio, interval) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"


if __name__ == "__main__":
    main()
