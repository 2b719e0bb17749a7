"""Everything a lent GPU should measure, in one short run (no downloads).

1. A ~7B Llama-shape target and a ~0.5B draft with random weights, in bfloat16: for gamma 1-8, the cost of one
   target forward over gamma+1 new tokens relative to one token, the draft/target cost ratio c, and the engine's
   per-round time outside model forwards; then target-only and Google tokens/s, eager against compiled
   (specdec/compiled.py). Random weights make acceptance meaningless: no end-to-end speedup is claimed from them.
2. The default pair from the cache (`make models`), or with --tiny the tests' tiny pair: eager against compiled,
   in-process against the running service, and Hugging Face's generate and assisted generation (bench.overhead).

    python -m bench.gpu                      # on a CUDA machine: writes bench/results/gpu.json and prints tables
    python -m bench.gpu --tiny --device cpu  # a short smoke run of the same code on tiny shapes, on CPU
"""

import argparse
import json
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import overhead
from bench.forwards import forward_ms
from bench.machine import machine_info
from specdec import SpeculativeDecoder
from specdec.compiled import compile_model

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv_heads)
    "target-7b": (4096, 11008, 32, 32, 32),
    "draft-0.5b": (1024, 2816, 24, 16, 16),
    "tiny-target": (64, 128, 2, 4, 4),
    "tiny-draft": (32, 64, 1, 4, 4),
}


def build(shape: str, vocab: int, device: str, dtype: torch.dtype):
    hidden, inter, layers, heads, kv = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per engine run")
    parser.add_argument("--pair-tokens", type=int, default=128, help="new tokens per request in part 2")
    parser.add_argument("--no-pair", action="store_true", help="part 1 only")
    parser.add_argument("--out", default="bench/results/gpu.json")
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    vocab = 512 if args.tiny else 32000
    target = build("tiny-target" if args.tiny else "target-7b", vocab, args.device, dtype)
    draft = build("tiny-draft" if args.tiny else "draft-0.5b", vocab, args.device, dtype)

    one_target = forward_ms(target, args.context, 1, args.device, args.repeats)
    one_draft = forward_ms(draft, args.context, 1, args.device, args.repeats)
    decoder = SpeculativeDecoder(draft, target)
    prompt = torch.randint(0, vocab, (args.context,)).tolist()
    rows = []
    for gamma in range(1, 9):
        verify = forward_ms(target, args.context, gamma + 1, args.device, args.repeats)
        decoder.generate(prompt, max_new_tokens=8, gamma=gamma, temperature=0)  # warm-up
        stats = decoder.generate(prompt, max_new_tokens=args.tokens, gamma=gamma, temperature=0).stats
        rows.append({"gamma": gamma, "target_forward_ms": verify, "relative_to_one_token": verify / one_target,
                     "outside_forward_share": stats["other_seconds"] / stats["total_seconds"],
                     "engine_ms_per_round_outside_forwards": 1e3 * stats["other_seconds"] / stats["rounds"]})
    paths = {"eager": random_pair_rates(decoder, prompt, args.tokens)}
    compiled = [compile_model(model, torch.device(args.device)) for model in (draft, target)]
    paths["compiled"] = random_pair_rates(SpeculativeDecoder(draft, target), prompt, args.tokens) \
        if all(compiled) else None
    report = {"machine": machine_info(), "device": args.device, "dtype": str(dtype), "context": args.context,
              "target_one_token_ms": one_target, "draft_one_token_ms": one_draft, "cost_ratio_c": one_draft / one_target,
              "shapes": "tiny" if args.tiny else "7B target / 0.5B draft (random weights)", "by_gamma": rows,
              "random_pair_tokens_per_second": paths}
    del decoder, draft, target
    if not args.no_pair:
        report["pair"] = pair_report(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"{report['shapes']} on {report['machine'].get('cuda') or report['machine']['cpu']}, {dtype}, "
          f"context {args.context}: target 1 token {one_target:.2f} ms, draft {one_draft:.2f} ms, "
          f"c = {report['cost_ratio_c']:.3f}")
    print("| gamma | target fwd over gamma+1 (ms) | vs 1 token | outside forwards (share of round) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['gamma']} | {row['target_forward_ms']:.2f} | {row['relative_to_one_token']:.2f}x "
              f"| {100 * row['outside_forward_share']:.1f}% |")
    print(f"random pair, tokens/s: {json.dumps(paths)}")
    if "pair" in report:
        print(overhead.markdown(report["pair"]))
    return 0


def random_pair_rates(decoder: SpeculativeDecoder, prompt: list[int], tokens: int) -> dict:
    """Target-only and Google (gamma 4, greedy) tokens/s on the random pair, after a warm-up."""
    rates = {}
    for method in ("target", "google"):
        params = dict(max_new_tokens=tokens, method=method, gamma=4, temperature=0, eos_token_id=[])
        decoder.generate(prompt, **params)
        rates[method] = decoder.generate(prompt, **params).stats.tokens_per_second
    return rates


def pair_report(args) -> dict:
    """bench.overhead on the default pair (the tiny pair with --tiny): eager and compiled, in-process and through
    the service, beside Hugging Face's methods."""
    options = argparse.Namespace(device=args.device, tokens=args.pair_tokens if not args.tiny else args.tokens,
                                 repeats=max(1, min(args.repeats, 3)), no_service=False, threads=None,
                                 draft_quantization="none" if args.tiny else "int8")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if args.tiny:
            draft_dir, target_dir = overhead.save_pair(folder)
        else:
            from specdec.models.default_pair import default_pair_paths

            draft_dir, target_dir = default_pair_paths(prepare=False)
        results = overhead.measure(options, draft_dir, target_dir, folder)
    return {"command": "python -m bench.gpu (part 2)", "machine": machine_info(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "pair": "tiny" if args.tiny else "default", "tokens": options.tokens, "results": results}


if __name__ == "__main__":
    raise SystemExit(main())
