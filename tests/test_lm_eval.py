"""lm-evaluation-harness against the service: the project's own task (eval/tasks/specdec_local: a multiple-choice
part scored by loglikelihood, a generate_until part) through `--model local-completions` against a live gunicorn
on the tiny pair, and through lm-eval's `hf` backend on the same target. Per-sample loglikelihoods agree within
1e-4 (the server runs our CPU kernels and an int8 draft, the hf backend transformers' own kernels), accuracy is
equal, and so are the greedy generations.

local-completions sends what it sends to any OpenAI-compatible server: token-id prompts, several per request
(batch size 4), `echo: true, logprobs: 1, max_tokens: 1` for loglikelihoods, and stop strings for generations.
Skipped where lm_eval is not installed (`lm_eval[api]` is in requirements-dev.txt).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stress import Server

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.xdist_group("lm-eval")

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "eval" / "tasks"
BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_pair_dirs):
    draft_dir, target_dir = tiny_pair_dirs
    server = Server(tmp_path_factory.mktemp("lm-eval") / "server.log", draft_model=draft_dir,
                    target_model=target_dir, device="cpu", max_new_tokens_limit=64)
    server.wait_ready(timeout=90)
    yield server
    server.stop()


def lm_eval(out: Path, *args: str) -> tuple[dict, dict[str, list[dict]]]:
    """Run lm_eval on the local task from the repository root, offline; (results, samples by task name)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "OPENAI_API_KEY": "any", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", *args, "--tasks", "specdec_local", "--include_path", str(TASKS),
               "--log_samples", "--output_path", str(out), "--seed", "0"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in ("specdec_mc", "specdec_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                               key=lambda sample: sample["doc_id"])
    return json.loads(results_file.read_text())["results"], samples


def test_local_completions_against_the_service_equal_the_hf_backend(server, tiny_pair_dirs, tmp_path):
    _, target_dir = tiny_pair_dirs
    served, served_samples = lm_eval(
        tmp_path / "served", "--model", "local-completions", "--batch_size", str(BATCH), "--model_args",
        f"model=target,base_url={server.url}/v1/completions,tokenizer={target_dir},"
        f"tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1,max_gen_toks=16")
    hf, hf_samples = lm_eval(tmp_path / "hf", "--model", "hf", "--device", "cpu", "--batch_size", "1",
                             "--model_args", f"pretrained={target_dir},dtype=float32")

    # loglikelihoods: each choice of each question, and whether it was the greedy continuation
    mc, mc_hf = served_samples["specdec_mc"], hf_samples["specdec_mc"]
    assert [s["doc_id"] for s in mc] == [s["doc_id"] for s in mc_hf] == list(range(8))
    for sample, reference in zip(mc, mc_hf):
        ours = [float(loglikelihood) for loglikelihood, _ in sample["filtered_resps"]]  # logged as text
        theirs = [float(loglikelihood) for loglikelihood, _ in reference["filtered_resps"]]
        assert ours == pytest.approx(theirs, abs=1e-4)
        assert sample["acc"] == reference["acc"] and sample["acc_norm"] == reference["acc_norm"]
    for metric in ("acc,none", "acc_norm,none"):
        assert served["specdec_mc"][metric] == hf["specdec_mc"][metric]

    # greedy generations, cut at the first newline: the service's speculative output is the target's own
    gen, gen_hf = served_samples["specdec_gen"], hf_samples["specdec_gen"]
    assert [s["resps"] for s in gen] == [s["resps"] for s in gen_hf]
    assert served["specdec_gen"]["exact_match,strip"] == hf["specdec_gen"]["exact_match,strip"]
    assert server.metric("specdec_requests_total", '{endpoint="/v1/completions",status="200"}') >= (
        32 / BATCH + 6 / BATCH)  # several prompts per request
