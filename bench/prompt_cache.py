"""The prompt cache (specdec/prompt_cache.py, issue 41) on three workloads that repeat themselves, each request
decoded with the cache (`cache_prompt` true) and without it (false), turn by turn, side by side:

- chat: conversations of several turns; each turn sends the whole conversation again, through the target's chat
  template, its user message a piece of this repository's own code with a question about it;
- document: conversations about one long document (a source file, --document-tokens, in the first user message),
  each later turn a short question about it: chat with a file, or a long system prompt, where each turn brings few
  new tokens;
- agent: a conversation that grows by the model's step (a tool call, as plain text) and a tool result (a file's
  text, as a `tool` message) each step;
- editor: one source file, a completion asked at successive points down the file (fill-in-the-middle where the
  tokenizer has its tokens: the prefix is shared up to each point, the suffix differs), the first line of each
  completion typed in before the next.

Greedy, the model drafter, gamma 4, answers of at most --max-new-tokens. Reports per workload: time to first token
(the first round: the prefill and the first proposals) and whole-request time, with and without the cache, their
ratios pooled over the requests with --min-history tokens of history or more and a 90% bootstrap interval over
conversations (steps, for the agent and the editor); the share of prompt tokens the cache served; the memory it
held; the share of the warm requests' prompt tokens that were not cached (what a prefill linear in its tokens
would make the first-token ratio); requests that found nothing to reuse, against the same without the cache;
whether each greedy answer was the same both ways; and, for the chat template, how much of the last turn's prompt
and answer the next prompt repeats token for token.

    python -m bench.prompt_cache --out bench/results/prompt-cache          # the default pair (`make models`)
    python -m bench.prompt_cache --tiny --out /tmp/prompt-cache            # the tests' tiny pair
    python -m bench.prompt_cache --tiny --compile true --out /tmp/pc       # its compiled static-cache path
"""

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.summary import bootstrap_interval
from specdec import SamplingParams, SpeculativeDecoder
from specdec.engine import eos_token_ids
from specdec.prompt_cache import common_prefix
from specdec.text import encode_messages

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["specdec/drafters.py", "specdec/verification.py", "specdec/kv_cache.py", "specdec/sampling.py",
           "specdec/adaptive.py", "specdec/params.py", "specdec/compiled.py", "specdec/stats.py"]
# 2,000 tokens or more each, so that every document conversation reaches its --document-tokens
DOCUMENTS = ["specdec/drafters.py", "specdec/verification.py", "specdec/prompt_cache.py", "specdec/grammar.py"]
QUESTIONS = ["What does this code do, in two sentences?", "Is there a bug here? Answer briefly.",
             "Which function would you test first, and how?", "Suggest one better name, and say why.",
             "What could be simpler? One suggestion.", "Summarise the invariant it keeps."]
AGENT_SYSTEM = ("You are a coding agent. Tools: read_file(path) returns a file's text; search(text) returns the "
                "lines that contain it; finish(answer) ends the task. Answer each step with one tool call as "
                "`tool(argument)`, then one line saying why.")
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
CONVERSATIONS = ("chat", "document")  # the workloads of several conversations (bootstrapped over conversations)
WORKLOADS = (*CONVERSATIONS, "agent", "editor")


def snippet(path: str, tokenizer, tokens: int, start_line: int = 0) -> str:
    """About `tokens` tokens of a source file, whole lines from `start_line`."""
    lines, out, count = (ROOT / path).read_text().splitlines(keepends=True)[start_line:], [], 0
    for line in lines:
        count += len(tokenizer.encode(line, add_special_tokens=False))
        out.append(line)
        if count >= tokens:
            break
    return "".join(out)


def chat_workloads(tokenizer, conversations: int, turns: int, snippet_tokens: int) -> list[list[dict]]:
    """Per conversation, its user messages (each a piece of code and a question) after a system prompt."""
    workloads = []
    for c in range(conversations):
        messages = [{"role": "system", "content": f"You are a concise code reviewer (session {c + 1})."}]
        for t in range(turns):
            path = SOURCES[(c * turns + t) % len(SOURCES)]
            code = snippet(path, tokenizer, snippet_tokens, start_line=20 * c)
            messages.append({"role": "user", "content": f"From {path}:\n```python\n{code}```\n{QUESTIONS[t % 6]}"})
        workloads.append(messages)
    return workloads


def document_workloads(tokenizer, conversations: int, turns: int, document_tokens: int) -> list[list[dict]]:
    """Per conversation, its user messages: a whole source file and a question, then short questions about it."""
    workloads = []
    for c in range(conversations):
        path = DOCUMENTS[c % len(DOCUMENTS)]
        document = snippet(path, tokenizer, document_tokens)
        messages = [{"role": "system", "content": f"You answer questions about one file (session {c + 1})."},
                    {"role": "user", "content": f"{path}:\n```python\n{document}```\n{QUESTIONS[c % 6]}"}]
        messages += [{"role": "user", "content": QUESTIONS[(c + t) % 6]} for t in range(1, turns)]
        workloads.append(messages)
    return workloads


def agent_results(tokenizer, steps: int, result_tokens: int) -> list[str]:
    return [f"{SOURCES[s % len(SOURCES)]}:\n" + snippet(SOURCES[s % len(SOURCES)], tokenizer, result_tokens, 40)
            for s in range(steps)]


def editor_prompts(tokenizer, file_tokens: int, points: int):
    """The file, and a function of (the file now, the cursor) -> the prompt's token ids."""
    text = snippet("specdec/engine.py", tokenizer, file_tokens)
    fim = all(tokenizer.convert_tokens_to_ids(t) not in (None, tokenizer.unk_token_id) for t in FIM)

    def prompt(now: str, cursor: int) -> list[int]:
        if not fim:
            return tokenizer.encode(now[:cursor], add_special_tokens=False)
        return tokenizer.encode(f"{FIM[0]}{now[:cursor]}{FIM[1]}{now[cursor:]}{FIM[2]}", add_special_tokens=False)

    line_starts = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    cursors = [line_starts[int(len(line_starts) * (0.5 + 0.4 * k / max(points - 1, 1))) - 1] for k in range(points)]
    return text, cursors, prompt


class Side:
    """One side of the comparison (the cache on or off): its requests, and for chats the conversation so far."""

    def __init__(self, cache: bool):
        self.cache = cache
        self.requests: list[dict] = []
        self.previous: list[int] | None = None  # the last request's prompt and answer ids

    def run(self, decoder, ids: list[int], params: SamplingParams, unit: str, step: int) -> list[int]:
        result = decoder.generate(ids, params=params.replace(cache_prompt=self.cache))
        s = result.stats
        answer = list(result.token_ids)
        reusable = common_prefix(ids, self.previous) if self.previous is not None else 0
        self.requests.append({
            "unit": unit, "step": step, "prompt_tokens": len(ids), "cached_tokens": s.cached_tokens or 0,
            "history_tokens": len(self.previous) if self.previous is not None else 0,
            "repeated_tokens": reusable,  # of the last prompt and answer, what this prompt repeats token for token
            "first_token_seconds": s.first_chunk_seconds, "seconds": s.total_seconds, "new_tokens": s.new_tokens,
            "target_prefill_seconds": s.target_prefill_seconds, "draft_prefill_seconds": s.draft_prefill_seconds,
            "answer": answer, "cache_bytes": decoder.prompt_cache.nbytes, "cache_entries": len(decoder.prompt_cache)})
        self.previous = ids + answer
        print(f"{unit} step {step} cache {'on' if self.cache else 'off'}: {len(ids)} prompt tokens, "
              f"{s.cached_tokens or 0} cached, {s.first_chunk_seconds:.2f} s to the first token, "
              f"{s.total_seconds:.2f} s", file=sys.stderr, flush=True)
        return answer


def text_of(tokenizer, ids: list[int], eos: set[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)


def run_workloads(decoder, tokenizer, args) -> dict:
    """Every workload, the cache on and off interleaved request by request (which goes first alternates)."""
    params = SamplingParams(max_new_tokens=args.max_new_tokens, method="google", gamma=4, temperature=0, seed=0)
    eos = eos_token_ids(decoder.target_model, tokenizer)
    sides = {workload: {True: Side(True), False: Side(False)} for workload in args.workloads}
    order = 0

    def both(workload, ids_of, unit, step):
        nonlocal order
        answers = {}
        for cache in ((True, False) if order % 2 else (False, True)):
            answers[cache] = sides[workload][cache].run(decoder, ids_of(cache), params, unit, step)
        order += 1
        return answers

    conversations = {"chat": lambda: chat_workloads(tokenizer, args.conversations, args.turns, args.snippet_tokens),
                     "document": lambda: document_workloads(tokenizer, args.conversations, args.turns,
                                                            args.document_tokens)}
    for workload in [w for w in args.workloads if w in CONVERSATIONS]:
        for c, messages in enumerate(conversations[workload]()):
            history = {True: messages[:1], False: messages[:1]}
            for side in sides[workload].values():
                side.previous = None
            for t, user in enumerate(messages[1:]):
                for cache in (True, False):
                    history[cache] = history[cache] + [user]
                answers = both(workload, lambda cache: encode_messages(tokenizer, history[cache]),
                               f"{workload}{c + 1}", t + 1)
                for cache in (True, False):
                    history[cache] = history[cache] + [{"role": "assistant",
                                                        "content": text_of(tokenizer, answers[cache], eos)}]
    if "agent" in args.workloads:
        agent(tokenizer, args, both, eos)
    if "editor" in args.workloads:
        editor(tokenizer, args, both, eos)
    return {workload: {("on" if cache else "off"): side.requests for cache, side in pair.items()}
            for workload, pair in sides.items()}


def agent(tokenizer, args, both, eos) -> None:
    results = agent_results(tokenizer, args.steps, args.result_tokens)
    history = {cache: [{"role": "system", "content": AGENT_SYSTEM},
                       {"role": "user", "content": "Find where the engine rolls its caches back, and explain it."}]
               for cache in (True, False)}
    for s in range(args.steps):
        answers = both("agent", lambda cache: encode_messages(tokenizer, history[cache]), "agent", s + 1)
        for cache in (True, False):
            history[cache] = history[cache] + [{"role": "assistant", "content": text_of(tokenizer, answers[cache], eos)},
                                               {"role": "tool", "content": results[s]}]


def editor(tokenizer, args, both, eos) -> None:
    text, cursors, prompt = editor_prompts(tokenizer, args.file_tokens, args.points)
    files = {True: text, False: text}
    shift = {True: 0, False: 0}
    for k, cursor in enumerate(cursors):
        answers = both("editor", lambda cache: prompt(files[cache], cursor + shift[cache]), "editor", k + 1)
        for cache in (True, False):  # the completion's first line typed in at the cursor
            typed = text_of(tokenizer, answers[cache], eos).split("\n")[0] + "\n"
            at = cursor + shift[cache]
            files[cache] = files[cache][:at] + typed + files[cache][at:]
            shift[cache] += len(typed)


def _ratio(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    on, off = sum(p[0][key] for p in pairs), sum(p[1][key] for p in pairs)
    return on / off if off else None


def summarise(runs: dict, min_history: int) -> dict:
    summary = {}
    for workload, sides in runs.items():
        pairs = list(zip(sides["on"], sides["off"]))
        warm = [(on, off) for on, off in pairs if on["step"] > 1 and on["history_tokens"] >= min_history]
        cold = [(on, off) for on, off in pairs if on["step"] == 1]
        units: dict[str, list] = {}
        for pair in warm:
            units.setdefault(pair[0]["unit"] if workload in CONVERSATIONS else pair[0]["step"], []).append(pair)
        by_unit = list(units.values())
        repeatable = [on for on in sides["on"] if on["history_tokens"]]
        summary[workload] = {
            "requests": len(pairs), "warm_requests": len(warm),
            "prompt_tokens": sum(on["prompt_tokens"] for on, _ in pairs),
            "cached_tokens": sum(on["cached_tokens"] for on, _ in pairs),
            "cached_share": sum(on["cached_tokens"] for on, _ in pairs) / sum(on["prompt_tokens"] for on, _ in pairs),
            "first_token_ratio": _ratio(warm, "first_token_seconds"),
            # what a prefill linear in its tokens would make that ratio: the warm prompts' share not cached
            "uncached_share": (sum(on["prompt_tokens"] - on["cached_tokens"] for on, _ in warm)
                               / sum(on["prompt_tokens"] for on, _ in warm)) if warm else None,
            "first_token_interval": bootstrap_interval(by_unit, lambda p: _ratio(p, "first_token_seconds"))
            if by_unit else None,
            "speedup": (1 / _ratio(warm, "seconds")) if warm else None,
            "speedup_interval": sorted(1 / x for x in bootstrap_interval(by_unit, lambda p: _ratio(p, "seconds")))
            if by_unit else None,
            "cold_ratio": _ratio(cold, "seconds"),
            "same_answers": sum(on["answer"] == off["answer"] for on, off in pairs),
            "max_cache_bytes": max(on["cache_bytes"] for on, _ in pairs),
            "max_cache_entries": max(on["cache_entries"] for on, _ in pairs),
            # the chat template: of the last turn's prompt and answer, what the next prompt repeats (cache on)
            "template_repeated": sum(on["repeated_tokens"] for on in repeatable),
            "template_history": sum(on["history_tokens"] for on in repeatable),
            "per_step": [{"step": on["step"], "unit": on["unit"], "prompt_tokens": on["prompt_tokens"],
                          "cached_tokens": on["cached_tokens"], "history_tokens": on["history_tokens"],
                          "first_token_on": on["first_token_seconds"], "first_token_off": off["first_token_seconds"],
                          "seconds_on": on["seconds"], "seconds_off": off["seconds"],
                          "new_tokens": on["new_tokens"]} for on, off in pairs],
        }
    return summary


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Prompt cache: {report['pair']} pair, {report['date']}", "",
             f"`{report['command']}` on {report['machine'].get('cpu', '?')}; greedy, model drafter, gamma 4, at most "
             f"{a['max_new_tokens']} new tokens. Ratios pool the requests with at least {a['min_history']} tokens of "
             "history (after the first turn); intervals are 90% bootstrap over conversations (chat, document) or "
             "steps.", "",
             "| workload | requests | prompt tokens | served from cache | first token, on/off | interval | "
             "warm prompts not cached | "
             "whole request speedup | interval | nothing to reuse, on/off | same greedy answers | cache held (max) "
             "| template repeats |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        def f(x, spec=".2f"):
            return "-" if x is None else format(x, spec)

        def interval(x, suffix=""):
            return "-" if x is None else f"{x[0]:.2f}-{x[1]:.2f}{suffix}"

        template = (f"{s['template_repeated']}/{s['template_history']}" if s["template_history"] else "-")
        lines.append(f"| {name} | {s['requests']} ({s['warm_requests']} warm) | {s['prompt_tokens']} | "
                     f"{s['cached_share']:.1%} | {f(s['first_token_ratio'], '.3f')}x | "
                     f"{interval(s['first_token_interval'])} | {f(s['uncached_share'], '.3f')} | "
                     f"{f(s['speedup'])}x | {interval(s['speedup_interval'])} | "
                     f"{f(s['cold_ratio'])}x | {s['same_answers']}/{s['requests']} | "
                     f"{s['max_cache_bytes'] / 1e6:.0f} MB in {s['max_cache_entries']} | {template} |")
    lines += ["", "Per request (seconds: first token on / off, whole request on / off):", "",
              "| workload | unit | step | prompt tokens | cached | first token on | off | whole on | off |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        for r in s["per_step"]:
            lines.append(f"| {name} | {r['unit']} | {r['step']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                         f"{r['first_token_on']:.2f} | {r['first_token_off']:.2f} | {r['seconds_on']:.2f} | "
                         f"{r['seconds_off']:.2f} |")
    memory = report["memory"]
    lines += ["", "Resident memory (GB): before loading {}, loaded {}, after the workloads {}; the budget {}.".format(
        *(f"{memory[k] / 1e9:.2f}" if memory[k] is not None else "?" for k in
          ("before_loading", "loaded", "after", "budget")))]
    if memory["loaded"] is not None and memory["after"] is not None:
        over = memory["after"] - memory["loaded"] - memory["budget"]
        lines[-1] += (f" After the workloads, {-over / 1e9:.2f} GB under the loaded figure plus the budget." if over <= 0
                      else f" After the workloads, {over / 1e9:.2f} GB OVER the loaded figure plus the budget.")
    return "\n".join(lines) + "\n"


def resident_bytes() -> int | None:
    from specdec.serve.metrics import resident_memory_bytes

    return resident_memory_bytes()


def workload_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload {', '.join(unknown)}: of {', '.join(WORKLOADS)}")
    return names


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny pair (a check that it runs)")
    parser.add_argument("--out", default="bench/results/prompt-cache")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--snippet-tokens", type=int, default=220, help="code tokens in each chat turn")
    parser.add_argument("--document-tokens", type=int, default=1200, help="the document workload's file")
    parser.add_argument("--steps", type=int, default=6, help="agent steps")
    parser.add_argument("--result-tokens", type=int, default=180, help="tokens of each tool result")
    parser.add_argument("--file-tokens", type=int, default=1500, help="the editor's file")
    parser.add_argument("--points", type=int, default=5, help="the editor's completion points")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workloads", type=workload_list, default=list(WORKLOADS),
                        help=f"comma-separated, of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--min-history", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=None, help="prompt cache bytes (default: as the service)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="the pair's dtype, as load_pair takes it")
    parser.add_argument("--compile", choices=("true", "false"), default="false",
                        help="the compiled static-cache path: each model's static cache holds the latest sequence, "
                             "the prompt cache a copy of what a request writes over")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.models.pair import load_pair
    from specdec.prompt_cache import default_budget, memory_bytes, weights_bytes

    before = resident_bytes()
    if args.tiny:  # the tests' tiny pair, with a context long enough for character-level prompts
        from tests.support.models import make_model, make_tokenizer, perturbed_copy

        tokenizer = make_tokenizer()
        target = make_model("llama", seed=0, initializer_range=0.1, vocab_size=100, context=16_384,
                            eos_token_id=tokenizer.convert_tokens_to_ids("<eos>"))
        draft = perturbed_copy(target, noise=0.3)
        if args.compile == "true":
            from specdec.compiled import compile_model

            for model in (draft, target):
                compile_model(model, target.device)
    else:
        draft, target, tokenizer = load_pair(dtype=args.dtype, compile=args.compile == "true")
    if args.budget is not None:
        budget = args.budget
    elif args.tiny:  # the service's default would be the tiny weights' size: less than an entry
        budget = 64_000_000
    else:
        budget = default_budget(weights_bytes(draft, target), memory_bytes(target.device))
    decoder = SpeculativeDecoder(draft, target, tokenizer, prompt_cache_bytes=budget)
    decoder.generate(tokenizer.encode("Hello", add_special_tokens=False)[:1] or [0], max_new_tokens=2,
                     temperature=0, cache_prompt=False)  # warm-up: nothing kept
    loaded = resident_bytes()
    started = time.perf_counter()
    runs = run_workloads(decoder, tokenizer, args)
    report = {
        "command": "python -m bench.prompt_cache " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine_info(),
        "pair": "tiny" if args.tiny else "default", "args": vars(args), "budget": budget,
        "seconds": time.perf_counter() - started,
        "memory": {"before_loading": before, "loaded": loaded, "after": resident_bytes(), "budget": budget},
        "summary": summarise(runs, args.min_history), "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
