"""What logprobs cost: the extra time per generated token when a request asks for them, and per prompt token when
echo scores the prompt.

    python -m bench.logprobs [--limit 8] [--max-new-tokens 64] [--top 1,20] [--json FILE] [--draft D --target T]

Three figures, on the default pair (or --draft/--target) as load_pair gives it:
- **In the loop.** Each prompt of bench/prompts.jsonl decoded greedily (model drafting, gamma 4) without logprobs
  and with logprobs=k for each k, back to back per prompt. Greedy runs give the same tokens every time, so the
  only added work is `token_logprobs` on each round's committed rows: its time is summed inside the runs (the
  real rows, shapes and caches) per generated token. The runs' wall and CPU time per token, with and without,
  are reported too; on a shared machine their noise is far larger than the difference.
- **The work alone.** `token_logprobs` on a round's target rows (gamma + 1 rows of the vocabulary), timed in
  isolation (the best and the median of many), per committed token at full acceptance (gamma + 1 tokens per
  round) and at one token per round.
- **Echo.** The prompt's prefill keeping every row's logits (the output layer over every prompt position) and
  the prompt's logprobs, against the prefill keeping the last row, alternated three times per prompt, the best
  of each: extra ms per prompt token.

A request without logprobs runs none of this (tests/test_logprobs.py checks that no forward keeps more rows and
no log-softmax runs).
"""

import argparse
import json
import statistics
import time

import torch

from specdec import SamplingParams, SpeculativeDecoder, engine, load_pair
from specdec.kv_cache import CachedModel
from specdec.sampling import token_logprobs

from .prompts import DEFAULT_PROMPTS, encode, load_prompts


def in_the_loop(decoder, prompts: list[list[int]], tops: list[int], max_new_tokens: int, gamma: int) -> dict:
    """Pooled ms per generated token without logprobs and with each k, the runs of a prompt back to back in an
    order that turns from prompt to prompt (so drift within a prompt's runs lands on each variant alike); wall
    time and the process's CPU time (less moved by other processes' load)."""
    variants = [None, *tops]
    spent = {"seconds": 0.0}

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return token_logprobs(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - started

    work = {k: 0.0 for k in variants}
    wall = {k: 0.0 for k in variants}
    cpu = {k: 0.0 for k in variants}
    tokens = {k: 0 for k in variants}
    for i, ids in enumerate(prompts):
        outputs = {}
        for k in variants[i % len(variants):] + variants[:i % len(variants)]:
            params = SamplingParams(max_new_tokens=max_new_tokens, gamma=gamma, temperature=0, logprobs=k)
            started, spent["seconds"] = time.process_time(), 0.0
            engine.token_logprobs = timed
            try:
                result = decoder.generate(ids, params=params)
            finally:
                engine.token_logprobs = token_logprobs
            cpu[k] += time.process_time() - started
            work[k] += spent["seconds"]
            wall[k] += result.stats.total_seconds
            tokens[k] += result.stats.new_tokens
            outputs[k] = result.token_ids
        assert all(out == outputs[None] for out in outputs.values()), "greedy runs gave different tokens"
    base, base_cpu = 1e3 * wall[None] / tokens[None], 1e3 * cpu[None] / tokens[None]
    rows = {"none": {"logprobs_work_ms_per_token": 1e3 * work[None] / tokens[None], "ms_per_token": base,
                     "cpu_ms_per_token": base_cpu, "tokens": tokens[None]}}
    for k in tops:
        ms, cpu_ms = 1e3 * wall[k] / tokens[k], 1e3 * cpu[k] / tokens[k]
        rows[str(k)] = {"logprobs_work_ms_per_token": 1e3 * work[k] / tokens[k],
                        "ms_per_token": ms, "extra_ms_per_token": ms - base, "ratio": ms / base,
                        "cpu_ms_per_token": cpu_ms, "extra_cpu_ms_per_token": cpu_ms - base_cpu,
                        "cpu_ratio": cpu_ms / base_cpu, "tokens": tokens[k]}
    return rows


def work_alone(vocab: int, gamma: int, tops: list[int], repeats: int = 200) -> dict:
    """Median ms of token_logprobs over a round's gamma + 1 rows, and per committed token."""
    logits = torch.randn(gamma + 1, vocab, generator=torch.Generator().manual_seed(0)) * 4
    tokens = list(range(gamma + 1))
    rows = {}
    for k in tops:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            token_logprobs(logits, tokens, k)
            times.append(time.perf_counter() - start)
        one = []
        for _ in range(repeats):
            start = time.perf_counter()
            token_logprobs(logits[:1], tokens[:1], k)
            one.append(time.perf_counter() - start)
        best, median = 1e3 * min(times), 1e3 * statistics.median(times)
        rows[str(k)] = {"ms_per_round": best, "median_ms_per_round": median,
                        "ms_per_token_full_acceptance": best / (gamma + 1),
                        "ms_per_token_one_per_round": 1e3 * min(one)}
    return rows


def echo(target, prompts: list[list[int]], vocab: int, top: int = 1, turns: int = 3) -> dict:
    """Extra ms per prompt token when the prefill keeps every row and the prompt's logprobs are taken: the two
    prefills of a prompt alternated `turns` times, the best of each."""
    plain = scored = 0.0
    count = 0
    for ids in prompts:
        best = {1: float("inf"), len(ids): float("inf")}
        for _ in range(turns):
            for keep in best:
                model = CachedModel(target)
                start = time.perf_counter()
                rows = model.forward(ids, keep=keep)
                if keep > 1:
                    token_logprobs(rows[:-1, :vocab], ids[1:], top)
                best[keep] = min(best[keep], time.perf_counter() - start)
        plain += best[1]
        scored += best[len(ids)]
        count += len(ids)
    return {"prompt_tokens": count, "prefill_ms_per_prompt_token": 1e3 * plain / count,
            "scored_ms_per_prompt_token": 1e3 * scored / count, "extra_ms_per_prompt_token": 1e3 * (scored - plain) / count,
            "ratio": scored / plain}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--top", default="1,20", help="logprobs values (alternatives per token) to measure")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--target", default=None)
    parser.add_argument("--repeats", type=int, default=200, help="timings of the work alone (the median is kept)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    tops = [int(k) for k in args.top.split(",")]

    draft, target, tokenizer = load_pair(args.draft, args.target)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    prompts = [encode(tokenizer, item) for item in load_prompts(DEFAULT_PROMPTS, args.limit)]
    decoder.generate(prompts[0], params=SamplingParams(max_new_tokens=2, temperature=0))  # warm-up

    figures = {"work_alone": work_alone(decoder.vocab_size, args.gamma, tops, args.repeats),
               "echo": echo(target, prompts, decoder.vocab_size),
               "in_the_loop": in_the_loop(decoder, prompts, tops, args.max_new_tokens, args.gamma),
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
               "torch_threads": torch.get_num_threads()}
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
