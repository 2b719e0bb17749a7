"""Prompt-lookup micro-benchmark: microseconds per round of the lookup drafter at a given context length.

    python -m bench.lookup [--context 4096] [--rounds 2000] [--vocab 151936] [--tokenizer PATH]

The sequence is the grounded prompt set tokenized with the default target's tokenizer (or, without one, token
ids drawn from a Zipf law with repeated spans), cut to `--context` tokens. Each round proposes after the
sequence, then commits what a verification might (a random prefix of the proposal and one more token), as the
engine does, so the index update, the matching and the one-hot distributions are all timed; the first indexing
of the whole context (once per request, with the prompt's prefill) is reported apart, the best of 5. The text
committed is the corpus itself (a target that continues it): a proposal is accepted up to its first token that
differs from the corpus, and the corpus's next token follows, so the matches are those of real text.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from specdec.drafters import LookupDrafter, LookupSettings

GROUNDED = Path(__file__).resolve().parent / "prompts_grounded.jsonl"


def corpus(tokenizer_path: str | None, length: int, seed: int = 0) -> list[int]:
    """At least `length` token ids: the grounded prompts tokenized, repeated as needed, or a synthetic stream."""
    if tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        text = "\n\n".join(json.loads(line)["prompt"] for line in GROUNDED.read_text().splitlines() if line.strip())
        ids = tokenizer(text)["input_ids"]
    else:
        rng = random.Random(seed)
        ids = []
        while len(ids) < length:
            if ids and rng.random() < 0.3:  # a span copied from earlier, as code edits and quotes do
                start = rng.randrange(len(ids))
                ids += ids[start:start + rng.randint(4, 40)]
            else:
                ids.append(min(int(rng.paretovariate(1.1)), 151_000))
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def run(ids: list[int], settings: LookupSettings, vocab: int, rounds: int, start_at: int) -> dict:
    """Rounds of the lookup drafter from ids[:start_at], committing the corpus's own continuation."""
    first_index_ms = []
    for _ in range(5):
        drafter = LookupDrafter(vocab, settings)
        started = time.perf_counter()
        drafter.start(ids[:start_at])
        first_index_ms.append(1e3 * (time.perf_counter() - started))
    times, proposed, accepted_total = [], [], 0
    committed = ids[:start_at]
    for _ in range(rounds):
        if len(committed) >= len(ids):
            break
        started = time.perf_counter()
        proposal = drafter.propose(committed, gamma=4, limit=settings.max_tokens)
        times.append(1e6 * (time.perf_counter() - started))
        proposed.append(len(proposal))
        truth = ids[len(committed):len(committed) + len(proposal) + 1]
        accepted = next((i for i, (a, b) in enumerate(zip(proposal.tokens, truth)) if a != b), len(proposal))
        accepted = min(accepted, len(truth) - 1)
        accepted_total += accepted
        committed = ids[:len(committed) + accepted + 1]
    times.sort()
    return {"context": len(committed), "first_index_ms": min(first_index_ms), "median_us": statistics.median(times),
            "p99_us": times[int(0.99 * (len(times) - 1))], "rounds": len(times),
            "mean_proposed": sum(proposed) / len(proposed), "accepted_per_round": accepted_total / len(times)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: synthetic token ids)")
    parser.add_argument("--max-ngrams", default="1,2,3,4,6", help="max_ngram values to time")
    parser.add_argument("--max-tokens", default="10,16", help="max_tokens values to time")
    args = parser.parse_args(argv)
    ids = corpus(args.tokenizer, 2 * args.context)
    print(f"prompt lookup from {args.context} committed tokens, up to {args.rounds} rounds, vocabulary {args.vocab}, "
          f"{'the grounded prompts tokenized' if args.tokenizer else 'synthetic ids'}")
    print("| max_ngram | max_tokens | first indexing (ms) | round median (us) | round p99 (us) | rounds "
          "| mean proposed | accepted per round |")
    print("|---|---|---|---|---|---|---|---|")
    for max_ngram in map(int, args.max_ngrams.split(",")):
        for max_tokens in map(int, args.max_tokens.split(",")):
            settings = LookupSettings(max_ngram=max_ngram, max_tokens=max_tokens, min_match=1, hybrid_min_match=1)
            row = run(ids, settings, args.vocab, args.rounds, args.context)
            print(f"| {max_ngram} | {max_tokens} | {row['first_index_ms']:.2f} | {row['median_us']:.0f} "
                  f"| {row['p99_us']:.0f} | {row['rounds']} | {row['mean_proposed']:.2f} "
                  f"| {row['accepted_per_round']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
