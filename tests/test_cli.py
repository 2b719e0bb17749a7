"""The command line on a tiny saved pair: every method, source marks, greedy equivalence, clean errors."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

from specdec.cli import main, render_sources, use_color
from specdec.text import decoder_of, token_pieces
from tests.support.models import make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS = re.compile(r"^\d+ tokens \| [\d.]+ tokens/s \| acceptance (-|[\d.]+) \| (-|[\d.]+) tokens per target forward$",
                   re.M)
SECTION = re.compile(r"^== ([\w+]+): [^\n]* ==\n(.*?)\n(?=\d+ tokens \|)", re.M | re.S)


@pytest.fixture(scope="module")
def pair_args(tiny_pair_dirs):
    draft_dir, target_dir = tiny_pair_dirs
    return ["--target_model_name", target_dir, "--approx_model_name", draft_dir, "--input", "def add(a, b):",
            "-M", "12", "-s", "7"]


def completions(out: str) -> dict:
    """method -> printed completion."""
    return {method: text for method, text in SECTION.findall(out)}


@pytest.mark.parametrize("method", ["google", "deepmind", "target", "draft"])
def test_each_method_prints_its_completion_and_stats(pair_args, capsys, method):
    assert main(pair_args + ["--method", method]) == 0
    out = capsys.readouterr().out
    assert list(completions(out)) == [method]
    assert len(STATS.findall(out)) == 1
    assert "def add(a, b):" not in out  # the completion only, not the prompt


def test_all_runs_the_earlier_tools_order_then_the_other_drafters(pair_args, capsys):
    assert main(pair_args) == 0
    out = capsys.readouterr().out
    assert list(completions(out)) == ["target", "draft", "deepmind", "google", "google+lookup", "google+hybrid"]
    assert len(STATS.findall(out)) == 6
    assert main(pair_args + ["--drafter", "lookup"]) == 0
    assert list(completions(capsys.readouterr().out))[3:] == ["google", "google+model", "google+hybrid"]


def test_lookup_flags_reach_the_decoder(pair_args, capsys, monkeypatch):
    from specdec import engine
    from specdec.params import LookupSettings

    built, original = [], engine.SpeculativeDecoder.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self.lookup)

    monkeypatch.setattr(engine.SpeculativeDecoder, "__init__", spy)
    assert main(pair_args + ["--method", "google", "--drafter", "hybrid", "-M", "4", "--lookup_max_ngram", "3",
                             "--lookup_max_tokens", "2", "--hybrid_min_match", "2", "--hybrid_extend"]) == 0
    assert built == [LookupSettings(max_ngram=3, max_tokens=2, hybrid_min_match=2, extend=True)]
    assert main(pair_args + ["--method", "google", "-M", "4"]) == 0
    assert built[-1] == LookupSettings()  # no flags: the measured defaults
    assert main(pair_args + ["--method", "google", "--drafter", "hybrid", "-M", "4", "--no-hybrid_extend"]) == 0
    assert built[-1] == LookupSettings(extend=False)


def test_greedy_speculative_output_is_the_targets_greedy_text(pair_args, capsys):
    assert main(pair_args + ["--temperature", "0", "-M", "24"]) == 0
    texts = completions(capsys.readouterr().out)
    assert texts["google"] == texts["target"] and texts["deepmind"] == texts["target"]
    assert texts["google+lookup"] == texts["target"] and texts["google+hybrid"] == texts["target"]
    assert texts["target"]


def test_penalty_flags_change_the_text_and_keep_greedy_equivalence(pair_args, capsys):
    assert main(pair_args + ["--temperature", "0", "-M", "24"]) == 0
    plain = completions(capsys.readouterr().out)
    assert main(pair_args + ["--temperature", "0", "-M", "24", "--presence_penalty", "0.5", "--frequency_penalty",
                             "1.5", "--repetition_penalty", "1.2"]) == 0
    texts = completions(capsys.readouterr().out)
    assert texts["target"] != plain["target"]
    assert all(texts[label] == texts["target"] for label in ("google", "deepmind", "google+lookup", "google+hybrid"))


def test_min_tokens_flag_decodes_at_least_that_many_tokens_with_every_method(pair_args, capsys):
    sampled = pair_args + ["-s", "17", "--temperature", "1", "-M", "40", "--method"]  # this draw ends at EOS early
    assert main(sampled + ["target"]) == 0
    assert "40 tokens |" not in capsys.readouterr().out
    assert main(sampled + ["all", "--min_tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count("40 tokens |") == len(completions(out)) >= 5


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_drafter_and_block_verification_flags_keep_greedy_equivalence(pair_args, capsys, drafter):
    common = pair_args + ["--temperature", "0", "-M", "24", "--input", "abcabcabcabc", "-v"]
    assert main(common + ["--method", "target"]) == 0
    target = capsys.readouterr().out.split(" ==\n", 1)[1].splitlines()[0]
    assert main(common + ["--method", "google", "--drafter", drafter, "--verification", "block"]) == 0
    out = capsys.readouterr().out
    assert f"drafter {drafter}, verification block" in out
    marked = out.split(" ==\n", 1)[1].splitlines()[0]
    assert re.sub(r"\[\w:", "[", marked) == re.sub(r"\[\w:", "[", target)  # the same tokens, other marks
    assert "l" in re.findall(r"\[([dlrbt]):", marked)  # the lookup proposed accepted tokens (marked l)


def test_unquantized_draft_keeps_greedy_equivalence(pair_args, capsys):
    assert main(pair_args + ["--temperature", "0", "-M", "24", "--draft_quantization", "NONE"]) == 0
    texts = completions(capsys.readouterr().out)
    assert texts["google"] == texts["target"] and texts["deepmind"] == texts["target"]


def test_quantized_pair_keeps_greedy_equivalence(pair_args, capsys, caplog):
    """--quantize int4: the float pair's linear layers in 4-bit groups (a changed model), and speculative greedy
    output still the (quantized) target's."""
    import logging

    with caplog.at_level(logging.INFO, logger="specdec"):
        assert main(pair_args + ["--temperature", "0", "-M", "24", "--quantize", "INT4"]) == 0
    texts = completions(capsys.readouterr().out)
    assert texts["google"] == texts["target"] and texts["deepmind"] == texts["target"]
    assert "quantized the float models to int4" in caplog.text


def test_compiled_path_keeps_greedy_equivalence(pair_args, capsys, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="specdec.models.startup"):
        assert main(pair_args + ["--temperature", "0", "-M", "24", "--draft_quantization", "none",
                                 "--compile", "true"]) == 0
    assert sum("compiled the" in r.getMessage() and "static cache" in r.getMessage() for r in caplog.records) == 2
    texts = completions(capsys.readouterr().out)
    assert texts["google"] == texts["target"] and texts["deepmind"] == texts["target"]


def test_verbose_marks_each_token_by_source(pair_args, capsys):
    assert main(pair_args + ["-v", "--method", "google", "-M", "24"]) == 0
    out = capsys.readouterr().out
    assert "legend:" in out and "\x1b[" not in out  # captured output is not a terminal: marks, not colours
    marked = out.split(" ==\n", 1)[1].splitlines()[0]
    marks = re.findall(r"\[([dlrbt]):", marked)
    assert marks and set(marks) <= {"d", "r", "b"}
    assert "seed 7" in out


def test_verbose_marks_count_the_stats_lines_tokens(pair_args, capsys):
    """Found by an audit: a token with no text of its own (a special token the random target drew) had no mark,
    so the marks fell one short of the stats line's count and of /predict's `tokens`."""
    assert main(pair_args + ["-v", "--method", "all", "-M", "30", "--input", "abc abc abc", "-s", "42"]) == 0
    out = capsys.readouterr().out
    sections = SECTION.findall(out)
    counts = [int(count) for count in re.findall(r"^(\d+) tokens \|", out, re.M)]
    assert len(sections) == len(counts) >= 4
    for (_, body), count in zip(sections, counts):
        assert len(re.findall(r"\[[dlgrbt]:", body)) == count


def test_verbose_baseline_tokens_are_marked_as_single_model(pair_args, capsys):
    assert main(pair_args + ["-v", "--method", "target", "-M", "4"]) == 0
    marked = capsys.readouterr().out.split(" ==\n", 1)[1].splitlines()[0]
    assert set(re.findall(r"\[([drbt]):", marked)) == {"t"}


@pytest.mark.parametrize("word", ["auto", "adaptive"])  # adaptive: the service's word, taken here too
def test_chat_template_and_adaptive_gamma(pair_args, capsys, word):
    assert main(pair_args + ["--chat", "--gamma", word, "--method", "deepmind", "-v"]) == 0
    out = capsys.readouterr().out
    assert "gamma auto" in out and len(STATS.findall(out)) == 1
    # the template wraps the 14-character input in "<bos>user: ...\n<bos>assistant: "
    assert re.search(r"prompt: (\d+) tokens", out).group(1) == str(len("<bos>user: def add(a, b):\n<bos>assistant: ")
                                                                   - 2 * len("<bos>") + 2)


def test_benchmark_prints_speedup_over_target(pair_args, capsys):
    assert main(pair_args + ["-b", "--repeats", "2", "--method", "google", "-M", "6"]) == 0
    out = capsys.readouterr().out
    table = out.split("== benchmark", 1)[1].splitlines()
    assert "speedup" in table[1]
    assert [row.split()[0] for row in table[2:]] == ["target", "google"]
    assert table[2].split()[4] == "1.00x"


def test_the_benchmark_times_each_method_after_a_warm_up_of_its_own(pair_args, capsys, monkeypatch):
    """Found by an audit: the benchmark timed target-only first and cold (the completions before it had run only
    google), 1.4 tokens/s on the default pair against 14 warm, and the speedup over it came out 2.6x. Each row's
    first decode is now untimed: one more decode per row, on a seed of its own, and the rows count only theirs."""
    from specdec.engine import SpeculativeDecoder

    calls, generate = [], SpeculativeDecoder.generate

    def recorded(self, *args, params=None, **kwargs):
        calls.append((params.method, params.seed))
        return generate(self, *args, params=params, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", recorded)
    assert main(pair_args + ["-b", "--repeats", "2", "--method", "google", "-M", "6", "-s", "5"]) == 0
    table = capsys.readouterr().out.split("== benchmark", 1)[1].splitlines()
    assert calls == [("google", 5), ("target", 7), ("target", 5), ("target", 6), ("google", 7), ("google", 5),
                     ("google", 6)]  # the completion, then each row: its warm-up (seed 5 + 2), its two runs
    assert [row.split()[:2] for row in table[2:]] == [["target", "12"], ["google", "12"]]  # 2 runs of 6 tokens


@pytest.mark.parametrize("flags, fragment", [
    (["-g", "0"], "gamma"),
    (["--gamma", "many"], "gamma"),
    (["--temperature", "-1"], "temperature"),
    (["--top_p", "0"], "top_p"),
    (["--top_p", "1.5"], "top_p"),
    (["--presence_penalty", "3"], "--presence_penalty"),
    (["--frequency_penalty", "lots"], "--frequency_penalty"),
    (["--repetition_penalty", "0"], "--repetition_penalty"),
    (["-M", "0"], "max_tokens"),
    (["--method", "beam"], "method"),
    (["--drafter", "ngram"], "drafter"),
    (["--verification", "tree"], "verification"),
    (["--draft_confidence_threshold", "1.5"], "draft_confidence_threshold"),
    (["--draft_confidence_threshold", "sure"], "draft_confidence_threshold"),
    (["--dtype", "int4"], "dtype"),
    (["--draft_quantization", "int2"], "draft_quantization"),
    (["--compile", "sometimes"], "--compile"),
    (["--quantize", "int3"], "--quantize"),
    (["--device", "tpu9"], "device"),
    (["--device_map", "everywhere"], "device_map"),
    (["--lookup_max_tokens", "0"], "--lookup_max_tokens"),
    (["--lookup_max_ngram", "many"], "--lookup_max_ngram"),
    (["--hybrid_min_match", "9"], "--hybrid_min_match"),  # more than --lookup_max_ngram's 8
    (["--lookup_max_ngram", "2", "--lookup_min_match", "3"], "--lookup_min_match"),
    (["--min_tokens", "-1"], "--min_tokens"),
    (["--min_tokens", "9", "-M", "8"], "--min_tokens"),  # more than --max_tokens: refused before the models load
])
def test_bad_flags_exit_non_zero_with_one_message(pair_args, capsys, flags, fragment):
    assert main(pair_args + flags) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err and "error:" in captured.err
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""


@pytest.mark.parametrize("flags, fragment", [
    (["-s", "-1"], "--seed"),
    (["-s", str(2**64)], "--seed"),
    (["--input", ""], "the input is empty"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json"),
    (["--json-schema", "/"], "--json-schema: cannot read /"),
    (["--regex", "[0-9]{3}", "--min_tokens", "2"], "--min_tokens cannot be combined with --regex"),
])
def test_bad_flags_are_refused_before_the_models_load(pair_args, capsys, monkeypatch, flags, fragment):
    """Found by an audit: an unreadable --json-schema (an OSError, exit 1, the flag unnamed), an empty --input and
    --min_tokens beside a grammar were refused only after the models had loaded (6 s for the default pair)."""
    def no_loading(*args, **kwargs):
        raise AssertionError("the models were loaded")

    monkeypatch.setattr("specdec.models.pair.load_pair", no_loading)
    assert main(pair_args + flags) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_largest_seed_benchmarks(pair_args, capsys):
    """Found by an audit: --seed 2**64-1 was accepted and the benchmark's seed + 1 then refused, after the
    completions were printed; the benchmark's seeds wrap around 2**64."""
    assert main(pair_args + ["-s", str(2**64 - 1), "-b", "--repeats", "2", "--method", "google", "-M", "4"]) == 0
    assert "== benchmark" in capsys.readouterr().out


def test_unknown_model_path(pair_args, capsys, tmp_path):
    assert main(pair_args + ["--target_model_name", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "Traceback" not in err


def test_mismatched_vocabularies(pair_args, capsys, tmp_path):
    from tests.support.models import make_model

    small = str(tmp_path / "small")
    make_model(vocab_size=80).save_pretrained(small)
    assert main(pair_args + ["--draft_model_name", small]) == 2
    err = capsys.readouterr().err
    assert "vocabularies differ" in err and "Traceback" not in err


def test_colour_only_on_a_terminal_without_no_color():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert use_color(Terminal(), {}) is True
    assert use_color(Terminal(), {"NO_COLOR": "1"}) is False
    assert use_color(io.StringIO(), {}) is False
    coloured = render_sources(["a", "b", "c", "d"], ["draft", "resampled", "bonus", "lookup"], color=True)
    assert coloured == "\x1b[32ma\x1b[0m\x1b[34mb\x1b[0m\x1b[35mc\x1b[0m\x1b[36md\x1b[0m"
    assert render_sources(["a", "b"], ["target", "draft"], color=False) == "[t:a][d:b]"
    # a token with no text of its own keeps its mark, empty; in colour there is nothing to colour
    assert render_sources(["a", "", "b"], ["target", "bonus", "draft"], color=False) == "[t:a][b:][d:b]"
    assert render_sources(["a", ""], ["draft", "bonus"], color=True) == "\x1b[32ma\x1b[0m"


def test_token_pieces_add_up_to_the_text():
    tokenizer = make_tokenizer()
    ids = tokenizer("x = 1\nprint(x)")["input_ids"]
    decode = decoder_of(tokenizer)
    assert "".join(token_pieces(decode, ids)) == decode(ids)


def test_main_py_and_module_run_without_traceback(pair_args):
    env = dict(os.environ, NO_COLOR="1")
    ok = subprocess.run([sys.executable, "main.py", *pair_args, "--method", "google", "-M", "4"], cwd=ROOT,
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert list(completions(ok.stdout)) == ["google"]
    bad = subprocess.run([sys.executable, "-m", "specdec", *pair_args, "--top_p", "2"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "python -m specdec: error: argument --top_p: must be in (0, 1], got 2 (see --help)"


def test_json_schema_and_regex_constrain_every_method(pair_args, capsys, tmp_path):
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert main(pair_args + ["--json-schema", str(path), "-M", "40", "--temperature", "0"]) == 0
    texts = completions(capsys.readouterr().out)
    assert texts and all(json.loads(text) in ({"n": n} for n in range(10)) for text in texts.values())
    assert main(pair_args + ["--regex", "[a-c]{3}!", "-M", "10", "--method", "google", "-v"]) == 0
    out = capsys.readouterr().out
    assert "[g:!]" in out or "\x1b[90m!" in out  # the forced "!" marked as the grammar's
    assert main(pair_args + ["--regex", "(unclosed"]) == 2
    assert "--regex: invalid or unsupported regex" in capsys.readouterr().err
    path.write_text("{not json")
    assert main(pair_args + ["--json-schema", str(path)]) == 2
    assert "--json-schema" in capsys.readouterr().err


def test_the_draft_confidence_threshold_defaults_as_the_services(tiny_pair_dirs, pair_args, capsys, monkeypatch):
    """auto (the default), as the service's setting: the default pair's measured threshold where both models name
    it, 0 for other pairs; a number as given (the fifth audit: the CLI always took 0, the service 0.6)."""
    import specdec.models.pair as pair_module

    assert main(pair_args + ["-v", "--method", "google"]) == 0
    assert "draft confidence threshold 0\n" in capsys.readouterr().out
    assert main(pair_args + ["-v", "--method", "google", "--draft_confidence_threshold", "0.3"]) == 0
    assert "draft confidence threshold 0.3\n" in capsys.readouterr().out
    named = []
    load = pair_module.load_pair
    monkeypatch.setattr(pair_module, "load_pair", lambda draft, target, **kwargs: named.append((draft, target))
                        or load(*tiny_pair_dirs, **kwargs))  # the default pair named, the tiny pair loaded
    assert main(["--input", "def add(a, b):", "-M", "6", "-s", "7", "-v", "--method", "google"]) == 0
    assert named == [(None, None)] and "draft confidence threshold 0.6\n" in capsys.readouterr().out
