"""Where prompt lookup would propose, is it right more often than the draft model? From stored greedy texts.

    python -m bench.agreement [--texts bench/results/drafting/texts.json] [--min-match 3]

`bench.drafting` stores, per prompt, the target's greedy text and the draft model's argmax after each position. At
every generated position where the lookup finds a match of at least `--min-match` tokens in the text before it,
this counts whether the lookup's next token is the target's, and whether the draft's argmax is. It also splits the
lookup's hits by whether its previous prediction in that text was right. No model runs; the figures say how much
of the hybrid's gain can come from more accepted tokens and how much only from cheaper proposals.
"""

import argparse
import json
from pathlib import Path

from specdec.drafters import NgramIndex
from specdec.params import LookupSettings

TEXTS = Path(__file__).resolve().parent / "results" / "drafting" / "texts.json"
COUNTS = ("positions", "fires", "lookup_right", "draft_right", "only_lookup_right",
          "after_hit", "right_after_hit", "after_miss", "right_after_miss")


def lookup_predictions(text: list[int], prompt_len: int, min_match: int, max_ngram: int) -> dict[int, int]:
    """position -> the lookup's token there (after text[:position]), at each generated position where it has a
    match of at least min_match tokens."""
    index, predictions = NgramIndex(max_ngram), {}
    for i in range(prompt_len, len(text)):
        committed = text[:i]
        index.update(committed)
        found = index.match(committed, min_match)
        if found is not None:
            predictions[i] = text[found[0] + 1]
    return predictions


def agreement(text: list[int], argmax: list[int], prompt_len: int, min_match: int, max_ngram: int) -> dict:
    """The counts of COUNTS for one text (argmax[i]: the draft's next token after text[:i + 1])."""
    counts = dict.fromkeys(COUNTS, 0)
    counts["positions"] = len(text) - prompt_len
    previous = None
    for i, token in lookup_predictions(text, prompt_len, min_match, max_ngram).items():
        lookup_right = token == text[i]
        draft_right = argmax[i - 1] == text[i]
        counts["fires"] += 1
        counts["lookup_right"] += lookup_right
        counts["draft_right"] += draft_right
        counts["only_lookup_right"] += lookup_right and not draft_right
        if previous is not None:
            after = "hit" if previous else "miss"
            counts[f"after_{after}"] += 1
            counts[f"right_after_{after}"] += lookup_right
        previous = lookup_right
    return counts


def table(texts: dict, min_match: int, max_ngram: int) -> str:
    rows = ["| set | generated positions | lookup fires | lookup right | draft right there | only lookup right "
            "| lookup right after a hit | after a miss |", "|---|---|---|---|---|---|---|---|"]
    for name, entries in texts.items():
        total = dict.fromkeys(COUNTS, 0)
        for entry in entries:
            for key, value in agreement(entry["text"], entry["argmax"], entry["prompt_len"], min_match,
                                        max_ngram).items():
                total[key] += value
        fires = max(total["fires"], 1)
        rows.append(f"| {name} | {total['positions']} | {total['fires']} | {total['lookup_right'] / fires:.1%} "
                    f"| {total['draft_right'] / fires:.1%} | {total['only_lookup_right'] / fires:.1%} "
                    f"| {total['right_after_hit'] / max(total['after_hit'], 1):.1%} ({total['after_hit']}) "
                    f"| {total['right_after_miss'] / max(total['after_miss'], 1):.1%} ({total['after_miss']}) |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=Path, default=TEXTS, help="a texts.json written by bench.drafting")
    parser.add_argument("--min-match", type=int, default=LookupSettings().hybrid_min_match)
    parser.add_argument("--max-ngram", type=int, default=LookupSettings().max_ngram)
    args = parser.parse_args(argv)
    texts = json.loads(args.texts.read_text())["texts"]
    print(f"Lookup (matches of {args.min_match} to {args.max_ngram} tokens) against the draft model's argmax, "
          f"at the generated positions where the lookup would propose ({args.texts}):\n")
    print(table(texts, args.min_match, args.max_ngram))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
