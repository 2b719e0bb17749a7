"""Time to first token with the first token drawn from the target's prefill alone (the default for prompts of 32
tokens or more) against the speculative first round (`first_token_alone_from` past any prompt), paired, in-process
on the default pair: a 300-token prompt with the prompt cache off, and a 900-token cached prefix plus 270 new
tokens with it on. Greedy, gamma 4, 8 new tokens; the prompt is the text of specdec/engine.py.

    python -m bench.first_token --repeats 2
"""

import argparse
import statistics
from pathlib import Path

import torch

from specdec import SamplingParams, SpeculativeDecoder
from specdec.models.pair import load_pair

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    draft, target, tokenizer = load_pair(compile=False)
    ids = tokenizer.encode((ROOT / "specdec" / "engine.py").read_text(), add_special_tokens=False)
    prefix, rest = ids[:900], ids[900:1170]
    params = SamplingParams(max_new_tokens=8, temperature=0, gamma=4)
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, threshold in (("first token alone", 32), ("speculative first round", 10**9)):
            decoder = SpeculativeDecoder(draft, target, tokenizer, prompt_cache_bytes=2_000_000_000,
                                         first_token_alone_from=threshold)
            cold = decoder.generate(prefix[:300], params=params.replace(cache_prompt=False)).stats
            decoder.generate(prefix, params=params)  # the cache now holds the 900-token prefix
            warm = decoder.generate(prefix + rest, params=params).stats
            rows.setdefault(f"{name}, cache off (300 tokens)", []).append(cold.first_chunk_seconds)
            rows.setdefault(f"{name}, cache on ({warm.cached_tokens} cached, {len(rest)} new)", []).append(
                warm.first_chunk_seconds)
    print("| first round | seconds to the first token (median) | runs |\n|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {statistics.median(seconds):.2f} | {', '.join(f'{s:.2f}' for s in seconds)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
