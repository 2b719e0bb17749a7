"""bench/ (the benchmark, its statistics, report and plot) and bench/gpu.py run end to end on tiny models."""

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import benchmark, gpu
from bench.forwards import forward_ms_by_width, verification_cost
from bench.methods import (
    HF_METHODS,
    MODES,
    OUR_METHODS,
    SPECULATIVE,
    measured_models,
    our_method,
    ours_draft,
    run_hf,
    run_ours,
    stock_layers,
    token_digest,
)
from bench.prompts import DEFAULT_PROMPTS, GROUNDED_PROMPTS, load_prompts
from bench.report import markdown
from bench.summary import block_gain_interval, block_gains, leviathan_bound, paired_speedup, summarise
from specdec.adaptive import expected_speedup, fit_alpha
from specdec.cpu.grouped import grouped_kernel
from specdec.cpu.linear import packing_supported, quantization_supported, quantize_linears
from specdec.engine import SpeculativeDecoder
from tests.support.models import make_model, perturbed_copy
from tests.support.spies import rounds_of

ROOT = Path(__file__).resolve().parent.parent


def test_prompt_set_is_committed_and_varied():
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 20
    assert {p["category"] for p in prompts} == {"code_completion", "code_instruction", "chat", "summarize"}


def test_grounded_prompt_set_is_committed_and_mixed():
    prompts = load_prompts(GROUNDED_PROMPTS)
    assert len(prompts) >= 16 and len({p["id"] for p in prompts}) == len(prompts)
    assert len({p["category"] for p in prompts}) >= 4


def test_method_names_map_to_drafter_rule_and_variant():
    assert our_method("hybrid-block", 4) == {"method": "google", "drafter": "hybrid", "verification": "block",
                                             "gamma": 4}
    assert our_method("lookup-token-adaptive-deepmind", 4)["gamma"] is None
    assert our_method("google", 4) == our_method("model-token", 4)
    assert our_method("target", 4) == {"method": "target"}
    assert our_method("hybrid-token-c0.6", 4)["draft_confidence_threshold"] == 0.6
    assert our_method("model-block-adaptive-c0", 4) == {
        "method": "google", "drafter": "model", "verification": "block", "gamma": None,
        "draft_confidence_threshold": 0.0}
    assert our_method("model-token-g8-c0.6", 4)["gamma"] == 8
    assert our_method("model-token-g8-c0.6", 4)["draft_confidence_threshold"] == 0.6
    assert our_method("hybrid-token-k8-h3-x", 4)["lookup"] == {"max_tokens": 8, "hybrid_min_match": 3,
                                                              "extend": True}
    assert our_method("lookup-block-k10", 4)["lookup"] == {"max_tokens": 10}
    assert "lookup" not in our_method("hybrid-token-g8", 4)
    for bad in ("ngram-token", "model-token-c", "model-token-c1.5", "model-token-cx", "model-token-c0.2-c0.3",
                "model-token-fast", "model-token-g8-g6", "model-token-g", "model-token-adaptive-g8",
                "model-token-k8", "lookup-token-h3", "lookup-token-x", "hybrid-token-x-x", "hybrid-token-k0",
                "hybrid-token-h9", "hybrid-token-k8-k6", "model-token-g0"):
        with pytest.raises(ValueError):
            our_method(bad, 4)


def test_a_methods_lookup_suffixes_apply_to_its_run_alone():
    from specdec.drafters import LookupSettings

    seen = []

    class Decoder:  # records the lookup settings each generate call ran with
        lookup, round_observer = LookupSettings(max_ngram=6), None

        def generate(self, ids, **keywords):
            seen.append((self.lookup, keywords))
            if keywords["drafter"] == "lookup":
                raise RuntimeError("a failed run")
            return types.SimpleNamespace(token_ids=[1], stats=types.SimpleNamespace(as_dict=lambda: {}))

    decoder = Decoder()
    run_ours("hybrid-token-k8-h3-x", decoder, [1, 2], 4, MODES["greedy"], 0, 4)
    with pytest.raises(RuntimeError):
        run_ours("lookup-token-k5", decoder, [1, 2], 4, MODES["greedy"], 0, 4)
    run_ours("hybrid-token", decoder, [1, 2], 4, MODES["greedy"], 0, 4)
    # over the decoder's own settings (its max_ngram stays), and undone after each run, failed or not
    assert seen[0][0] == LookupSettings(max_ngram=6, max_tokens=8, hybrid_min_match=3, extend=True)
    assert seen[1][0] == LookupSettings(max_ngram=6, max_tokens=5)
    assert seen[2][0] == decoder.lookup == LookupSettings(max_ngram=6)
    assert all("lookup" not in keywords for _, keywords in seen)


def test_lookup_settings_are_read_by_name_and_checked():
    from specdec.drafters import LookupSettings

    settings = benchmark.lookup_settings("hybrid_min_match=3, extend=true,max_tokens=10")
    assert (settings.hybrid_min_match, settings.extend, settings.max_tokens) == (3, True, 10)
    assert settings.max_ngram == LookupSettings().max_ngram  # unnamed: the default
    assert benchmark.lookup_settings("") == LookupSettings()
    for bad in ("gamma=3", "max_tokens", "max_tokens=many", "extend=maybe", "max_tokens=0", "min_match=9"):
        with pytest.raises(argparse.ArgumentTypeError):
            benchmark.lookup_settings(bad)


def test_modes_are_checked_before_anything_loads(capsys):
    assert benchmark.mode_list("greedy,t0.7") == ["greedy", "t0.7"]
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["--modes", "greedy,hot", "--no-startup"])
    assert exit_.value.code == 2 and "unknown mode hot" in capsys.readouterr().err


def test_benchmark_end_to_end_on_tiny_pair(tiny_pair_dirs, tmp_path):
    draft, target = tiny_pair_dirs
    grounded = tmp_path / "grounded.jsonl"  # short enough for the tiny models' 256 positions, and repetitive
    grounded.write_text("".join(json.dumps({"id": f"g{i}", "category": "extend", "prompt": text, "chat": False}) + "\n"
                                for i, text in enumerate(["ab ab ab ab ab ab ab", "x = 1\nx = 1\nx = 1\n",
                                                          "def f(): return f()\ndef f(): return f()\n"])))
    out = tmp_path / "results"
    methods = OUR_METHODS + HF_METHODS + ("google", "hf_assisted_own_memory")
    assert benchmark.main(["--draft", draft, "--target", target, "--limit", "3", "--max-new-tokens", "6",
                           "--prompt-sets", f"default,grounded={grounded}", "--methods", ",".join(methods),
                           "--sweep-gammas", "1,3", "--sweep-prompts", "2", "--lookup", "hybrid_min_match=2",
                           "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["lookup"]["hybrid_min_match"] == 2 and "hybrid_min_match 2" in (out / "results.md").read_text()
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert "| hybrid-block |" in table and "| hf_lookup |" in table and report["machine"]["torch"]
    assert report["machine"]["scikit_learn"] and "scikit_learn" in table  # it changes HF assisted generation
    assert "## grounded prompts, sampling" in table and "## default prompts, greedy" in table
    assert "| hf_assisted_own_memory |" in table and "vs HF assisted, own memory" in table
    startup = report["startup"]  # measured in a process of its own
    assert 0 < startup["load_pair_seconds"] <= startup["ready_seconds"]
    assert 0 < startup["weights_bytes"] < startup["steady_rss"] <= startup["peak_rss"]
    assert any(row["step"].startswith("start-up: read the target's weights") for row in startup["steps"])
    assert "Start-up (a fresh process, `python -m bench.startup" in table and "x the " in table
    assert report["prompts"] == {"default": 3, "grounded": 3}
    for set_name in ("default", "grounded"):
        for mode in ("greedy", "sampling"):
            block = report["summary"][set_name][mode]
            assert set(block["methods"]) == set(methods)
            rows = block["methods"]
            assert rows["target"]["speedup_vs_target"] == 1.0 and rows["target"]["tokens_per_target_forward"] == 1.0
            google = rows["google"]
            assert 0 <= google["acceptance_rate"] <= 1
            assert google["leviathan_bound"] > 0 and google["efficiency"] > 0 and google["prompt_efficiency"] > 0
            assert block["cost_ratio_c"] > 0
            assert google["first_chunk_seconds"] > 0 and google["decode_efficiency"] > 0
            assert rows["hf_assisted"]["decode_tokens_per_second"] is None  # generate gives no rounds
            assert rows["hf_lookup"]["tokens_per_second"] > 0 and google["speedup_vs_hf_lookup"] > 0
            assert rows["hf_assisted_own_memory"]["tokens_per_second"] > 0
            for method in SPECULATIVE:
                row = rows[method]
                # one target forward per round, and the prompt's prefill on its own when the first round proposed
                assert row["speedup_vs_target"] > 0 and row["tokens_per_target_forward"] > 0
                assert sum(row["round_share_by_drafter"].values()) == pytest.approx(1.0)
                assert len(row["prompt_speedups_vs_target"]) == 3  # the spread over prompts, for the plot
                assert ("leviathan_bound" in row) == method.startswith("model")  # one chain from the draft model
            assert set(rows["lookup-token"]["round_share_by_drafter"]) <= {"lookup", "none"}
            # the same proposals scored under both rules: block never expects fewer accepted tokens
            assert rows["model-token"]["block_gain_accepted"] >= -1e-9
        grounded_rows = report["summary"]["grounded"]["greedy"]["methods"]
        assert grounded_rows["lookup-token"]["round_share_by_drafter"].get("lookup", 0) > 0
    assert "decode efficiency" in table and "Per prompt" in table and "Block verification on the same" in table
    # greedy speculative output is target-only's, prompt by prompt, whatever the drafter and rule
    for set_name in ("default", "grounded"):
        rows = report["summary"][set_name]["greedy"]["methods"]
        for method in SPECULATIVE:
            assert rows[method]["same_tokens_as_target"] == {"prompts": 3, "same": 3}, (set_name, method)
        assert "same_tokens_as_target" not in report["summary"][set_name]["sampling"]["methods"]["google"]
    assert "| model-token | 3/3 |" in table
    assert set(report["summary"]["default"]["greedy"]["gamma_sweep"]) == {"1", "3"}  # JSON object keys
    assert report["draft_quantization"] == "int8" and "quantization int8" in table
    assert report["dtype"] == "float32" and "`, float32;" in table
    # prompt-major order: every method, HF's included, runs on a prompt before the next one (drift hits all
    # methods alike)
    greedy = [(r["set"], r["prompt"], r["method"]) for r in report["runs"]
              if r["mode"] == "greedy" and r["sweep_gamma"] is None]
    for start in range(0, len(greedy), len(methods)):
        assert [m for *_, m in greedy[start:start + len(methods)]] == list(methods)
        assert len({(s, p) for s, p, _ in greedy[start:start + len(methods)]}) == 1
    # where the time goes: per-forward costs without the prefill, in the loop and alone
    rows = report["summary"]["default"]["greedy"]["methods"]
    assert rows["google"]["draft_ms_per_forward"] > 0 and rows["target"]["target_ms_per_forward"] > 0
    assert rows["google"]["in_loop_bound"] > 0 and rows["google"]["decode_efficiency_in_loop"] > 0
    assert "in-loop bound" in table
    for run in report["runs"]:
        if run["method"] in SPECULATIVE:
            assert run["rounds"] <= run["target_forwards"] <= run["rounds"] + 1
    # generated tokens only: never more than max_new_tokens per run
    assert all(0 < run["new_tokens"] <= 6 for run in report["runs"])
    # the report rebuilds from its runs
    again = tmp_path / "again"
    assert benchmark.main(["--from-runs", str(out / "results.json"), "--out", str(again)]) == 0
    rebuilt = json.loads((again / "results.json").read_text())
    # with the runs' own settings, not this command's defaults (64 new tokens, gamma 4)
    assert (rebuilt["max_new_tokens"], rebuilt["gamma"]) == (6, 4) and rebuilt["summary"] == report["summary"]
    # without our target-only there is no speedup to plot: no empty panels, and no earlier plot left in place
    alone = dict(report, runs=[r for r in report["runs"] if r["method"] == "model-token"])
    (tmp_path / "alone.json").write_text(json.dumps(alone))
    (again / "results.png").write_bytes(b"stale")
    assert benchmark.main(["--from-runs", str(tmp_path / "alone.json"), "--out", str(again)]) == 0
    assert not (again / "results.png").exists()
    assert "Block verification on the same" in (again / "results.md").read_text()


def test_benchmark_of_our_methods_alone_loads_the_pair_once_as_the_service_does(tiny_pair_dirs, tmp_path,
                                                                                 monkeypatch):
    draft, target = tiny_pair_dirs
    loads, load_pair = [], benchmark.load_pair

    def recording_load_pair(*args, **kwargs):
        loads.append(kwargs)
        return load_pair(*args, **kwargs)

    monkeypatch.setattr(benchmark, "load_pair", recording_load_pair)
    out = tmp_path / "results"
    assert benchmark.main(["--draft", draft, "--target", target, "--limit", "2", "--max-new-tokens", "4",
                           "--prompt-sets", "default", "--modes", "greedy", "--methods", "target,model-token",
                           "--no-startup", "--out", str(out)]) == 0
    # no stock pair held beside ours: one load, with the CPU kernels and the draft as the service has it (auto)
    assert len(loads) == 1 and loads[0].get("cpu_kernels", True) and loads[0]["draft_quantization"] == "auto"
    report = json.loads((out / "results.json").read_text())
    assert report["draft_quantization"] == "int8"  # what "auto" gave this float draft, read off the model
    # the verification cost by width, both with the library's layers and with ours, on the one target
    assert set(report["verification_cost"]) == {"stock", "ours"}
    rows = report["summary"]["default"]["greedy"]["methods"]
    assert rows["model-token"]["same_tokens_as_target"] == {"prompts": 2, "same": 2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linear_micro_benchmark_runs_on_small_shapes(dtype):
    done = subprocess.run([sys.executable, "-m", "bench.linear", "--rows", "1,5", "--repeats", "1",
                           "--shapes", "64x48,40x80", "--stack-mb", "0.1", "--dtype", dtype], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 64 x 48") or line.startswith("| 40 x 80")]
    assert len(lines) == 4 and "F.linear" in done.stdout and dtype in done.stdout
    assert ("oneDNN packed" in done.stdout) == (dtype == "float32" and packing_supported())
    header = next(line for line in done.stdout.splitlines() if line.startswith("| weight"))
    kernels = header.strip("| ").split(" | ")[3:]
    assert kernels[0] == "F.linear"
    for line in lines:  # one time per kernel, each a number
        assert [float(cell) >= 0 for cell in line.strip("| ").split(" | ")[3:]] == [True] * len(kernels)


def test_forward_costs_take_turns_by_width():
    from tests.support.models import make_model

    model = make_model("qwen2", hidden=64)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    ms = forward_ms_by_width(model, 16, [1, 3, 5], "cpu", repeats=3)
    assert set(ms) == {1, 3, 5} and all(v > 0 for v in ms.values())
    assert seen == [16] + [1, 3, 5] * 5  # the prefill, then 2 warm-up rounds and 3 measured, widths in turn
    assert verification_cost(model, 2, context=8, repeats=1)["relative"][1] == 1.0


def test_forward_costs_take_a_model_whose_embedding_is_a_grouped_buffer():
    """The default pair's shipped weights hold the token embedding as GGUF groups in buffers (no `.weight`): the
    benchmark's forward costs (what `make bench` measures first) found its device through `.weight` and failed."""
    from specdec.cpu.grouped import GroupedEmbedding, quantize
    from tests.support.models import make_model

    model = make_model("qwen2", hidden=64)
    model.model.embed_tokens = GroupedEmbedding(quantize(model.model.embed_tokens.weight.detach(), 8))
    assert not hasattr(model.get_input_embeddings(), "weight")
    assert verification_cost(model, 2, context=8, repeats=1)["relative"][1] == 1.0


def test_stock_layers_lends_our_target_to_hugging_face_and_gives_it_back():
    from torch import nn

    from specdec.cpu.attention import GQA_ATTENTION
    from specdec.cpu.linear import FewRowsLinear, PackedLinear
    from specdec.models.kernels import use_cpu_kernels
    from tests.support.models import make_model

    model = make_model("qwen2", hidden=64)
    assert use_cpu_kernels(model)
    ours = {type(m) for m in model.modules()} & {FewRowsLinear, PackedLinear}
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    with stock_layers(model) as stock:
        assert stock is model and model.config._attn_implementation == "sdpa"
        assert not {type(m) for m in model.modules()} & {FewRowsLinear, PackedLinear}
        assert isinstance(model.lm_head, nn.Linear)
        if FewRowsLinear in ours:  # the same weights, not copies
            assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights
    assert model.config._attn_implementation == GQA_ATTENTION
    assert {type(m) for m in model.modules()} & {FewRowsLinear, PackedLinear} == ours


def test_summary_bound_uses_measured_acceptance_and_cost():
    runs = [{"mode": "greedy", "method": "target", "sweep_gamma": None, "new_tokens": 10, "total_seconds": 1.0},
            {"mode": "greedy", "method": "draft", "sweep_gamma": None, "new_tokens": 10, "total_seconds": 0.25},
            {"mode": "greedy", "method": "google", "sweep_gamma": None, "new_tokens": 8, "total_seconds": 0.5,
             "proposed": 8, "accepted": 6, "rounds": 2, "target_forwards": 2, "other_seconds": 0.01}]
    row = summarise(runs, gamma=4)["greedy"]
    assert row["cost_ratio_c"] == 0.25
    google = row["methods"]["google"]
    assert google["speedup_vs_target"] == 1.6
    assert google["acceptance_rate"] == 0.75
    alpha = fit_alpha(4.0, 4)  # 8 tokens in 2 rounds of 4 proposals
    assert google["alpha"] == alpha > 0.75
    assert google["leviathan_bound"] == pytest.approx(expected_speedup(alpha, 4, 0.25))
    assert google["efficiency"] == pytest.approx(1.6 / expected_speedup(alpha, 4, 0.25))
    assert "decode_efficiency" not in google  # no steady-state figures in these runs


def test_summary_per_prompt_ratios_pair_each_prompt_with_its_own_baselines():
    def run(method, prompt, tokens, seconds, **extra):
        return {"mode": "greedy", "method": method, "sweep_gamma": None, "prompt": prompt, "repeat": 0,
                "new_tokens": tokens, "total_seconds": seconds, **extra}

    runs = [run("target", "a", 10, 1.0), run("draft", "a", 10, 0.2), run("hf_assisted", "a", 10, 2.0),
            run("google", "a", 20, 1.0, proposed=16, accepted=16, rounds=4, target_forwards=4),  # all accepted
            run("target", "b", 10, 2.0), run("draft", "b", 10, 0.4), run("hf_assisted", "b", 10, 1.0),
            run("google", "b", 10, 2.5, proposed=20, accepted=5, rounds=5, target_forwards=5)]  # 2 per round
    google = summarise(runs, gamma=4)["greedy"]["methods"]["google"]
    assert google["prompt_speedup_vs_target"] == pytest.approx((2.0 + 0.8) / 2)  # 20 vs 10 tok/s, 4 vs 5
    assert google["prompt_speedup_vs_hf_assisted"] == pytest.approx((4.0 + 0.4) / 2)
    c = 0.2  # draft 0.02 s/token against target 0.1 on a, 0.04 against 0.2 on b
    expected = [2.0 / leviathan_bound(fit_alpha(5.0, 4), 4, c), 0.8 / leviathan_bound(fit_alpha(2.0, 4), 4, c)]
    assert google["prompt_efficiency"] == pytest.approx(sum(expected) / 2)
    assert "prompt_efficiency" not in summarise(runs, gamma=4)["greedy"]["methods"]["target"]


def test_block_gain_interval_resamples_prompts_as_units():
    def scored(token, block, blocks=10):
        return {"token": token, "block": block, "blocks": blocks}

    # tokens per round: (10 + 22) / (10 + 20) on one prompt, 30 / 30 on the other
    assert block_gains([scored(20.0, 22.0), scored(20.0, 20.0)]) == pytest.approx((0.05, 2 / 60))
    same = [[scored(20.0, 22.0)], [scored(10.0, 11.0, 5), scored(10.0, 11.0, 5)]]  # +1/15 on each prompt
    assert block_gain_interval(same) == pytest.approx([1 / 15, 1 / 15])
    # one prompt gains, one loses: the interval spans both prompts' own gains, and the pooled figure lies inside
    mixed = [[scored(20.0, 24.0)], [scored(20.0, 18.0)]] * 4
    low, high = block_gain_interval(mixed)
    pooled = block_gains([e for prompt in mixed for e in prompt])[1]
    assert -2 / 30 <= low < pooled < high <= 4 / 30
    # the runs of one prompt stay together: two runs that cancel on every prompt give no spread at all
    paired = [[scored(20.0, 24.0), scored(20.0, 16.0)]] * 8
    assert block_gain_interval(paired) == pytest.approx([0.0, 0.0])


def test_paired_speedup_pools_requests_and_resamples_prompts_as_units():
    # (tokens_a, seconds_a, tokens_b, seconds_b): a twice b's rate on every prompt, so every resample says 2x
    same = [[(64, 4.0, 64, 8.0)], [(32, 1.0, 32, 2.0), (64, 2.0, 64, 4.0)]]
    pooled, interval = paired_speedup(same)
    assert pooled == pytest.approx(2.0) and interval == pytest.approx([2.0, 2.0])
    # pooled is all tokens over all seconds, not a mean of ratios: 128 tokens in 5 s against 128 in 10 s
    assert paired_speedup([[(64, 1.0, 64, 8.0)], [(64, 4.0, 64, 2.0)]])[0] == pytest.approx(2.0)
    # one prompt at 3x, one at 0.5x: the interval spans both, the pooled figure inside it
    mixed = [[(60, 2.0, 60, 6.0)], [(60, 6.0, 60, 3.0)]] * 4
    pooled, (low, high) = paired_speedup(mixed)
    assert 0.5 <= low < pooled < high <= 3.0
    # the repeats of one prompt stay together: a fast and a slow repeat that cancel give no spread at all
    paired = [[(60, 1.0, 60, 2.0), (60, 4.0, 60, 2.0)]] * 8
    pooled, interval = paired_speedup(paired)
    assert pooled == pytest.approx(0.8) and interval == pytest.approx([0.8, 0.8])


def test_summary_pairs_each_method_with_target_only_and_model_drafting_on_the_same_prompts():
    def run(method, prompt, seconds, first=None, **extra):
        chunk = {} if first is None else {"first_chunk_seconds": first, "first_chunk_tokens": 1}
        return {"mode": "greedy", "method": method, "sweep_gamma": None, "prompt": prompt, "repeat": 0,
                "new_tokens": 11, "total_seconds": seconds, **chunk, **extra}

    runs = [run("target", "a", 6.0, first=1.0), run("model-token", "a", 3.0, first=1.0),
            run("hybrid-token", "a", 2.0, first=1.0), run("draft", "a", 1.0),
            run("target", "b", 12.0, first=2.0), run("model-token", "b", 6.0, first=2.0),
            run("hybrid-token", "b", 6.0, first=2.0),
            run("hybrid-token", "c", 1.0, first=0.5)]  # no baseline ran on c: left out of every pair
    methods = summarise(runs, gamma=4)["greedy"]["methods"]
    hybrid = methods["hybrid-token"]["paired"]
    assert hybrid["target"]["prompts"] == hybrid["model-token"]["prompts"] == 2
    assert hybrid["target"]["pooled"] == pytest.approx((22 / 8) / (22 / 18))
    assert hybrid["model-token"]["pooled"] == pytest.approx((22 / 8) / (22 / 9))
    # past the first round: 10 tokens in 1 + 4 s against model drafting's 2 + 4
    assert hybrid["model-token"]["decode_pooled"] == pytest.approx(6 / 5)
    assert methods["model-token"]["paired"].keys() == {"target"}  # not with itself; HF prompt lookup did not run
    assert "paired" not in methods["draft"] and "paired" not in methods["target"]
    report = {"date": "d", "command": "c", "machine": {}, "draft": "d", "target": "t", "prompts": {"default": 3},
              "max_new_tokens": 11, "repeats": 1, "gamma": 4, "summary": {"default": summarise(runs, 4)}}
    text = markdown(report)
    assert "Paired with model-token" in text and f"| hybrid-token | 2 | {hybrid['model-token']['pooled']:.2f}x" in text
    # a second repeat of prompt a without its first round: no figure past the first round on fewer runs
    runs += [{**r, "repeat": 1, "first_chunk_seconds": None} if r["method"] == "hybrid-token" else {**r, "repeat": 1}
             for r in runs if r["prompt"] == "a"]
    again = summarise(runs, gamma=4)["greedy"]["methods"]["hybrid-token"]["paired"]["model-token"]
    assert again["prompts"] == 2 and "pooled" in again and "decode_pooled" not in again


def test_summary_steady_state_leaves_out_the_first_round():
    runs = [{"mode": "greedy", "method": "target", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 2.0,
             "first_chunk_seconds": 1.0, "first_chunk_tokens": 1, "decode_tokens_per_second": 10.0},
            {"mode": "greedy", "method": "draft", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 0.5},
            {"mode": "greedy", "method": "google", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 1.5,
             "proposed": 8, "accepted": 6, "rounds": 3, "target_forwards": 3, "other_seconds": 0.01,
             "first_chunk_seconds": 1.1, "first_chunk_tokens": 3, "decode_tokens_per_second": 20.0}]
    google = summarise(runs, gamma=4)["greedy"]["methods"]["google"]
    assert google["speedup_vs_target"] == pytest.approx(2.0 / 1.5)
    assert google["decode_speedup_vs_target"] == 2.0
    assert google["decode_efficiency"] == pytest.approx(2.0 / google["leviathan_bound"])
    assert google["first_chunk_seconds"] == 1.1


def test_in_loop_costs_leave_out_the_prefill_and_feed_a_bound():
    runs = [{"mode": "greedy", "method": "target", "sweep_gamma": None, "new_tokens": 5, "total_seconds": 1.3,
             "target_forwards": 5, "target_seconds": 1.3, "target_prefill_seconds": 0.5,
             "draft_forwards": 0, "draft_seconds": 0.0, "draft_prefill_seconds": 0.0},
            {"mode": "greedy", "method": "draft", "sweep_gamma": None, "new_tokens": 5, "total_seconds": 0.3,
             "draft_forwards": 5, "draft_seconds": 0.3, "draft_prefill_seconds": 0.1,
             "target_forwards": 0, "target_seconds": 0.0, "target_prefill_seconds": 0.0},
            {"mode": "greedy", "method": "google", "sweep_gamma": None, "new_tokens": 8, "total_seconds": 1.2,
             "proposed": 8, "accepted": 6, "rounds": 2, "other_seconds": 0.01,
             "target_forwards": 3, "target_seconds": 1.1, "target_prefill_seconds": 0.5,
             "draft_forwards": 9, "draft_seconds": 0.5, "draft_prefill_seconds": 0.1}]
    rows = summarise(runs, gamma=4)["greedy"]["methods"]
    assert rows["target"]["target_ms_per_forward"] == pytest.approx(200.0)  # (1.3 - 0.5) s / 4 forwards
    assert rows["draft"]["draft_ms_per_forward"] == pytest.approx(50.0)
    google = rows["google"]
    assert google["draft_ms_per_forward"] == pytest.approx(50.0)  # (0.5 - 0.1) s / 8
    assert google["target_ms_per_forward"] == pytest.approx(300.0)  # (1.1 - 0.5) s / 2
    assert google["in_loop_cost_ratio"] == pytest.approx(0.25)
    assert google["in_loop_verification_cost"] == pytest.approx(1.5)
    alpha = google["alpha"]
    assert google["in_loop_bound"] == pytest.approx(leviathan_bound(alpha, 4, 0.25, 1.5))
    assert google["in_loop_bound"] < google["leviathan_bound"]  # a dearer verification lowers the bound
    assert "in_loop_bound" not in rows["target"]


def test_bound_interpolates_between_integer_gammas():
    alpha, c = 0.8, 0.2
    assert leviathan_bound(alpha, 3, c) == pytest.approx(expected_speedup(alpha, 3, c))
    middle = leviathan_bound(alpha, 3.5, c)
    assert middle == pytest.approx((expected_speedup(alpha, 3, c) + expected_speedup(alpha, 4, c)) / 2)
    assert leviathan_bound(alpha, 3, c, verification=1.2) < leviathan_bound(alpha, 3, c)


def test_gpu_script_smoke_on_cpu(tmp_path):
    """The documented smoke run (the default context, longer than the tiny pair's: its int4 stage failed there,
    found by the third audit, and the run still exited 0; a failed stage now exits 1)."""
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--tiny", "--device", "cpu", "--budget", "900",
                           "--repeats", "1", "--tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert report["skipped"] == [] and list(stages) == list(gpu.STAGES)
    assert not [name for name, row in stages.items() if "error" in row], stages
    assert set(stages["forwards"]["ms_by_width"]["target"]) == {str(n) for n in gpu.WIDTHS}
    for model in ("draft", "target"):  # the compiled path's forwards, after a compile that took time
        assert stages["compiled-forwards"][model]["compile_seconds"] > 0
        assert all(ms > 0 for ms in stages["compiled-forwards"][model]["ms_by_width"].values())
    assert stages["compiled"]["compiled"] == [True, True]
    assert stages["compiled"]["called_directly"] == [True, True]  # on CPU
    turn = stages["compiled"]["next_turn"]  # the compiled path's prompt cache: the static caches, then a copy
    assert turn["held"]["cached_tokens"] == turn["copy"]["cached_tokens"] > 0 == turn["none"]["cached_tokens"]
    for path in ("eager", "compiled"):
        assert stages[path]["google"]["tokens_per_second"] > 0
        for key in ("target/json", "target/sse", "google/json", "google/sse"):
            assert stages[f"{path}-service"][key]["tokens_per_second"] > 0
        assert stages[f"{path}-service"]["target/floor"]["ms_outside_work"] > 0  # bench/floor.py beside it
    assert all(stages["hf"][name]["tokens_per_second"] > 0
               for name in ("hf_generate", "hf_assisted", "hf_assisted_fixed_threshold"))
    assert all(rate > 0 for path in ("eager", "compiled") for rate in stages["random-7b"][path].values())
    assert report["projection"]["google_tokens_per_second"] > 0
    int4 = stages["int4"]["target-7b"]  # the tiny shape's layers, on the int4 kernel's CPU twin
    assert int4["layers"] > 0 and int4["rows_keep_their_bits"] and int4["greedy_google_equals_target"]
    assert all(ms > 0 for ms in int4["int4_ms_by_width"].values())


def test_gpu_script_exits_1_when_a_stage_fails_and_refuses_bad_flags(tmp_path, monkeypatch, capsys):
    def broken(run):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu.STAGES, "hf", (broken, 0))
    assert gpu.main(["--tiny", "--device", "cpu", "--stages", "hf", "--out", str(tmp_path / "gpu.json")]) == 1
    assert "failed: ['hf']" in capsys.readouterr().out
    for flags, words in ((["--stages", "forwards,bogus"], "--stages: unknown bogus"),
                         (["--repeats", "0"], "--repeats must be at least 1")):
        with pytest.raises(SystemExit) as raised:
            gpu.main(["--tiny", "--device", "cpu", *flags])
        assert raised.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [(["--paths", "foo"], "--paths: unknown foo"),
                                          (["--repeats", "0"], "--repeats must be at least 1"),
                                          (["--tokens", "0"], "--tokens must be at least 1")])
def test_overhead_benchmark_refuses_bad_flags_before_loading(flags, words, capsys):
    from bench import overhead

    with pytest.raises(SystemExit) as raised:
        overhead.main(flags)
    assert raised.value.code == 2 and words in capsys.readouterr().err


def test_gpu_script_builds_a_random_pair_from_shapes(tmp_path, tiny_pair_dirs):
    """--shapes: a pair with the given configs and tokenizer and random weights (what a lent GPU measures when
    the default pair's weights cannot travel); a stage past the budget is skipped, not started."""
    shapes = tmp_path / "shapes"
    for name, folder in zip(("draft", "target"), tiny_pair_dirs):
        (shapes / name).mkdir(parents=True)
        for file in Path(folder).iterdir():
            if not file.name.endswith(".safetensors"):
                (shapes / name / file.name).write_bytes(file.read_bytes())
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--shapes", str(shapes), "--device", "cpu",
                           "--stages", "forwards,eager,compiled-service", "--budget", "100", "--context", "16",
                           "--repeats", "1", "--tokens", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["pair"].endswith("random weights") and report["skipped"] == ["compiled-service"]
    assert report["stages"]["eager"]["target"]["tokens_per_second"] > 0


def test_interference_script_smoke_on_tiny_pair(tiny_pair_dirs, tmp_path):
    draft, target = tiny_pair_dirs
    out = tmp_path / "interference.json"
    done = subprocess.run([sys.executable, "-m", "bench.interference", "--draft", draft,
                           "--target", target, "--cached", "8", "--repeats", "2", "--pause", "0.01",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"draft_back_to_back", "draft_after_target", "draft_after_pause",
                                 "target_1_token", "target_5_tokens"}
    assert all(ms > 0 for ms in report["ms"].values()) and "draft_after_target" in done.stdout


def test_logprobs_benchmark_smoke_on_tiny_pair(tiny_pair_dirs, tmp_path):
    draft, target = tiny_pair_dirs
    out = tmp_path / "logprobs.json"
    done = subprocess.run([sys.executable, "-m", "bench.logprobs", "--draft", draft, "--target", target,
                           "--limit", "2", "--max-new-tokens", "6", "--top", "0,5", "--repeats", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["in_the_loop"]) == {"none", "0", "5"} and set(report["work_alone"]) == {"0", "5"}
    assert report["in_the_loop"]["5"]["tokens"] == report["in_the_loop"]["none"]["tokens"] > 0
    assert report["echo"]["extra_ms_per_prompt_token"] is not None and report["prompts"] == 2


def test_summary_counts_greedy_runs_with_target_only_tokens():
    def run(method, prompt, digest, mode="greedy"):
        return {"mode": mode, "method": method, "sweep_gamma": None, "prompt": prompt, "repeat": 0,
                "new_tokens": 4, "total_seconds": 1.0, "token_digest": digest}

    runs = [run("target", "a", "x"), run("target", "b", "y"), run("google", "a", "x"), run("google", "b", "z"),
            run("hf_assisted", "a", "x"), run("hf_assisted", "b", "y"), run("old", "a", None),
            run("target", "a", "x", "sampling"), run("google", "a", "w", "sampling")]
    summary = summarise(runs, gamma=4)
    rows = summary["greedy"]["methods"]
    assert rows["google"]["same_tokens_as_target"] == {"prompts": 2, "same": 1}
    assert rows["hf_assisted"]["same_tokens_as_target"] == {"prompts": 2, "same": 2}
    assert "same_tokens_as_target" not in rows["target"] and "same_tokens_as_target" not in rows["old"]
    assert "same_tokens_as_target" not in summary["sampling"]["methods"]["google"]  # sampled tokens may differ
    assert token_digest([1, 2]) != token_digest([1, 2, 3]) == token_digest([1, 2, 3])


def test_attention_benchmark_compares_both_ways_on_tiny_pair(tiny_pair_dirs, capsys):
    from bench import attention as bench_attention
    from specdec.cpu import attention

    recognise = attention.is_causal_mask
    draft, target = tiny_pair_dirs
    assert bench_attention.main(["--draft", draft, "--target", target, "--context", "20", "--widths", "1,3",
                                 "--repeats", "1"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(table) == 2 and all(float(line.split("|")[4]) > 0 for line in table)
    assert attention.is_causal_mask is recognise  # the comparison's switch is undone


def test_drafting_replay_ends_a_run_where_the_draft_is_unsure():
    """bench.drafting's replay of the confidence stop: the draft is right everywhere here but unsure of the token
    after [1, 2, 3], so at threshold 0.5 the first round proposes 3, 4 and stops (width 3), where gamma 4 alone
    would propose 3, 4, 5, 6."""
    from bench import drafting
    from specdec.drafters import LookupSettings

    text = [1, 2, 3, 4, 5, 6, 7, 8]
    argmax = text[1:] + [0]  # the draft's next token after text[:i + 1]: always the text's
    confidence = [0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9]
    stopped = drafting.simulate("model", 2, text, argmax, 4, LookupSettings(), confidence, 0.5)
    assert stopped["rounds"][0] == (3, 3, 2, 2, "model")
    assert drafting.simulate("model", 2, text, argmax, 4, LookupSettings(), confidence, 0.0)["rounds"][0] == (
        5, 5, 4, 4, "model")
    assert [c[4] for c in drafting.configurations(confidence=True)].count(0.5) == 5  # model g4-g8, hybrid
    assert all(c[4] == 0.0 for c in drafting.configurations(confidence=False))


def test_drafting_replay_of_the_gate_keeps_the_lookup_out_after_its_miss():
    """bench.drafting's gated hybrid (a replay only): after the lookup predicted 4 after [1, 2, 3] where the text
    has 5, the next round is the draft model's alone (4 proposals, width 5), where the hybrid lets the lookup
    continue the draft's run past [1, 2, 3] again (7 proposals)."""
    from bench import drafting
    from specdec.drafters import LookupSettings

    prompt = [1, 2, 3, 4, 8, 9, 10]
    text = prompt + [1, 2, 3, 5, 1, 2, 3, 5, 11, 12, 13, 14]
    argmax = text[1:] + [0]  # the draft is always right
    gated = drafting.GatedHybrid(None, None, LookupSettings(), text, len(prompt))
    assert gated.right == {10: False, 14: True, 15: False}  # 4 for 5, then 5, then 1 for 11
    hybrid = drafting.simulate("hybrid", len(prompt), text, argmax, 4, LookupSettings())["rounds"]
    replayed = drafting.simulate("hybrid-gated", len(prompt), text, argmax, 4, LookupSettings())["rounds"]
    assert hybrid[0] == replayed[0] == (10, 4, 9, 3, "model")
    assert (hybrid[1][0], replayed[1][0]) == (8, 5)
    assert sum(r[1] for r in replayed) == len(text) - len(prompt)


@pytest.mark.skipif(not quantization_supported(), reason="this torch build has no int8 engine")
def test_drafting_replay_gives_the_engines_greedy_rounds_with_an_int8_draft():
    """bench.drafting replays greedy rounds from the draft's argmaxes on the target's text. With an int8 draft,
    whose activations are quantized with one scale per forward, those must come from forwards shaped as decoding
    shapes them (the prompt, then a token at a time), or the replay's rounds are not the engine's."""
    from bench import drafting
    from specdec.drafters import LookupSettings

    target = make_model("llama")
    draft = perturbed_copy(target, noise=0.05)
    assert quantize_linears(draft) > 0
    decoder = SpeculativeDecoder(draft, target)
    prompt = torch.randint(4, 64, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    chunks, result = rounds_of(decoder.stream(prompt, max_new_tokens=48, temperature=0, gamma=4, eos_token_id=[]))
    accepted = [chunk.sources.count("draft") for chunk in chunks]
    text = prompt + result.token_ids
    widths = []  # the draft's forwards in draft_outputs, by how many tokens each feeds
    hook = draft.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].size(1)),
                                           with_kwargs=True)
    outputs = drafting.draft_outputs(decoder, text, len(prompt))
    hook.remove()
    assert widths == [len(prompt) + 1] + [1] * (len(result.token_ids) - 1)  # the first token drawn alone
    replayed = drafting.simulate("model", len(prompt), text, outputs["argmax"], 4, LookupSettings())["rounds"]
    assert [r[3] for r in replayed] == accepted and replayed[0] == (1, 1, 0, 0, "none")
    assert 0 < sum(accepted) < 4 * len(accepted)  # some proposals accepted, some rejected


def test_agreement_counts_where_the_lookup_and_the_draft_are_right():
    """bench.agreement at each generated position where the lookup matches: at 8 it copies 4 after [1, 2, 3] (right,
    as is the draft), at 9 it copies 5 (right, the draft wrong), at 10 it copies 1 where the text goes on with 7
    (wrong, the draft right). Hits after a hit: 1 of 2."""
    from bench import agreement

    text = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 7]
    argmax = [0] * len(text)
    argmax[7], argmax[9] = 4, 7  # the draft's next token after text[:8] and text[:10]
    counts = agreement.agreement(text, argmax, prompt_len=8, min_match=3, max_ngram=8)
    assert counts == {"positions": 3, "fires": 3, "lookup_right": 2, "draft_right": 2, "only_lookup_right": 1,
                      "after_hit": 2, "right_after_hit": 1, "after_miss": 0,
                      "right_after_miss": 0}
    # a match shorter than min_match does not fire: [5, 7] never occurred, nor did [7]
    assert agreement.agreement(text + [7, 8], [0] * 13, 11, 2, 8)["fires"] == 0


@pytest.mark.skipif(not quantization_supported(), reason="this torch build has no int8 engine")
def test_benchmark_draft_beside_a_bfloat16_target_is_int8_as_load_pair_gives_it():
    """With HF baselines planned the stock pair is loaded unquantized; our draft is a copy made as load_pair
    makes it: float32 with int8 linears, beside a bfloat16 target too. The stock draft stays as it was."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    stock = make_model("llama", seed=0).to(torch.bfloat16)
    ours = ours_draft(stock, "int8")
    assert any(isinstance(m, DynamicQuantizedLinear) for m in ours.modules())
    assert measured_models(stock, ours) == {"dtype": "bfloat16", "draft_quantization": "int8"}
    assert next(stock.parameters()).dtype == torch.bfloat16
    assert not any(isinstance(m, DynamicQuantizedLinear) for m in stock.modules())
    plain = ours_draft(stock, "none")
    assert next(plain.parameters()).dtype == torch.bfloat16
    assert not any(isinstance(m, DynamicQuantizedLinear) for m in plain.modules())
    assert measured_models(stock, plain)["draft_quantization"] == "none"


@pytest.mark.skipif(not grouped_kernel(), reason="the grouped kernel is not built here")
def test_benchmark_names_a_grouped_draft_by_its_bits():
    """A draft in 4-bit groups (draft_quantization "auto" on the default pair, or "int4") is reported as int4; one
    with other groups (the GGUF's own 5- to 8-bit forms) as shipped."""
    from specdec.cpu.grouped import quantize_model

    target = make_model("llama", seed=0)
    four = make_model("llama", seed=1)
    quantize_model(four, 4)
    eight = make_model("llama", seed=1)
    quantize_model(eight, 8)
    assert measured_models(target, four)["draft_quantization"] == "int4"
    assert measured_models(target, eight)["draft_quantization"] == "shipped"


def test_prompt_cache_workloads_run_end_to_end_on_the_tiny_pair(tmp_path):
    """bench/prompt_cache.py: chat, document chat, agent and editor, the cache on and off side by side; the cache
    serves a growing share of each conversation, greedy answers are the same both ways, and the report is written."""
    from bench import prompt_cache

    out = tmp_path / "prompt-cache"
    report = prompt_cache.main(["--tiny", "--out", str(out), "--conversations", "2", "--turns", "3", "--steps", "3",
                                "--points", "3", "--snippet-tokens", "60", "--result-tokens", "60",
                                "--file-tokens", "400", "--document-tokens", "300", "--min-history", "200",
                                "--max-new-tokens", "8"])
    summary = report["summary"]
    assert set(summary) == {"chat", "document", "agent", "editor"}
    for name, figures in summary.items():
        assert figures["same_answers"] == figures["requests"], name
        assert 0 < figures["cached_share"] < 1 and 0 < figures["max_cache_bytes"] <= report["budget"], name
    chat = [r for r in summary["chat"]["per_step"] if r["unit"] == "chat1"]
    assert [r["cached_tokens"] for r in chat][0] == 0
    assert all(later["cached_tokens"] > earlier["cached_tokens"] for earlier, later in zip(chat, chat[1:]))
    assert all(r["cached_tokens"] == r["history_tokens"] - 1 for r in chat[1:])  # the whole last turn, but its
    # newest token (the character tokenizer re-renders every answer token for token)
    assert summary["chat"]["template_repeated"] == summary["chat"]["template_history"]
    # a document chat's later turns bring a short question: most of each warm prompt is served from the cache
    document = summary["document"]
    assert document["warm_requests"] == 4 and document["uncached_share"] < 0.2 < summary["chat"]["uncached_share"]
    assert (out / "results.md").read_text().startswith("# Prompt cache: tiny pair")
    assert json.loads((out / "results.json").read_text())["runs"]["editor"]["on"][1]["cached_tokens"] > 0


def test_prompt_cache_runs_the_workloads_asked_and_refuses_an_unknown_one(tmp_path, capsys):
    from bench import prompt_cache

    report = prompt_cache.main(["--tiny", "--out", str(tmp_path), "--workloads", "document", "--conversations", "1",
                                "--turns", "2", "--document-tokens", "100", "--max-new-tokens", "4"])
    assert set(report["summary"]) == {"document"} and report["summary"]["document"]["requests"] == 2
    with pytest.raises(SystemExit):
        prompt_cache.main(["--tiny", "--workloads", "chat,novel"])
    assert "unknown workload novel" in capsys.readouterr().err


def test_draft_forms_report_pairs_each_prompt_and_counts_acceptance():
    """bench.draft_forms: ratios are taken within each prompt (a slow prompt does not mix with a fast one), their
    median and range reported, and the acceptance counted lower, higher or equal per run."""
    from bench.draft_forms import report

    rows = [{"prompt": "a", "repeat": 0, "target": 10.0, "google-int8": 20.0, "google-int4": 22.0,
             "google-int8-acceptance": 0.9, "google-int4-acceptance": 0.8, "draft-int8": 30.0, "draft-int4": 36.0},
            {"prompt": "b", "repeat": 0, "target": 5.0, "google-int8": 5.0, "google-int4": 4.0,
             "google-int8-acceptance": 0.5, "google-int4-acceptance": 0.5, "draft-int8": 15.0, "draft-int4": 15.0},
            {"prompt": "c", "repeat": 0, "target": 20.0, "google-int8": 30.0, "google-int4": 36.0,
             "google-int8-acceptance": 0.7, "google-int4-acceptance": 0.75, "draft-int8": 40.0, "draft-int4": 60.0}]
    summary, text = report(rows, "python -m bench.draft_forms", "now")
    google = summary["summary"]["google-int4 / google-int8"]
    assert google == {"median": pytest.approx(1.1), "low": pytest.approx(0.8), "high": pytest.approx(1.2)}
    assert summary["summary"]["draft-int4 / draft-int8"]["median"] == pytest.approx(1.2)
    assert (summary["acceptance_lower"], summary["acceptance_higher"]) == (1, 1)
    assert "| google-int4 / google-int8 | 1.10x | 0.80-1.20x |" in text and "python -m bench.draft_forms" in text


def test_fused_forward_bench_switches_the_forward_and_reports_paired_ratios():
    """bench.fused_forward: "library" runs CachedModel without the fused forward and gives it back after; ratios are
    taken within each prompt, and runs whose tokens differ between the forwards are counted."""
    from argparse import Namespace

    from bench.fused_forward import forward_path, report
    from specdec.kv_cache import CachedModel
    from tests.support.models import make_model

    model = make_model("llama")
    with forward_path("library"):
        assert CachedModel(model)._fused is None
    with forward_path("fused"):
        assert CachedModel(model)._fused is not None
    assert CachedModel(model)._fused is not None
    rows = [{"prompt": "a", "repeat": 0, "target-library": 10.0, "target-fused": 11.0, "google-library": 20.0,
             "google-fused": 24.0, "target-same-tokens": True, "google-same-tokens": True},
            {"prompt": "b", "repeat": 0, "target-library": 5.0, "target-fused": 6.0, "google-library": 4.0,
             "google-fused": 4.0, "target-same-tokens": True, "google-same-tokens": False}]
    args = Namespace(threads=2, draft_quantization="int8", tokens=48, gamma=4)
    summary, text = report(rows, "python -m bench.fused_forward", "now", args)
    assert summary["summary"]["target: fused / library"] == {"median": pytest.approx(1.15), "low": pytest.approx(1.1),
                                                             "high": pytest.approx(1.2)}
    assert summary["summary"]["google / target, fused"]["low"] == pytest.approx(4.0 / 6.0)
    assert summary["tokens_differ"] == {"target": 0, "google": 1}
    assert "| google: fused / library | 1.10x | 1.00-1.20x |" in text


def test_draft_vocab_report_pairs_each_prompt_and_counts_differing_tokens():
    """bench.draft_vocab: each size's Google against the whole vocabulary's, within each prompt; mean acceptance
    per size; runs whose tokens differ from target-only's counted."""
    from bench.draft_vocab import report

    rows = [{"prompt": "a", "repeat": 0, "target": 10.0, "differ": 0, "google-0": 20.0, "acceptance-0": 0.9,
             "google-65536": 22.0, "acceptance-65536": 0.9},
            {"prompt": "b", "repeat": 0, "target": 10.0, "differ": 1, "google-0": 10.0, "acceptance-0": 0.5,
             "google-65536": 10.0, "acceptance-65536": 0.4}]
    summary, text = report(rows, [65536], "python -m bench.draft_vocab", "now")
    assert summary["summary"]["google 65536 / google whole"] == {"median": pytest.approx(1.05),
                                                                 "low": pytest.approx(1.0), "high": pytest.approx(1.1)}
    assert summary["acceptance"] == {0: pytest.approx(0.7), 65536: pytest.approx(0.65)}
    assert summary["differ"] == 1
    assert "| google 65536 / target | 1.60x | 1.00-2.20x |" in text


def test_a_benchmark_saves_its_record_and_report_and_names_its_command(tmp_path, capsys):
    from bench.machine import command_line, save_results

    assert command_line("bench.draft_vocab", ["--limit", "3"]) == "python -m bench.draft_vocab --limit 3"
    assert command_line("bench.draft_vocab", []) == "python -m bench.draft_vocab"
    save_results(tmp_path / "run", {"command": "c", "runs": [1]}, "| a |\n")
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == {"command": "c", "runs": [1]}
    assert (tmp_path / "run" / "results.md").read_text() == "| a |\n"
    assert "| a |" in capsys.readouterr().out


def test_structured_windows_leave_out_the_first_round_and_the_drafts_later_prefill():
    """bench.structured's windows: past the first round drops the first chunk; past both prefills also drops the
    draft's prefill where it came after the first chunk (a long prompt), never where the first chunk held it."""
    from bench.structured import _ratio, window

    run = {"new_tokens": 41, "total_seconds": 5.0, "first_chunk_tokens": 1, "first_chunk_seconds": 2.0,
           "draft_prefill_seconds": 1.0, "draft_prefill_after_first_chunk": True}
    assert window(run, "whole") == (41, 5.0)
    assert window(run, "past the first round") == (40, 3.0)
    assert window(run, "past both prefills") == (40, 2.0)
    short = {**run, "draft_prefill_after_first_chunk": False}  # the first chunk already paid for the draft's prefill
    assert window(short, "past both prefills") == (40, 3.0)
    target = {**run, "draft_prefill_seconds": 0.0, "total_seconds": 6.0, "prompt": "p", "repeat": 0}
    baseline = {("p", 0): target}
    # target-only: 40 tokens in 4 s either way; the speculative run: 40 in 3 s past the first round, in 2 s past both
    assert _ratio([{**run, "prompt": "p", "repeat": 0}], baseline, "past the first round")[0] == pytest.approx(4 / 3)
    assert _ratio([{**run, "prompt": "p", "repeat": 0}], baseline, "past both prefills")[0] == pytest.approx(2.0)


def test_native_step_report_pairs_each_prompt_and_counts_the_same_outputs():
    """bench.native_step: the step times as measured, ratios within each prompt, and the prompts whose four runs
    gave the same tokens counted."""
    from bench.native_step import report

    steps = {f"{role}-{step}-{n}": value for role, base in (("draft", 20.0), ("target", 60.0))
             for step, factor in (("fused", 1.5), ("native", 1.0)) for n, value in ((1, base * factor),
                                                                                    (5, base * factor * 1.2))}
    rows = [{"prompt": "a", "repeat": 0, "target-fused": 10.0, "target-native": 11.0, "google-fused": 12.0,
             "google-native": 15.0, "google-fused-acceptance": 0.8, "google-native-acceptance": 0.8,
             "same-output": True},
            {"prompt": "b", "repeat": 0, "target-fused": 5.0, "target-native": 6.0, "google-fused": 5.0,
             "google-native": 5.5, "google-fused-acceptance": 0.5, "google-native-acceptance": 0.5,
             "same-output": False},
            {"prompt": "c", "repeat": 0, "target-fused": 20.0, "target-native": 24.0, "google-fused": 30.0,
             "google-native": 36.0, "google-fused-acceptance": 0.7, "google-native-acceptance": 0.7,
             "same-output": True}]
    summary, text = report(steps, rows, "python -m bench.native_step", "now")
    native = summary["summary"]["google-native / google-fused"]
    assert native == {"median": pytest.approx(1.2), "low": pytest.approx(1.1), "high": pytest.approx(1.25)}
    assert summary["summary"]["target-native / target-fused"]["median"] == pytest.approx(1.2)
    assert summary["summary"]["google-native / target-native"]["median"] == pytest.approx(1.5 / 1.1)
    assert summary["same_output"] == 2
    assert "draft 1 token: fused 30.0, native 20.0; draft 5 tokens: fused 36.0, native 24.0; target 1 token" in text
    assert "on 2 of 3 prompts" in text


def test_structured_runs_the_chosen_methods_and_each_speculative_one_again_without_amx():
    """bench.structured --methods picks labels, separated by ; (the constrained baseline always first); --without-amx adds each
    speculative method with the AMX path off; an unknown label is refused with the known ones."""
    from argparse import Namespace

    from bench.structured import BASELINE, METHODS, variants

    chosen = variants(Namespace(methods="model + grammar, stop 0.6", without_amx=True))  # labels have commas: ; separates
    assert [(label, amx) for label, _, amx in chosen] == [
        (BASELINE, True), ("model + grammar, stop 0.6", True), ("model + grammar, stop 0.6, no AMX", False)]
    assert chosen[2][1] == METHODS["model + grammar, stop 0.6"]
    assert [label for label, _, _ in variants(Namespace(methods=None, without_amx=False))] == list(METHODS)
    with pytest.raises(SystemExit, match="unknown methods: nope"):
        variants(Namespace(methods="nope", without_amx=False))


def test_amx_report_gives_each_width_against_vnni_and_against_one_token():
    """bench.amx: per model and width, the VNNI / AMX ratio and each path against one token's VNNI forward; the
    report says when AMX was not usable (both columns VNNI's then)."""
    from bench.amx import report

    ms = {f"{role}-{path}-{n}": base * n ** 0.5 * (0.8 if path == "amx" and n > 1 else 1.0)
          for role, base in (("draft", 20.0), ("target", 60.0)) for path in ("vnni", "amx") for n in (1, 4)}
    record, text = report(ms, True, "python -m bench.amx", "now", 2)
    assert record["summary"]["target-4"] == {"vnni_ms": 120.0, "amx_ms": pytest.approx(96.0),
                                             "speedup": pytest.approx(1.25)}
    assert record["summary"]["draft-1"]["speedup"] == pytest.approx(1.0)
    assert "| target | 4 | 120.0 | 96.0 | 1.25x | 2.00 | 1.60 |" in text
    assert "not usable" in report(ms, False, "c", "now", 2)[1]


def test_forward_ms_by_path_times_every_role_path_and_width_taking_turns():
    """bench.forwards.forward_ms_by_path (bench.amx, bench.native_step): each model's own forward, a median per
    role, path and width, the paths switched on in turn within every repeat (so drift lands on all alike)."""
    from bench.forwards import forward_ms_by_path
    from specdec.fused_forward import fused_forward

    model = make_model("llama", seed=0)
    forward = fused_forward(model)
    assert forward is not None
    switched = []
    paths = {name: (lambda role, name=name: switched.append((role, name))) for name in ("a", "b")}
    ms = forward_ms_by_path({"target": forward}, {"target": model.config}, paths, (1, 3), repeats=2, cached=8)
    assert set(ms) == {"target-a-1", "target-a-3", "target-b-1", "target-b-3"}
    assert all(value > 0 for value in ms.values())
    assert switched == [("target", "a"), ("target", "b")] * 4  # two warm-up repeats, then two timed


def test_hf_assisted_with_a_fixed_threshold_skips_the_roc_refit_and_decodes_the_same(tiny_pair_dirs, monkeypatch):
    """The overhead benchmark's second assisted row: generate without the per-round ROC refit of the assistant's
    confidence threshold (what scikit-learn's presence switches on), the same greedy tokens."""
    pytest.importorskip("sklearn")
    import sklearn.metrics
    from transformers import AutoModelForCausalLM

    calls = []
    real = sklearn.metrics.roc_curve
    monkeypatch.setattr(sklearn.metrics, "roc_curve", lambda *a, **k: calls.append(1) or real(*a, **k))
    draft, target = (AutoModelForCausalLM.from_pretrained(folder).eval() for folder in tiny_pair_dirs)
    ids = list(range(3, 20))
    refit = run_hf("hf_assisted", draft, target, ids, 40, MODES["greedy"], 0)
    assert calls, "the tiny pair's draft agrees often enough for HF to refit its threshold"
    calls.clear()
    fixed = run_hf("hf_assisted_fixed_threshold", draft, target, ids, 40, MODES["greedy"], 0)
    assert calls == [] and fixed["token_digest"] == refit["token_digest"]
    assert run_hf("hf_target", draft, target, ids, 40, MODES["greedy"], 0)["token_digest"] == refit["token_digest"]


def test_overhead_table_compares_with_the_faster_of_hf_assisted_generations_two_configurations():
    from bench import overhead

    def row(rate):
        return {"tokens_per_second": rate, "ms_per_round": 1.0, "ms_per_round_outside_forwards": 0.1}

    results = {f"eager/{method}/in-process": row(400.0) for method in overhead.METHODS}
    results.update(hf_generate={"tokens_per_second": 100.0}, hf_assisted={"tokens_per_second": 50.0},
                   hf_assisted_fixed_threshold={"tokens_per_second": 200.0})
    table = overhead.markdown({"command": "python -m bench.overhead", "date": "today", "machine": {"cpu": "x"},
                               "pair": "tiny", "tokens": 200, "results": results})
    assert "| eager | google-c0.4 | 400 | 4.00x | 2.00x |" in table  # against 200, not 50
    assert "| HF | assisted generation | 50.0 | | 0.25x |" in table
    assert "| HF | assisted generation, threshold fixed (as without scikit-learn) | 200 | | 1.00x |" in table
    # the service's rows beside the HTTP floor's (bench/floor.py)
    results["eager/target/service-json"] = {"tokens_per_second": 360.0, "vs_in_process": 0.9, "vs_floor": 0.95,
                                            "engine_tokens_per_second": 390.0, "ms_outside_engine": 4.0}
    results["eager/target/floor"] = {"tokens_per_second": 380.0, "vs_in_process": 0.95, "ms_outside_work": 2.0}
    row = next(line for line in overhead.markdown({"command": "c", "date": "d", "machine": {}, "pair": "tiny",
                                                   "tokens": 200, "results": results}).splitlines()
               if line.startswith("| eager | target |"))
    assert row.endswith("| 360 (0.90x, 0.95x of the floor; engine 390, +4.0 ms) | - | 380 (0.95x, +2.0 ms) |")
    # older reports, with one assisted row, still render
    del results["hf_assisted_fixed_threshold"]
    assert "| eager | google | 400 | 4.00x | 8.00x |" in overhead.markdown(
        {"command": "c", "date": "d", "machine": {}, "pair": "tiny", "tokens": 200, "results": results})


def test_the_http_floor_waits_as_long_as_asked_and_answers_as_many_bytes(tmp_path):
    """bench/floor.py: gunicorn's gevent worker with the work on an OS thread and no service: a request for
    0.05 s of work takes at least that, and its answer has the size asked for (FloorServer.wait checks it)."""
    from bench import overhead
    from bench.floor import FloorServer

    floor = FloorServer(tmp_path / "floor.log").wait_ready()
    try:
        assert 0.05 <= floor.wait(0.05, 300) < 5
        row = overhead.through_floor(floor, 0.02, 1000, 10)
        assert row["vs_in_process"] < 1 and row["ms_outside_work"] > 0 and row["tokens_per_second"] < 500
    finally:
        floor.stop()
    assert floor.process.returncode is not None


def test_one_process_benchmark_pairs_the_service_with_the_same_decode_run_directly(tmp_path):
    """bench/one_process.py (gevent-patched, so in its own process): each method's JSON and SSE requests paired
    with the same decode run directly on the service's engine thread, with the request's own parameters."""
    done = subprocess.run([sys.executable, "-m", "bench.one_process", "--compile", "false", "--tokens", "8",
                           "--repeats", "2", "--methods", "target,google", "--stages", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["results"]) == {"target/json", "target/sse", "google/json", "google/sse"}
    for row in report["results"].values():
        assert row["pairs"] == 2 and 0 < row["vs_direct"] < 2 and 0 < row["engine_vs_direct"] < 2
        assert row["direct_tokens_per_second"] > 0 and row["ms_outside_engine"] > 0
    assert "| target | SSE |" in (tmp_path / "results.md").read_text()
    # --stages: each JSON request's stages, in order, from the client's clock and the service's stamps (every one
    # stamped: a wrapper that no longer sees its function called leaves a stage missing, and the run fails). Not
    # imported here: bench.one_process patches the process it is imported in (gevent)
    assert set(report["stages"]) == {"target", "google"}
    for stages in report["stages"].values():
        parts = {label: ms for label, ms in stages.items() if label not in ("requests", "whole request")}
        assert stages["requests"] == 2 and len(parts) == 10 and all(ms > 0 for ms in parts.values())
        assert stages["engine: decode, then detokenize"] < stages["whole request"]
        assert sum(parts.values()) == pytest.approx(stages["whole request"], rel=0.5)
    assert "| hand-off to the engine thread |" in (tmp_path / "results.md").read_text()


def test_split_benchmark_smoke_on_tiny_pair(tmp_path):
    """bench/split.py: the engine in a second process, the front rendering its rounds; JSON and SSE answered and
    paired with direct decodes (their texts are the front's own assembly of the engine's token ids)."""
    done = subprocess.run([sys.executable, "-m", "bench.split", "--compile", "false", "--repeats", "1", "--tokens",
                           "16", "--methods", "target,google", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(results) == {"target/json", "target/sse", "google/json", "google/sse"}
    assert all(row["vs_direct"] > 0 and row["engine_vs_direct"] > 0 and row["pairs"] == 1 for row in results.values())
