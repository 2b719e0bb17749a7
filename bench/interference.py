"""What a draft forward costs right after a target forward, or after a pause, against back to back.

On a CPU whose cache holds the draft's weights but not the target's, speculative decoding pays for the draft's
weights coming from memory again after every verification: the Leviathan model's c, measured on the draft
decoding alone, understates what the loop pays. This measures it on the loaded pair (with the CPU kernels
`load_pair` applies), with `cached` prompt tokens in both caches, as medians of `repeats` rounds:

    python -m bench.interference                                   # the default pair
    python -m bench.interference --draft DIR --target DIR --cached 8 --repeats 2   # any pair
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.kv_cache import CachedModel
from specdec.models.pair import load_pair


def forward_ms(model: CachedModel, tokens: list[int], cached: int) -> float:
    """ms of one forward over `tokens`, then the cache back to `cached` tokens."""
    start = time.perf_counter()
    model.forward(tokens, keep=len(tokens))
    seconds = time.perf_counter() - start
    model.rollback(cached)
    return 1e3 * seconds


def measure(draft_model, target_model, cached: int = 100, repeats: int = 6, gamma: int = 4,
            pause: float = 0.45) -> dict:
    """Median draft ms back to back, after a target verification forward and after a pause; target ms by width."""
    vocab = min(draft_model.config.vocab_size, target_model.config.vocab_size)
    prompt = torch.randint(0, vocab, (cached + gamma + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    draft, target = CachedModel(draft_model), CachedModel(target_model)
    draft.forward(prompt[:cached])
    target.forward(prompt[:cached])
    one, new = prompt[cached:cached + 1], prompt[cached:]
    rows = {"draft_back_to_back": [], "draft_after_target": [], "draft_after_pause": [],
            "target_1_token": [], f"target_{gamma + 1}_tokens": []}
    for _ in range(repeats):
        for _ in range(gamma):
            rows["draft_back_to_back"].append(forward_ms(draft, one, cached))
        rows[f"target_{gamma + 1}_tokens"].append(forward_ms(target, new, cached))
        rows["draft_after_target"].append(forward_ms(draft, one, cached))
        rows["target_1_token"].append(forward_ms(target, one, cached))
        time.sleep(pause)
        rows["draft_after_pause"].append(forward_ms(draft, one, cached))
    return {"cached": cached, "repeats": repeats, "pause_seconds": pause,
            "ms": {name: statistics.median(values) for name, values in rows.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None)
    parser.add_argument("--target", default=None)
    parser.add_argument("--cached", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.45)
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    draft, target, _ = load_pair(args.draft, args.target)
    report = measure(draft, target, args.cached, args.repeats, args.gamma, args.pause)
    for name, ms in report["ms"].items():
        print(f"{name:>22}: {ms:8.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
