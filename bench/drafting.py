"""Greedy drafting, simulated from one greedy run per prompt: how prompt lookup's knobs and the hybrid's threshold
were chosen (specdec.drafters.LookupSettings), by measurement on the default pair.

    python -m bench.drafting [--limit N] [--max-new-tokens 64] [--out bench/results/drafting]

Under greedy decoding a proposal is accepted up to its first token that differs from the target's greedy text,
and until then the draft model proposes its argmax on the target's own text. So one greedy run per prompt (made
with speculative decoding, which gives the target's greedy tokens exactly) and one draft forward over its text
give the rounds of every configuration: the tokens each commits, its verification width, the draft forwards it
takes and their widths. The real drafters run on that text (the draft model's draws replaced by those argmaxes).
With the target's and the draft's forward costs measured per width on this machine, each configuration's time
follows; `make bench` then measures the chosen ones for real. Prefill and sampling overheads are left out.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from specdec.drafters import HybridDrafter, LookupDrafter, LookupSettings
from specdec.engine import FIRST_TOKEN_ALONE_FROM, SpeculativeDecoder
from specdec.kv_cache import CachedModel, input_device

from .agreement import lookup_predictions
from .forwards import forward_ms_by_width
from .machine import machine_info
from .prompts import DEFAULT_PROMPTS, GROUNDED_PROMPTS, encode, load_prompts

WRONG = -1  # stands for a draft proposal after the first mismatch: never the target's token


class ArgmaxDraft:
    """The draft model as the drafters see it, replaced by its argmaxes on the target's greedy text: correct
    while the sequence is a prefix of that text, WRONG after. Counts its forwards and their widths.

    With `confidence` (the draft's probability of its argmax after each position) and a threshold, it ends its
    run after a token below the threshold, as ModelDrafter does (draft_confidence_threshold). Off the text, after a
    WRONG token, its probabilities are unknown: it goes on, so the replay errs against the stop."""

    name = "model"

    def __init__(self, text: list[int], argmax: list[int], confidence: list[float] | None = None,
                 threshold: float = 0.0):
        self.text, self.argmax = text, argmax  # argmax[i]: the draft's next token after text[:i + 1]
        self.confidence, self.threshold = confidence, threshold
        self.length = 0  # tokens in its (simulated) cache
        self.widths: list[int] = []

    def draw(self, seq: list[int], generator=None):
        self.widths.append(len(seq) - self.length)
        self.length = len(seq)
        n = len(seq)
        if seq != self.text[:n]:
            return WRONG, None, True
        go_on = not self.threshold or self.confidence[n - 1] >= self.threshold
        return self.argmax[n - 1], None, go_on

    def propose(self, ids, gamma, limit, generator_at=None):
        from specdec.drafters import Proposal

        proposal, seq = Proposal(), list(ids)
        for _ in range(min(gamma, limit)):
            token, _, go_on = self.draw(seq)
            proposal.add(token, None, "model")
            seq.append(token)
            if not go_on:
                break
        return proposal

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)


class GatedHybrid(HybridDrafter):
    """The hybrid with a gate it does not have, replayed to see whether it would pay: no lookup in a round when
    the lookup's most recent prediction (at a position where its match was long enough) was not the token
    committed there. That depends on the committed sequence alone, so it would keep the output exact. Each
    position's prediction is looked up once, on the text, whose prefixes the committed sequences are."""

    def __init__(self, model, lookup: LookupDrafter, settings: LookupSettings, text: list[int], prompt_len: int):
        super().__init__(model, lookup, settings)
        predictions = lookup_predictions(text, prompt_len, settings.hybrid_min_match, settings.max_ngram)
        # position -> whether the lookup's prediction there was the text's token
        self.right = {position: token == text[position] for position, token in predictions.items()}

    def propose(self, ids: list[int], gamma: int, limit: int, generator_at):
        last = max((p for p in self.right if p < len(ids)), default=None)
        if last is not None and not self.right[last]:
            return self.model.propose(ids, gamma, limit, generator_at)
        return super().propose(ids, gamma, limit, generator_at)


def simulate(kind: str, prompt_len: int, text: list[int], argmax: list[int], gamma: int,
             settings: LookupSettings, confidence: list[float] | None = None, threshold: float = 0.0) -> dict:
    """The fixed-gamma loop's rounds on one prompt (kind: model, lookup, hybrid or hybrid-gated): (width,
    committed, proposed, accepted, drafter) per round and the draft forwards' widths."""
    draft = ArgmaxDraft(text, argmax, confidence, threshold)
    if kind == "model":
        drafter = draft
    else:
        lookup = LookupDrafter(1, settings, min_match=None if kind == "lookup" else settings.hybrid_min_match)
        lookup.one_hots = lambda tokens: torch.zeros(len(tokens), 1)  # no distributions needed here
        drafter = lookup if kind == "lookup" else HybridDrafter(draft, lookup, settings) if kind == "hybrid" \
            else GatedHybrid(draft, lookup, settings, text, prompt_len)
    ids, rounds = list(text[:prompt_len]), []
    if prompt_len >= FIRST_TOKEN_ALONE_FROM:  # the engine's first round: the target's prefill alone
        ids.append(text[prompt_len])
        rounds.append((1, 1, 0, 0, "none"))
    while len(ids) < len(text):
        limit = len(text) - len(ids) - 1
        proposal = drafter.propose(ids, gamma, limit, lambda i: None)
        k = len(proposal)
        truth = text[len(ids):len(ids) + k]
        accepted = next((i for i, (a, b) in enumerate(zip(proposal.tokens, truth)) if a != b), k)
        ids = text[:len(ids) + accepted + 1]
        rounds.append((k + 1, accepted + 1, k, accepted, proposal.drafter))
        drafter.rollback(len(ids) - 1)
    return {"rounds": rounds, "draft_widths": draft.widths}


def cost(sim: dict, target_ms: dict[int, float], draft_ms: dict[int, float]) -> float:
    """ms of the simulated rounds: a target forward per round at its width, the draft's forwards at theirs
    (widths past the measured ones cost the widest measured, extended linearly)."""
    def at(table, width):
        widest = max(table)
        if width <= widest:
            return table[max(width, 1)]
        slope = (table[widest] - table[widest // 2]) / (widest - widest // 2)
        return table[widest] + slope * (width - widest)

    return sum(at(target_ms, r[0]) for r in sim["rounds"]) + sum(at(draft_ms, w) for w in sim["draft_widths"])


CONFIDENCE_THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def hybrid_name(settings: LookupSettings, gamma: int = 4) -> str:
    return (f"hybrid g{gamma} n{settings.max_ngram} k{settings.max_tokens} h{settings.hybrid_min_match}"
            f"{' extend' if settings.extend else ''}")


def configurations(max_gamma: int = 6, confidence: bool = False):
    """(name, kind, gamma, LookupSettings, draft confidence threshold) of the grid; the confidence stop's
    configurations where the texts carry the draft's confidence."""
    for gamma in range(2, max_gamma + 1):
        yield f"model g{gamma}", "model", gamma, LookupSettings(), 0.0
    if confidence:
        for gamma, threshold in itertools.product((4, 5, 6, 8), CONFIDENCE_THRESHOLDS):
            yield f"model g{gamma} c{threshold}", "model", gamma, LookupSettings(), threshold
        for threshold in CONFIDENCE_THRESHOLDS:
            yield f"{hybrid_name(LookupSettings())} c{threshold}", "hybrid", 4, LookupSettings(), threshold
    for max_ngram, max_tokens, min_match in itertools.product((1, 2, 3, 4, 5, 6, 8), (4, 6, 8, 10, 12, 16), (1, 2, 3)):
        if min_match <= max_ngram:
            yield (f"lookup n{max_ngram} k{max_tokens} m{min_match}", "lookup", 4,
                   LookupSettings(max_ngram=max_ngram, max_tokens=max_tokens, min_match=min_match,
                                  hybrid_min_match=min_match), 0.0)
    for max_ngram, max_tokens, hybrid_min_match, extend in itertools.product((2, 3, 4, 6, 8), (6, 8, 10, 12, 16),
                                                                            (1, 2, 3, 4, 5, 6, 8), (False, True)):
        if hybrid_min_match <= max_ngram:
            settings = LookupSettings(max_ngram=max_ngram, max_tokens=max_tokens, hybrid_min_match=hybrid_min_match,
                                      extend=extend)
            yield hybrid_name(settings), "hybrid", 4, settings, 0.0
    yield f"{hybrid_name(LookupSettings())} gated", "hybrid-gated", 4, LookupSettings(), 0.0


DRAFT_FORWARDS = "decoding's"  # texts whose argmax and confidence came from one forward over the text lack it


def draft_outputs(decoder, text: list[int], prompt_len: int) -> dict:
    """The draft's argmax after every position of the text, and its probability (softmax of the logits).

    Computed as decoding computes them: the prompt in one forward (with the first new token, for a prompt whose
    first token the target draws alone), then the generated tokens one by one over the cache. One forward over
    the whole text is not the same for an int8 draft: its activations are quantized with one scale per forward,
    which the text's largest activation sets for every row, and on the default pair that agreed with the target's
    greedy text at 45-52% of a chat answer's positions where decoding's forwards agree at 70-75%."""
    draft = CachedModel(decoder.draft_model)
    # the draft's prefill takes the first new token too where the target drew it alone (engine._first_token)
    alone = decoder.first_token_alone(prompt_len) and len(text) > prompt_len
    first = prompt_len + 1 if alone else prompt_len
    rows = [draft.forward(text[:first], keep=first)]
    rows += [draft.forward([token]) for token in text[first:]]
    logits = torch.cat(rows)[:, : decoder.vocab_size].float()
    confidence, argmax = logits.softmax(-1).max(-1)
    return {"argmax": argmax.tolist(), "confidence": [round(p, 5) for p in confidence.tolist()],
            "draft_forwards": DRAFT_FORWARDS}


def greedy_texts(decoder, tokenizer, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """Each prompt's token ids and the target's greedy continuation (made with the hybrid drafter: the same
    tokens, faster), and the draft's argmax after every position of that text, with its probability."""
    out = []
    for item in prompts:
        ids = encode(tokenizer, item)
        result = decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=0, drafter="hybrid")
        text = ids + result.token_ids
        out.append({"id": item["id"], "prompt_len": len(ids), "text": text,
                    **draft_outputs(decoder, text, len(ids))})
        print(f"  {item['id']}: {len(ids)} + {len(result.token_ids)} tokens", file=sys.stderr)
    return out


def main(argv=None) -> int:
    from specdec.models.pair import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first N prompts of each set (those the benchmark's --limit N runs)")
    parser.add_argument("--limit", type=int, default=None, help="then take N prompts of each set")
    parser.add_argument("--costs", default=None, help="reuse the forward costs of an earlier run (its JSON)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--widths", type=int, default=17, help="measure forward costs at widths 1..N")
    parser.add_argument("--context", type=int, default=384, help="cached tokens when measuring forward costs")
    parser.add_argument("--texts", default=None, help="reuse the greedy texts of an earlier run (its JSON)")
    parser.add_argument("--draft", default=None, help="draft model (default: the default pair)")
    parser.add_argument("--target", default=None, help="target model (default: the default pair)")
    parser.add_argument("--out", default="bench/results/drafting")
    args = parser.parse_args(argv)

    widths = list(range(1, args.widths + 1))
    reused = json.loads(Path(args.texts).read_text()) if args.texts else None
    # texts of an earlier version carry no draft confidence, or came from one forward over the text (draft_outputs):
    # the draft model gives them again
    redraft = reused is not None and any(t.get("draft_forwards") != DRAFT_FORWARDS
                                         for items in reused["texts"].values() for t in items)
    if not (args.costs and args.texts) or redraft:  # the models are needed for costs, texts or confidence
        draft, target, tokenizer = load_pair(args.draft, args.target)
        decoder = SpeculativeDecoder(draft, target, tokenizer)
        device = input_device(target)
    if args.costs:
        earlier = json.loads(Path(args.costs).read_text())
        target_ms, draft_ms = ({int(w): ms for w, ms in earlier[name].items()} for name in ("target_ms", "draft_ms"))
    else:
        print("forward costs by width", file=sys.stderr)
        target_ms = forward_ms_by_width(target, args.context, widths, device, repeats=5)
        draft_ms = forward_ms_by_width(draft, args.context, widths, device, repeats=5)
    print(f"target ms {target_ms}\ndraft ms {draft_ms}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "costs.json").write_text(json.dumps({"target_ms": target_ms, "draft_ms": draft_ms}) + "\n")
    texts_from = None  # how the texts were made, where a reused file says
    if reused is not None:
        texts, texts_from = reused["texts"], reused.get("texts_from")
        if redraft:
            print("the draft's argmax and confidence on the reused texts", file=sys.stderr)
            for items in texts.values():
                for t in items:
                    t.update(draft_outputs(decoder, t["text"], t["prompt_len"]))
            texts_from = (texts_from or []) + [f"argmax and confidence from the draft model again "
                                               f"({time.strftime('%Y-%m-%d')})"]
            (out / "texts.json").write_text(json.dumps({"texts": texts, "texts_from": texts_from}) + "\n",
                                            encoding="utf-8")
    else:
        texts = {}
        for name, path in (("grounded", GROUNDED_PROMPTS), ("default", DEFAULT_PROMPTS)):
            print(f"greedy texts, {name} set", file=sys.stderr)
            prompts = load_prompts(path)[args.skip:]
            texts[name] = greedy_texts(decoder, tokenizer, prompts[: args.limit] if args.limit else prompts,
                                       args.max_new_tokens)
        (out / "texts.json").write_text(json.dumps({"texts": texts}) + "\n", encoding="utf-8")

    rows = []
    confidence = all("confidence" in t for items in texts.values() for t in items)
    for name, kind, gamma, settings, threshold in configurations(confidence=confidence):
        row = {"config": name, "kind": kind, "gamma": gamma, "settings": settings.__dict__,
               "draft_confidence_threshold": threshold}
        for set_name, items in texts.items():
            sims = [simulate(kind, t["prompt_len"], t["text"], t["argmax"], gamma, settings, t.get("confidence"),
                             threshold) for t in items]
            new = sum(len(t["text"]) - t["prompt_len"] for t in items)
            forwards = sum(len(s["rounds"]) for s in sims)
            baseline = new * target_ms[1]
            spent = sum(cost(s, target_ms, draft_ms) for s in sims)
            lookup_rounds = sum(1 for s in sims for r in s["rounds"] if r[4] == "lookup")
            row[set_name] = {"tokens_per_target_forward": new / forwards, "predicted_speedup": baseline / spent,
                             "lookup_round_share": lookup_rounds / forwards,
                             "mean_width": sum(r[0] for s in sims for r in s["rounds"]) / forwards}
        rows.append(row)

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python -m bench.drafting"] + (
        argv if argv is not None else sys.argv[1:])), "machine": machine_info(), "target_ms": target_ms,
        "draft_ms": draft_ms, "texts_from": texts_from, "rows": rows, "texts": texts}
    (out / "drafting.json").write_text(json.dumps(report) + "\n", encoding="utf-8")
    made = [f"Greedy texts: {'; '.join(texts_from)}.", ""] if texts_from else []
    prompts = ", ".join(f"{name} {len(items)}" for name, items in texts.items())
    lines = [f"# Greedy drafting simulated ({report['date']})", "", f"Command: `{report['command']}`", "",
             f"Prompts: {prompts}.", ""] + made + [
             "Forward ms by width (target / draft): " + ", ".join(
                 f"{w}: {target_ms[w]:.0f} / {draft_ms[w]:.0f}" for w in sorted(target_ms)), "",
             "| configuration | default: speedup | tokens/fwd | lookup rounds | grounded: speedup | tokens/fwd "
             "| lookup rounds | mean width |", "|---|---|---|---|---|---|---|---|"]
    rows.sort(key=lambda r: -r["grounded"]["predicted_speedup"])
    for row in rows:
        d, g = row["default"], row["grounded"]
        lines.append(f"| {row['config']} | {d['predicted_speedup']:.2f}x | {d['tokens_per_target_forward']:.2f} "
                     f"| {d['lookup_round_share']:.2f} | {g['predicted_speedup']:.2f}x "
                     f"| {g['tokens_per_target_forward']:.2f} | {g['lookup_round_share']:.2f} | {g['mean_width']:.1f} |")
    (out / "drafting.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines[:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
