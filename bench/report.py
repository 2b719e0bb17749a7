"""The benchmark's report as Markdown: the run's settings, then the tables of each prompt set and mode."""

from bench.methods import HF_PROMPT_LOOKUP_TOKENS, MODES
from bench.summary import PAIRED_BASELINES


def markdown(report: dict) -> str:
    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    def times(value):
        return "-" if value is None else f"{value:.2f}x"

    def pct(value):
        return "-" if value is None else f"{100 * value:+.1f}%"

    def interval(bounds):
        return "-" if not bounds else f"{pct(bounds[0])} to {pct(bounds[1])}"

    def ratio_interval(bounds):
        return "-" if not bounds else f"{bounds[0]:.2f}x to {bounds[1]:.2f}x"

    def shares(row):
        share = row.get("round_share_by_drafter") or {}
        return " / ".join(f"{share.get(d, 0):.2f}" for d in ("model", "lookup", "none")) if share else "-"

    sizes = report["prompts"] if isinstance(report["prompts"], dict) else {"default": report["prompts"]}
    lines = [f"# specdec benchmark, {report['date']}", "",
             f"Command: `{report['command']}`", ""]
    if report.get("runs_from"):
        lines += ["Runs from: " + "; ".join(report["runs_from"]), ""]
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if v is not None), "",
             f"Models: draft `{report['draft']}` (ours: quantization {report.get('draft_quantization', 'none')}), "
             f"target `{report['target']}`" + (f", {report['dtype']}" if report.get("dtype") else "")
             + "; prompts per set: "
             + ", ".join(f"{name} {n}" for name, n in sizes.items())
             + f"; max_new_tokens {report['max_new_tokens']}, repeats {report['repeats']}, gamma {report['gamma']}"
             + ("; lookup " + ", ".join(f"{k} {v}" for k, v in report["lookup"].items()) if report.get("lookup") else "")
             + ".",
             "", "Methods are drafter-verification (model-token is Google speculative sampling with the draft model); "
             f"hf_lookup is Hugging Face's prompt lookup (prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS}), "
             "hf_assisted its assisted generation (which refits its confidence threshold every round where "
             "scikit-learn is installed: Machine's scikit_learn; hf_assisted_fixed_threshold never does). "
             "Rounds: the share served by the draft model / the lookup / nobody (the target alone). Block gain: "
             "on the blocks the run drafted, expected accepted tokens per round under block verification over "
             "token verification (EXPECTED_ACCEPTED); the Leviathan bound and efficiency are for model drafting, "
             "one chain from the draft model.", ""]
    startup = report.get("startup")
    if startup:
        gb = 1e9
        lines += [f"Start-up (a fresh process, `{startup['command_line']}`): load_pair "
                  f"{startup['load_pair_seconds']:.1f} s, ready after the warm-up {startup['ready_seconds']:.1f} s; "
                  f"resident memory {startup['steady_rss'] / gb:.2f} GB steady "
                  f"({startup['steady_over_weights']:.2f}x the {startup['weights_bytes'] / gb:.2f} GB of weights as "
                  f"used), {startup['peak_rss'] / gb:.2f} GB at the peak ({startup['peak_over_steady']:.2f}x steady).",
                  ""]
    for kernels, block in report.get("verification_cost", {}).items():
        lines.append(f"Target forward over n new tokens ({kernels} kernels, {block['context']} cached): "
                     + ", ".join(f"n={n}: {fmt(ms, '.0f')} ms ({times(block['relative'][n])})"
                                 for n, ms in block["ms"].items()))
        lines.append("")
    for set_name, modes in report["summary"].items():
        for mode, block in modes.items():
            rows = block["methods"]
            own = any("speedup_vs_hf_assisted_own_memory" in row for row in rows.values()) \
                and "hf_assisted_own_memory" in rows
            lines += [f"## {set_name} prompts, {mode} ({', '.join(f'{k}={v}' for k, v in MODES[mode].items())})", "",
                      f"Measured cost ratio c (draft/target time per token): {fmt(block['cost_ratio_c'], '.3f')}", "",
                      "| method | tokens/s | vs target | vs HF lookup | vs HF assisted "
                      + ("| vs HF assisted, own memory " if own else "")
                      + "| tokens/target fwd | acceptance rate | rounds model / lookup / none | block gain "
                      "| alpha | mean gamma | Leviathan bound | efficiency | outside forwards |",
                      "|---|---|---|---|---" + ("|---" if own else "") + "|---|---|---|---|---|---|---|---|---|"]
            for method, row in rows.items():
                lines.append(
                    f"| {method} | {fmt(row['tokens_per_second'])} | {times(row.get('speedup_vs_target'))} "
                    f"| {times(row.get('speedup_vs_hf_lookup'))} | {times(row.get('speedup_vs_hf_assisted'))} "
                    + (f"| {times(row.get('speedup_vs_hf_assisted_own_memory'))} " if own else "")
                    + f"| {fmt(row.get('tokens_per_target_forward'))} | {fmt(row.get('acceptance_rate'))} "
                    f"| {shares(row)} | {pct(row.get('block_gain_accepted'))} | {fmt(row.get('alpha'))} "
                    f"| {fmt(row.get('mean_gamma'))} | {fmt(row.get('leviathan_bound'))} | {fmt(row.get('efficiency'))} "
                    f"| {fmt(100 * row['outside_forward_share'] if 'outside_forward_share' in row else None, '.1f')}% |")
            paired = {m: row for m, row in rows.items() if row.get("prompt_speedup_vs_target")}
            if paired:
                lines += ["", "Per prompt: the median over prompts of each prompt's own ratio (speedup on that "
                          "prompt; the range over prompts; efficiency against the bound for that prompt's alpha, with "
                          "the run's c). The efficiency above uses the alpha pooled over all prompts instead.", "",
                          "| method | vs target | range over prompts | vs HF lookup | vs HF assisted | efficiency |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {m} | {times(row['prompt_speedup_vs_target'])} "
                          f"| {fmt(min(row['prompt_speedups_vs_target']))}-{times(max(row['prompt_speedups_vs_target']))} "
                          f"| {times(row.get('prompt_speedup_vs_hf_lookup'))} "
                          f"| {times(row.get('prompt_speedup_vs_hf_assisted'))} | {fmt(row.get('prompt_efficiency'))} |"
                          for m, row in paired.items()]
            for baseline in PAIRED_BASELINES:
                against = {m: row["paired"][baseline] for m, row in rows.items() if baseline in row.get("paired", {})}
                if not against:
                    continue
                lines += ["", f"Paired with {baseline} on the same prompts and repeats: tokens/s over {baseline}'s, "
                          "pooled (all tokens over all seconds), with a 90% interval that resamples the prompts "
                          "(bootstrap); the same past the first round (the prompt's prefill).", "",
                          "| method | prompts | pooled | 90% interval | past the first round | 90% interval |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {m} | {p['prompts']} | {times(p['pooled'])} | {ratio_interval(p['interval'])} "
                          f"| {times(p.get('decode_pooled'))} | {ratio_interval(p.get('decode_interval'))} |"
                          for m, p in against.items()]
            scored = {m: row for m, row in rows.items() if row.get("block_gain_accepted") is not None}
            if scored:
                lines += ["", "Block verification on the same proposals: expected accepted tokens per round, and "
                          "tokens per round (accepted + 1), under block over token verification, on the blocks each "
                          "run drafted; the 90% interval resamples the prompts (bootstrap).", "",
                          "| method | accepted per round | tokens per round | 90% interval over prompts |",
                          "|---|---|---|---|"]
                lines += [f"| {m} | {pct(row['block_gain_accepted'])} | {pct(row['block_gain_tokens_per_round'])} "
                          f"| {interval(row.get('block_gain_tokens_per_round_interval'))} |" for m, row in scored.items()]
            agreeing = {m: row["same_tokens_as_target"] for m, row in rows.items() if row.get("same_tokens_as_target")}
            if agreeing:
                lines += ["", "Greedy outputs: prompts on which each method generated exactly the tokens of our "
                          "target-only decoding (what greedy speculative decoding promises).", "",
                          "| method | same tokens as target-only |", "|---|---|"]
                lines += [f"| {m} | {a['same']}/{a['prompts']} |" for m, a in agreeing.items()]
            steady = {m: row for m, row in rows.items() if row.get("decode_tokens_per_second")}
            if steady:
                lines += ["", "Steady state: the first round (prompt prefill and first proposals, or the first token) "
                          "apart, the rate of the tokens after it, which is what the Leviathan bound describes.", "",
                          "| method | first round (s) | decode tokens/s | vs target | decode efficiency |",
                          "|---|---|---|---|---|"]
                lines += [f"| {m} | {fmt(row['first_chunk_seconds'])} | {fmt(row['decode_tokens_per_second'])} "
                          f"| {times(row.get('decode_speedup_vs_target'))} | {fmt(row.get('decode_efficiency'))} |"
                          for m, row in steady.items()]
            loop = {m: row for m, row in rows.items() if row.get("in_loop_bound")}
            if loop:
                lines += ["", "Where the time goes (model drafting): ms per forward after each model's first (the "
                          "prompt prefill), in the speculative loop against each model decoding alone; the in-loop "
                          "bound is the Leviathan bound with the in-loop c and the verification forward's in-loop cost "
                          "relative to a target-only forward.", "",
                          "| method | draft ms/forward | target ms/forward | in-loop c | verification cost | "
                          "in-loop bound | decode efficiency vs in-loop bound |",
                          "|---|---|---|---|---|---|---|"]
                lines += [f"| {m} | {fmt(row.get('draft_ms_per_forward'), '.1f')} "
                          f"| {fmt(row.get('target_ms_per_forward'), '.1f')} "
                          f"| {fmt(row.get('in_loop_cost_ratio'), '.3f')} "
                          f"| {times(row.get('in_loop_verification_cost'))} | {fmt(row.get('in_loop_bound'))} "
                          f"| {fmt(row.get('decode_efficiency_in_loop'))} |" for m, row in loop.items()]
            if block["gamma_sweep"]:
                lines += ["", "Speedup of model-token over our target-only by gamma (greedy sweep): "
                          + ", ".join(f"gamma {g}: {times(s)}" for g, s in block["gamma_sweep"].items())]
            lines.append("")
    return "\n".join(lines)
