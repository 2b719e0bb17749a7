"""The benchmark's statistics, pure functions of its runs: the summary per mode and method, per-prompt and
paired ratios with bootstrap intervals over prompts, the Leviathan bound and block verification's gain."""

import random
import statistics

from specdec.adaptive import expected_speedup, fit_alpha

PAIRED_BASELINES = ("target", "hf_lookup", "model-token")  # issue 18 set its targets against these three


def spread(values: list[float]) -> dict:
    """{"median", "low", "high"} of values: how the paired benchmarks summarise per-prompt ratios."""
    values = sorted(values)
    return {"median": statistics.median(values), "low": values[0], "high": values[-1]}


def ratios(rows: list[dict], top: str, bottom: str) -> dict:
    """`spread` of row[top] / row[bottom] over rows: a ratio taken within each prompt, then summarised."""
    return spread([r[top] / r[bottom] for r in rows])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def leviathan_bound(alpha: float, mean_gamma: float, c: float, verification: float = 1.0) -> float:
    """Expected speedup for acceptance alpha and cost ratio c at a (possibly fractional, adaptive) mean gamma,
    interpolated between the integers around it; `verification` as in `expected_speedup`."""
    alpha = min(alpha, 0.999999)
    low = max(int(mean_gamma), 1)
    frac = max(mean_gamma - low, 0.0)
    return sum(weight * expected_speedup(alpha, g, c, verification)
               for weight, g in ((1 - frac, low), (frac, low + 1)) if weight)


def per_forward_ms(runs: list[dict], role: str) -> float | None:
    """Mean ms of a draft or target forward after the first (the prompt prefill) over these runs (those that
    report their prefill)."""
    runs = [r for r in runs if f"{role}_prefill_seconds" in r and r[f"{role}_forwards"] > 1]
    seconds = sum(r[f"{role}_seconds"] - r[f"{role}_prefill_seconds"] for r in runs)
    forwards = sum(r[f"{role}_forwards"] - 1 for r in runs)
    return 1e3 * seconds / forwards if forwards else None


def runs_by_prompt(by_method: dict, method: str) -> dict:
    """(prompt, repeat) -> that method's run, for runs that generated something in measurable time."""
    return {(r.get("prompt"), r.get("repeat")): r for r in by_method.get(method, [])
            if r["new_tokens"] and r["total_seconds"] > 0}


def per_prompt(rows: dict, by_method: dict, c: float | None) -> None:
    """Medians over prompts (and repeats) of each method's own ratios: speedup over our target-only and over HF
    assisted on the same prompt, and efficiency against the bound for that prompt's alpha and gamma (with the
    run's c). The headline efficiency instead sets a median speedup against the bound for the alpha pooled over
    all prompts, where prompts with low acceptance weigh more (they run more rounds); when acceptance varies from
    prompt to prompt, the two can differ either way."""
    def rate(r):
        return r["new_tokens"] / r["total_seconds"]

    target, hf_assisted, hf_lookup = (runs_by_prompt(by_method, m) for m in ("target", "hf_assisted", "hf_lookup"))
    for method, row in rows.items():
        runs = runs_by_prompt(by_method, method)
        speedups = [rate(r) / rate(target[k]) for k, r in runs.items() if k in target]
        if speedups:
            row["prompt_speedup_vs_target"] = statistics.median(speedups)
            row["prompt_speedups_vs_target"] = sorted(speedups)  # the spread over prompts
        over_hf = [rate(r) / rate(hf_assisted[k]) for k, r in runs.items() if k in hf_assisted]
        if over_hf:
            row["prompt_speedup_vs_hf_assisted"] = statistics.median(over_hf)
        over_lookup = [rate(r) / rate(hf_lookup[k]) for k, r in runs.items() if k in hf_lookup]
        if over_lookup:
            row["prompt_speedup_vs_hf_lookup"] = statistics.median(over_lookup)
        if c is None or row.get("alpha") is None or not row.get("model_drafter"):
            continue
        efficiencies = []
        for k, r in runs.items():
            if k in target and r.get("rounds") and r.get("proposed"):
                mean_gamma = r["proposed"] / r["rounds"]
                alpha = fit_alpha(r["new_tokens"] / r["rounds"], mean_gamma)
                efficiencies.append(rate(r) / rate(target[k]) / leviathan_bound(alpha, mean_gamma, c))
        if efficiencies:
            row["prompt_efficiency"] = statistics.median(efficiencies)


def same_as_target(rows: dict, by_method: dict) -> None:
    """Greedy runs only: on how many prompts each method generated exactly our target-only's tokens (greedy
    speculative decoding must; Hugging Face's methods are shown for comparison). Runs without a digest (older
    results) are left out."""
    reference = {(r.get("prompt"), r.get("repeat")): r["token_digest"] for r in by_method.get("target", [])
                 if r.get("token_digest")}
    for method, row in rows.items():
        pairs = [(r["token_digest"], reference[key]) for r in by_method[method]
                 if r.get("token_digest") and (key := (r.get("prompt"), r.get("repeat"))) in reference]
        if pairs and method != "target":
            row["same_tokens_as_target"] = {"prompts": len(pairs), "same": sum(a == b for a, b in pairs)}


def block_gains(scored: list[dict]) -> tuple[float | None, float]:
    """Block over token verification on the same drafted blocks, pooled over runs (each run's
    `expected_accepted`: summed expected accepted tokens under each rule, and its number of blocks): the gain in
    accepted tokens per round (None where token verification expects none), and in tokens per round (accepted
    + 1)."""
    token, block = sum(e["token"] for e in scored), sum(e["block"] for e in scored)
    blocks = sum(e["blocks"] for e in scored)
    return (block / token - 1 if token > 0 else None), (blocks + block) / (blocks + token) - 1


def bootstrap_interval(by_prompt: list[list], statistic, level: float = 0.9, draws: int = 2000,
                       seed: int = 0) -> list[float]:
    """The `level` interval of statistic(items) over `draws` resamples of the prompts with replacement, each
    prompt with all its items (its runs, or their scored blocks): prompts are the unit, since one prompt's items
    are alike and prompts differ more."""
    rng = random.Random(seed)
    values = sorted(statistic([item for prompt in rng.choices(by_prompt, k=len(by_prompt)) for item in prompt])
                    for _ in range(draws))
    tail = (1 - level) / 2
    return [values[int(tail * (draws - 1))], values[int((1 - tail) * (draws - 1))]]


def block_gain_interval(by_prompt: list[list[dict]], **options) -> list[float]:
    """A bootstrap interval over prompts for the gain in tokens per round (block_gains' second figure). The gain
    of one drawn block varies a lot, and blocks of one prompt are alike; the interval shows how far one run's
    figure can be from another's on other prompts or seeds."""
    return bootstrap_interval(by_prompt, lambda scored: block_gains(scored)[1], **options)


def _pooled(pairs: list[tuple[float, float, float, float]]) -> float:
    """(tokens_a, seconds_a, tokens_b, seconds_b) runs: a's tokens/s over b's, all tokens over all seconds."""
    tokens_a, seconds_a, tokens_b, seconds_b = (sum(column) for column in zip(*pairs))
    return (tokens_a / seconds_a) / (tokens_b / seconds_b)


def paired_speedup(by_prompt: list[list[tuple[float, float, float, float]]],
                   **options) -> tuple[float, list[float]]:
    """Method a against baseline b on the same prompts: the pooled ratio of tokens/s, and its bootstrap interval
    over prompts (each with all its repeats' pairs). A ratio whose interval holds 1.0 (or a target) is not shown
    to beat it by this run."""
    return _pooled([pair for prompt in by_prompt for pair in prompt]), bootstrap_interval(by_prompt, _pooled,
                                                                                           **options)


def _decode_part(run: dict) -> tuple[float, float] | None:
    """A run's tokens and seconds after its first round (the prompt's prefill), where it reports that round."""
    if run.get("first_chunk_seconds") is None or run.get("first_chunk_tokens") is None:
        return None
    tokens, seconds = run["new_tokens"] - run["first_chunk_tokens"], run["total_seconds"] - run["first_chunk_seconds"]
    return (tokens, seconds) if tokens > 0 and seconds > 0 else None


def paired(rows: dict, by_method: dict) -> None:
    """Each method (draft-only aside) against each of PAIRED_BASELINES run on the same prompts and repeats:
    pooled ratio and 90% interval over prompts (paired_speedup), over whole requests and past the first round."""
    for i, baseline in enumerate(PAIRED_BASELINES):
        base = runs_by_prompt(by_method, baseline)
        for method, row in rows.items():
            # draft-only does not sample the target's distribution; an earlier baseline has its own table
            if method in ("draft", *PAIRED_BASELINES[:i + 1]) or not base:
                continue
            whole: dict = {}
            decode: dict = {}
            for key, run in runs_by_prompt(by_method, method).items():
                if key not in base:
                    continue
                other = base[key]
                whole.setdefault(key[0], []).append((run["new_tokens"], run["total_seconds"], other["new_tokens"],
                                                     other["total_seconds"]))
                if (a := _decode_part(run)) and (b := _decode_part(other)):
                    decode.setdefault(key[0], []).append(a + b)
            if not whole:
                continue
            pooled, interval = paired_speedup(list(whole.values()))
            entry = {"prompts": len(whole), "pooled": pooled, "interval": interval}
            # past the first round only where every paired run reports it: the same runs as the whole figure
            if sum(map(len, decode.values())) == sum(map(len, whole.values())):
                entry["decode_pooled"], entry["decode_interval"] = paired_speedup(list(decode.values()))
            row.setdefault("paired", {})[baseline] = entry


def summarise(runs: list[dict], gamma: int) -> dict:
    """Per mode and method: median tokens/s, speedups, acceptance, tokens per target forward, c, bound."""
    summary = {}
    for mode in sorted({r["mode"] for r in runs}):
        rows = {}
        by_method = {}
        for r in runs:
            if r["mode"] == mode and r["sweep_gamma"] is None:
                by_method.setdefault(r["method"], []).append(r)
        seconds_per_token = {m: _median([r["total_seconds"] / r["new_tokens"] for r in rs if r["new_tokens"]])
                             for m, rs in by_method.items()}
        c = (seconds_per_token["draft"] / seconds_per_token["target"]
             if seconds_per_token.get("draft") and seconds_per_token.get("target") else None)
        for method, rs in by_method.items():
            tps = _median([r["new_tokens"] / r["total_seconds"] for r in rs if r["total_seconds"] > 0])
            row = {"runs": len(rs), "tokens_per_second": tps,
                   "new_tokens": sum(r["new_tokens"] for r in rs),
                   # the first round carries the prompt prefill; the rounds after it are the steady state
                   "first_chunk_seconds": _median([r.get("first_chunk_seconds") for r in rs]),
                   "decode_tokens_per_second": _median([r.get("decode_tokens_per_second") for r in rs])}
            proposed = sum(r.get("proposed") or 0 for r in rs)
            if sum(r.get("target_forwards") or 0 for r in rs):
                row["tokens_per_target_forward"] = row["new_tokens"] / sum(r["target_forwards"] for r in rs)
            if proposed:
                rounds = sum(r["rounds"] for r in rs)
                row["acceptance_rate"] = sum(r["accepted"] for r in rs) / proposed
                row["mean_gamma"] = proposed / rounds
                # Leviathan's alpha (per proposal), fitted to tokens per round: accepted/proposed understates it
                row["alpha"] = fit_alpha(row["new_tokens"] / rounds, row["mean_gamma"])
                # the Leviathan bound describes one chain from the draft model: model drafting only
                row["model_drafter"] = all(r.get("drafter") in (None, "model") for r in rs)
                if c is not None and row["model_drafter"]:  # the bound at the measured alpha, c and gamma
                    row["leviathan_bound"] = leviathan_bound(row["alpha"], row["mean_gamma"], c)
                for name in ("rounds_by_drafter", "proposed_by_drafter", "accepted_by_drafter"):
                    totals: dict[str, int] = {}
                    for r in rs:
                        for drafter, n in (r.get(name) or {}).items():
                            totals[drafter] = totals.get(drafter, 0) + n
                    row[name] = totals
                row["round_share_by_drafter"] = {d: n / rounds for d, n in row["rounds_by_drafter"].items()}
                by_prompt: dict = {}  # each prompt's runs' scored blocks
                for r in rs:
                    if r.get("expected_accepted"):
                        by_prompt.setdefault(r.get("prompt"), []).append(r["expected_accepted"])
                scored = [e for prompt in by_prompt.values() for e in prompt]
                if scored and sum(e["token"] for e in scored) > 0:
                    row["block_gain_accepted"], row["block_gain_tokens_per_round"] = block_gains(scored)
                    row["block_gain_tokens_per_round_interval"] = block_gain_interval(list(by_prompt.values()))
            for role in ("draft", "target"):
                ms = per_forward_ms(rs, role)
                if ms is not None:
                    row[f"{role}_ms_per_forward"] = ms
            if "other_seconds" in rs[0]:
                row["outside_forward_share"] = (sum(r["other_seconds"] for r in rs)
                                                / sum(r["total_seconds"] for r in rs))
            rows[method] = row
        base, hf_assisted = rows.get("target", {}).get("tokens_per_second"), rows.get("hf_assisted", {})
        hf_lookup = rows.get("hf_lookup", {})
        hf_own = rows.get("hf_assisted_own_memory", {})
        decode_base = rows.get("target", {}).get("decode_tokens_per_second")
        # what each forward costs inside the speculative loop, against the same model decoding alone: on a CPU
        # whose cache holds one model but not both, alternating draft and target makes each dearer
        target_ms = rows.get("target", {}).get("target_ms_per_forward")
        for row in rows.values():
            if target_ms and row.get("alpha") is not None and row.get("model_drafter") \
                    and row.get("draft_ms_per_forward") and row.get("target_ms_per_forward"):
                row["in_loop_cost_ratio"] = row["draft_ms_per_forward"] / target_ms
                row["in_loop_verification_cost"] = row["target_ms_per_forward"] / target_ms
                row["in_loop_bound"] = leviathan_bound(row["alpha"], row["mean_gamma"], row["in_loop_cost_ratio"],
                                                       row["in_loop_verification_cost"])
        for row in rows.values():
            if base and row["tokens_per_second"]:
                row["speedup_vs_target"] = row["tokens_per_second"] / base
            if decode_base and row["decode_tokens_per_second"]:
                row["decode_speedup_vs_target"] = row["decode_tokens_per_second"] / decode_base
                if row.get("leviathan_bound"):
                    row["decode_efficiency"] = row["decode_speedup_vs_target"] / row["leviathan_bound"]
                if row.get("in_loop_bound"):
                    row["decode_efficiency_in_loop"] = row["decode_speedup_vs_target"] / row["in_loop_bound"]
            if hf_assisted.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_assisted"] = row["tokens_per_second"] / hf_assisted["tokens_per_second"]
            if hf_lookup.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_lookup"] = row["tokens_per_second"] / hf_lookup["tokens_per_second"]
            if hf_own.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_assisted_own_memory"] = row["tokens_per_second"] / hf_own["tokens_per_second"]
            if row.get("leviathan_bound") and row.get("speedup_vs_target"):
                row["efficiency"] = row["speedup_vs_target"] / row["leviathan_bound"]
        per_prompt(rows, by_method, c)
        paired(rows, by_method)
        if mode == "greedy":
            same_as_target(rows, by_method)
        sweep = {}
        for r in runs:
            if r["mode"] == mode and r["sweep_gamma"] is not None:
                sweep.setdefault(r["sweep_gamma"], []).append(r["new_tokens"] / r["total_seconds"])
        summary[mode] = {"cost_ratio_c": c, "gamma": gamma, "methods": rows,
                         "gamma_sweep": {g: (_median(v) / base if base else None) for g, v in sorted(sweep.items())}}
    return summary
