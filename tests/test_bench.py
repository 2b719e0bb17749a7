"""bench.py and bench/gpu.py run end to end on tiny models and write their JSON, table and plot."""

import json
import subprocess
import sys
from pathlib import Path

from specdec import bench
import pytest

from specdec.adaptive import expected_speedup, fit_alpha

ROOT = Path(__file__).resolve().parent.parent


def test_prompt_set_is_committed_and_varied():
    prompts = bench.load_prompts(bench.DEFAULT_PROMPTS)
    assert len(prompts) >= 20
    assert {p["category"] for p in prompts} == {"code_completion", "code_instruction", "chat", "summarize"}


def test_benchmark_end_to_end_on_tiny_pair(tiny_pair_dirs, tmp_path):
    draft, target = tiny_pair_dirs
    out = tmp_path / "results"
    assert bench.main(["--draft", draft, "--target", target, "--limit", "3", "--max-new-tokens", "6",
                       "--sweep-gammas", "1,3", "--sweep-prompts", "2", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "results.md").read_text()
    assert "| google |" in table and "| hf_assisted |" in table and report["machine"]["torch"]
    for mode in ("greedy", "sampling"):
        block = report["summary"][mode]
        assert set(block["methods"]) == set(bench.OUR_METHODS + bench.HF_METHODS)
        assert block["methods"]["target"]["speedup_vs_target"] == 1.0
        google = block["methods"]["google"]
        assert 0 <= google["acceptance_rate"] <= 1
        assert google["leviathan_bound"] > 0 and google["efficiency"] > 0
        assert block["cost_ratio_c"] > 0
        assert block["methods"]["target"]["decode_speedup_vs_target"] == 1.0
        assert google["first_chunk_seconds"] > 0 and google["decode_efficiency"] > 0
        assert block["methods"]["hf_assisted"]["decode_tokens_per_second"] is None  # generate gives no rounds
    assert "decode efficiency" in table
    assert set(report["summary"]["greedy"]["gamma_sweep"]) == {"1", "3"}  # JSON object keys
    assert report["draft_quantization"] == "int8" and "quantization int8" in table
    # prompt-major order: every method runs on a prompt before the next one (drift hits all methods alike)
    ours = [(r["prompt"], r["method"]) for r in report["runs"]
            if r["mode"] == "greedy" and r["method"] in bench.OUR_METHODS and r["sweep_gamma"] is None]
    assert [m for _, m in ours[:len(bench.OUR_METHODS)]] == list(bench.OUR_METHODS)
    assert len({p for p, _ in ours[:len(bench.OUR_METHODS)]}) == 1
    # generated tokens only: never more than max_new_tokens per run
    assert all(0 < run["new_tokens"] <= 6 for run in report["runs"])


def test_summary_bound_uses_measured_acceptance_and_cost():
    runs = [{"mode": "greedy", "method": "target", "sweep_gamma": None, "new_tokens": 10, "total_seconds": 1.0},
            {"mode": "greedy", "method": "draft", "sweep_gamma": None, "new_tokens": 10, "total_seconds": 0.25},
            {"mode": "greedy", "method": "google", "sweep_gamma": None, "new_tokens": 8, "total_seconds": 0.5,
             "proposed": 8, "accepted": 6, "rounds": 2, "target_forwards": 2, "other_seconds": 0.01}]
    row = bench.summarise(runs, gamma=4)["greedy"]
    assert row["cost_ratio_c"] == 0.25
    google = row["methods"]["google"]
    assert google["speedup_vs_target"] == 1.6
    assert google["acceptance_rate"] == 0.75
    alpha = fit_alpha(4.0, 4)  # 8 tokens in 2 rounds of 4 proposals
    assert google["alpha"] == alpha > 0.75
    assert google["leviathan_bound"] == pytest.approx(expected_speedup(alpha, 4, 0.25))
    assert google["efficiency"] == pytest.approx(1.6 / expected_speedup(alpha, 4, 0.25))
    assert "decode_efficiency" not in google  # no steady-state figures in these runs


def test_summary_steady_state_leaves_out_the_first_round():
    runs = [{"mode": "greedy", "method": "target", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 2.0,
             "first_chunk_seconds": 1.0, "first_chunk_tokens": 1, "decode_tokens_per_second": 10.0},
            {"mode": "greedy", "method": "draft", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 0.5},
            {"mode": "greedy", "method": "google", "sweep_gamma": None, "new_tokens": 11, "total_seconds": 1.5,
             "proposed": 8, "accepted": 6, "rounds": 3, "target_forwards": 3, "other_seconds": 0.01,
             "first_chunk_seconds": 1.1, "first_chunk_tokens": 3, "decode_tokens_per_second": 20.0}]
    google = bench.summarise(runs, gamma=4)["greedy"]["methods"]["google"]
    assert google["speedup_vs_target"] == pytest.approx(2.0 / 1.5)
    assert google["decode_speedup_vs_target"] == 2.0
    assert google["decode_efficiency"] == pytest.approx(2.0 / google["leviathan_bound"])
    assert google["first_chunk_seconds"] == 1.1


def test_gpu_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--device", "cpu",
                           "--context", "16", "--repeats", "1", "--tokens", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [row["gamma"] for row in report["by_gamma"]] == list(range(1, 9))
    assert report["cost_ratio_c"] > 0
