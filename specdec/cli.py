"""The command line: decode one prompt with each method and print the completions, their stats and a speed table.

    python main.py --input "def quicksort(xs):" -M 32 -v          # all methods, tokens coloured by source
    python main.py --method google --temperature 0 --chat --input "Reverse a list in Python"
    python main.py --method google --drafter hybrid --verification block --input "..."

Flags of the earlier tool are kept (--input, --target_model_name, --approx_model_name, -v, -s, -M, -g, -b).
Without model flags the default pair is used. This is the only module that prints.
"""

import argparse
import json
import logging
import os
import random
import sys

from .errors import SpecDecError
from .models.default_pair import CONFIDENCE_THRESHOLD
from .params import (
    DRAFTERS,
    LOOKUP_KEYS,
    MAX_GAMMA,
    MAX_PENALTY,
    METHODS,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_BOUNDS,
    SEED_MAX,
    VERIFICATIONS,
    LookupSettings,
    SamplingParams,
)
from .stats import GenerationStats, summed
from .text import decoder_of, encode_prompt, token_pieces

logger = logging.getLogger(__name__)

DEFAULT_INPUT = "Any recommendations for my holidays in Abu Dhabi?"  # the earlier tool's default prompt
ALL_ORDER = METHODS  # --method all runs them in the earlier tool's order: target, draft, deepmind, google, then
# google with each drafter other than --drafter's, labelled method+drafter
TITLES = {
    "target": "target only (autoregressive)",
    "draft": "draft only (autoregressive)",
    "deepmind": "DeepMind speculative sampling (Chen et al. 2023)",
    "google": "Google speculative sampling (Leviathan et al. 2023)",
}
LOOKUP_HELP = {"max_ngram": "prompt lookup matches suffixes of up to N tokens first, then shorter ones",
               "max_tokens": "prompt lookup proposes up to N tokens per round",
               "min_match": "--drafter lookup proposes on a match of N tokens or more",
               "hybrid_min_match": "--drafter hybrid hands a position to the lookup on a match of N tokens or more "
                                   "(3, the default, is cut to a shorter --lookup_max_ngram)",
               "extend": "let a hybrid round mix the drafters (the lookup continuing the draft model's run)"}
DRAFTER_TITLES = {"model": "the draft model proposing", "lookup": "prompt lookup proposing",
                  "hybrid": "prompt lookup where it matches, the draft model elsewhere"}
# source -> (plain-text mark, ANSI colour, legend text)
SOURCE_STYLES = {
    "draft": ("d", "32", "draft token accepted by the target"),
    "lookup": ("l", "36", "prompt-lookup token accepted by the target"),
    "grammar": ("g", "90", "token the grammar forced, accepted by the target"),
    "resampled": ("r", "34", "resampled by the target after a rejection"),
    "bonus": ("b", "35", "bonus token from the target (all proposals accepted)"),
    "target": ("t", "33", "sampled by one model alone (target or draft only)"),
}


def _checked(convert, test, message):
    """An argparse type: convert, then check, with a one-line message on failure."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{message}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{message}, got {text}")
        return value
    return parse


def _sampling_flag(name: str, convert, message: str):
    """An argparse type for a sampling parameter: converted here, checked by SamplingParams (the one place that
    knows the bounds), so a bad value is one line naming the flag."""
    def valid(value) -> bool:
        try:
            SamplingParams(**{name: value})
        except SpecDecError:
            return False
        return True
    return _checked(convert, valid, message)


def _gamma(text):
    if text in ("auto", "adaptive"):  # the service's settings and requests say "adaptive"
        return None
    return _sampling_flag("gamma", int, f"must be an integer from 1 to {MAX_GAMMA}, or auto (adaptive)")(text)


def _confidence(text):
    if text == "auto":  # resolved once the models are named (run): the service's default too
        return None
    return _sampling_flag("draft_confidence_threshold", float, "must be a number from 0 to 1, or auto")(text)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line (and a pointer to --help) instead of the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "main.py") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Speculative decoding on one prompt: completions, "
                                     "stats, and optionally a speed table.")
    parser.add_argument("--input", default=DEFAULT_INPUT, help="the prompt text")
    parser.add_argument("--target_model_name", default=None, metavar="NAME",
                        help="target: hub id, model folder, .gguf file or alias (default: the default pair's)")
    parser.add_argument("--approx_model_name", "--draft_model_name", dest="draft_model_name", default=None,
                        metavar="NAME",
                        help="draft: hub id, model folder, .gguf file or alias (default: the default pair's)")
    parser.add_argument("--method", default="all", choices=("all",) + ALL_ORDER,
                        help="decoding method; all runs target, draft, deepmind and google in turn, then google with "
                             "the other drafters (default)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="mark each token by its source (coloured on a terminal) and log progress")
    parser.add_argument("-s", "--seed", type=_checked(int, lambda s: 0 <= s <= SEED_MAX,
                                                      f"must be an integer from 0 to {SEED_MAX}"),
                        default=None, help="random seed, shared by all methods (default: random)")
    parser.add_argument("-M", "--max_tokens", type=_sampling_flag("max_new_tokens", int, "must be an integer >= 1"),
                        default=20, help="tokens to generate (default 20)")
    parser.add_argument("-g", "--gamma", type=_gamma, default=4,
                        help="draft tokens proposed per round, or auto for adaptive (default 4)")
    parser.add_argument("--drafter", default=SamplingParams.drafter, choices=DRAFTERS,
                        help="who proposes: the draft model, prompt lookup, or hybrid (lookup where it matches, the "
                             f"model elsewhere); --method all adds google with the others (default "
                             f"{SamplingParams.drafter})")
    parser.add_argument("--verification", default=SamplingParams.verification, choices=VERIFICATIONS,
                        help="token (token by token) or block (the block jointly, Sun et al. 2025) (default "
                             f"{SamplingParams.verification})")
    parser.add_argument("--draft_confidence_threshold", default=None, type=_confidence,
                        metavar="P", help="the draft model ends its run before gamma after a token it gave a "
                                          "probability below P (softmax of its logits, before temperature and "
                                          "top-k/top-p); 0 never; auto (default), as the service: "
                                          f"{CONFIDENCE_THRESHOLD:g} for the default pair, 0 for others")
    for field, flag in LOOKUP_KEYS.items():
        default = getattr(LookupSettings, field)
        if isinstance(default, bool):
            parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=default,
                                help=f"{LOOKUP_HELP[field]} (default {'on' if default else 'off'})")
        else:
            parser.add_argument(f"--{flag}", type=_checked(int, lambda n: n >= 1, "must be an integer >= 1"),
                                default=default, metavar="N", help=f"{LOOKUP_HELP[field]} (default {default})")
    parser.add_argument("--temperature", type=_sampling_flag("temperature", float, f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}"),
                        default=1.0, help="0 is greedy (default 1.0)")
    parser.add_argument("--top_k", type=_sampling_flag("top_k", int, "must be an integer >= 0"), default=20,
                        help="keep the k most likely tokens, 0 keeps all (default 20, as the earlier tool)")
    parser.add_argument("--top_p", type=_sampling_flag("top_p", float, "must be in (0, 1]"), default=0.9,
                        help="nucleus sampling mass (default 0.9, as the earlier tool)")
    for name, what in (("presence_penalty", "subtracted from the logit of every token already generated"),
                       ("frequency_penalty", "times a token's count among those generated, subtracted from its "
                                             "logit")):
        parser.add_argument(f"--{name}", type=_sampling_flag(name, float, f"must be a number from {-MAX_PENALTY:g} "
                                                                          f"to {MAX_PENALTY:g}"),
                            default=0.0, metavar="X", help=f"{what} (OpenAI's; default 0)")
    low, high = REPETITION_PENALTY_BOUNDS
    parser.add_argument("--repetition_penalty", type=_sampling_flag("repetition_penalty", float,
                                                                    f"must be a number from {low:g} to {high:g}"),
                        default=1.0, metavar="X", help="a token in the prompt or the output has a positive logit "
                                                       "divided by X and a negative one multiplied (transformers'; "
                                                       "default 1, none). Outputs follow the penalized target exactly")
    parser.add_argument("--min_tokens", type=_checked(int, lambda n: n >= 0, "must be an integer >= 0"), default=0,
                        metavar="N", help="generate at least N tokens: the end-of-sequence tokens are masked until "
                                          "then (vLLM's; default 0, at most --max_tokens)")
    parser.add_argument("--chat", action="store_true", help="wrap the input in the target's chat template")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", "--json_schema", dest="json_schema", metavar="FILE", default=None,
                            help="constrain the output to JSON following the schema in FILE (every method; the "
                                 "grammar's forced tokens are proposed for free)")
    constraint.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, "
                        "float16 or bfloat16")
    parser.add_argument("--draft_quantization", default="auto", type=str.lower,
                        choices=("auto", "int8", "int4", "none"),
                        help="auto (default): int4 for the default pair's shipped draft, int8 for others. "
                             "int8: a draft on CPU runs int8-quantized (loaded in float32, also beside a "
                             "bfloat16 target), 2.5-3x cheaper; a draft from a GGUF file keeps its own weights. "
                             "int4: 4-bit groups for the grouped CPU kernel (a GGUF draft's wider layers "
                             "requantized). Outputs stay exactly the target's. none: the draft as loaded")
    parser.add_argument("--draft_vocab_size", default="auto",
                        help="auto (default: 65536 for the default pair, else the whole vocabulary), 0 (the whole "
                             "vocabulary) or N: the draft proposes among its first N token ids and the special "
                             "tokens only; outputs stay exactly the target's")
    parser.add_argument("--weights", default="shipped", type=str.lower, choices=("shipped", "float"),
                        help="shipped (default): a model from a GGUF file (the default pair) computes with the GGUF's "
                             "own 4- and 8-bit weights on CPU; float: weights dequantized to float")
    parser.add_argument("--quantize", default="none", type=str.lower, choices=("none", "int4", "int8"),
                        help="none (default); int4 or int8: a float model (not a GGUF one) has its linear layers "
                             "quantized per group of 32 for the grouped CPU kernel; on CUDA, int4 uses torch's int4 "
                             "kernel (a GGUF's Q4_K layers as shipped). This changes the model")
    parser.add_argument("--compile", default="auto", type=str.lower, choices=("auto", "true", "false"),
                        help="the compiled static-cache path (torch.compile of each model's forwards of 1-17 tokens, "
                             "compiled at start-up): auto (default) is on for CUDA, off on CPU")
    parser.add_argument("--device_map", default="none",
                        help="none (default): the target on --device; auto, balanced, balanced_low_0 or sequential: "
                             "accelerate spreads it over the GPUs")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow models' own code from the hub")
    parser.add_argument("-b", "--benchmark", action="store_true",
                        help="also time each method a few times (after one untimed warm-up each) and print tokens/s "
                             "and speedup over target only")
    parser.add_argument("--repeats", type=_checked(int, lambda n: n >= 1, "must be an integer >= 1"), default=3,
                        help="runs per method for --benchmark (default 3)")
    return parser


def use_color(stream=None, environ=None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    stream = sys.stdout if stream is None else stream
    environ = os.environ if environ is None else environ
    return not environ.get("NO_COLOR") and hasattr(stream, "isatty") and stream.isatty()


def render_sources(pieces: list[str], sources: list[str], color: bool) -> str:
    """Tokens marked by source: ANSI colours, or `[d:text]`-style marks where colour is off, one a token (`[d:]`
    for a token with no text of its own: a special token, or the first bytes of a character a later one completes,
    so that the marks count the stats line's tokens)."""
    out = []
    for piece, source in zip(pieces, sources):
        mark, code, _ = SOURCE_STYLES[source]
        if color:
            if piece:
                out.append(f"\x1b[{code}m{piece}\x1b[0m")
        else:
            out.append(f"[{mark}:{piece}]")
    return "".join(out)


def legend(sources, color: bool) -> str:
    entries = []
    for source in sources:
        mark, code, text = SOURCE_STYLES[source]
        entries.append(f"\x1b[{code}m{text}\x1b[0m" if color else f"[{mark}:...] {text}")
    return "legend: " + "; ".join(entries)


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def stats_line(stats: GenerationStats) -> str:
    """Tokens, tokens/s (generated tokens only), acceptance rate, tokens per target forward."""
    return (f"{stats.new_tokens} tokens | {_number(stats.tokens_per_second, '.2f')} tokens/s | "
            f"acceptance {_number(stats.acceptance_rate, '.2f')} | "
            f"{_number(stats.tokens_per_target_forward, '.2f')} tokens per target forward")


def sampling_params(args, method: str, seed: int, drafter: str | None = None) -> SamplingParams:
    """The flags' SamplingParams; a combination it refuses (--min_tokens over --max_tokens) is a SpecDecError
    naming the flag."""
    try:
        return SamplingParams(max_new_tokens=args.max_tokens, method=method, gamma=args.gamma,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
                              drafter=drafter or args.drafter, verification=args.verification,
                              draft_confidence_threshold=args.draft_confidence_threshold,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens)
    except SpecDecError as error:
        message = error.message.replace("max_new_tokens", "--max_tokens")
        raise SpecDecError(f"--{error.field}: {message}", field=error.field) from None


def decodings(args) -> list[tuple[str, str, str]]:
    """(label, method, drafter) of each decoding to run: the chosen method with --drafter, or with --method all
    every method, then google with each other drafter (labelled google+lookup, google+hybrid, ...)."""
    if args.method != "all":
        return [(args.method, args.method, args.drafter)]
    runs = [(method, method, args.drafter) for method in ALL_ORDER]
    return runs + [(f"google+{drafter}", "google", drafter) for drafter in DRAFTERS if drafter != args.drafter]


def title(label: str, method: str, drafter: str) -> str:
    return TITLES[method] + (f", {DRAFTER_TITLES[drafter]}" if "+" in label else "")


def benchmark(decoder, prompt, runs, args, seed: int, grammar=None) -> list[dict]:
    """Each (label, method, drafter) once untimed (its first decode pays one-time costs: first forwards at each
    width, kernel and allocator warm-up, which would otherwise fall on whichever method the completions above did
    not run), then `args.repeats` times timed (seeds seed, seed+1, ..., modulo 2**64): generated tokens/s and
    speedup over target."""
    rows = []
    for label, method, drafter in runs:
        def decode(i: int):
            return decoder.generate(prompt, params=sampling_params(args, method, (seed + i) % (SEED_MAX + 1), drafter),
                                    grammar=grammar).stats

        decode(args.repeats)  # the warm-up, on a seed of its own
        rows.append({"method": label, **summed([decode(i) for i in range(args.repeats)])})
    baseline = next(row["tokens_per_second"] for row in rows if row["method"] == "target")
    for row in rows:
        speed = row["tokens_per_second"]
        row["speedup"] = speed / baseline if speed and baseline else None
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'method':<14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'speedup':>8} {'acceptance':>11}"]
    for row in rows:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(f"{row['method']:<14} {row['tokens']:>7} {row['seconds']:>8.2f} "
                     f"{_number(row['tokens_per_second'], '.2f'):>9} {speedup:>8} "
                     f"{_number(row['acceptance_rate'], '.2f'):>11}")
    return "\n".join(lines)


def lookup_settings(args) -> LookupSettings:
    """The lookup flags as LookupSettings; a SpecDecError naming the flag where they do not fit together."""
    try:
        return LookupSettings(**{field: getattr(args, flag) for field, flag in LOOKUP_KEYS.items()})
    except SpecDecError as error:
        flag = LOOKUP_KEYS.get(error.field, error.field)
        raise SpecDecError(f"--{flag}: {error.message}", field=flag) from None


def read_constraint(args):
    """The grammar.Constraint of --json-schema FILE (read and parsed) or --regex; None without either. Before the
    models load, so that a missing file, bad JSON or a combination the engine refuses ends the run at once."""
    from .grammar import Constraint

    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as file:
                schema = json.load(file)
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise SpecDecError(f"--json-schema: cannot read {args.json_schema}: {reason}", field="json_schema") from None
        except json.JSONDecodeError as error:
            raise SpecDecError(f"--json-schema: {args.json_schema} is not JSON: {error}", field="json_schema") from None
        constraint = Constraint.json_schema(schema, field="json_schema")
    elif args.regex is not None:
        constraint = Constraint("regex", args.regex, field="regex")
    else:
        return None
    if args.min_tokens:
        raise SpecDecError(f"--min_tokens cannot be combined with --{constraint.field.replace('_', '-')}, whose "
                           "grammar decides where the output ends", field="min_tokens")
    return constraint


def compile_constraint(constraint, tokenizer, vocab_size: int):
    """A constraint (read_constraint's) compiled for the tokenizer; None for None."""
    from .grammar import GrammarCompiler

    if constraint is None:
        return None
    try:
        return GrammarCompiler(tokenizer, vocab_size).compile(constraint)
    except SpecDecError as error:
        raise SpecDecError(f"--{constraint.field.replace('_', '-')}: {error.message}", field=error.field) from None


def run(args, out=None) -> int:
    """Load the pair, decode with each method, print; errors propagate to main."""
    from .engine import SpeculativeDecoder
    from .models.pair import load_pair

    out = sys.stdout if out is None else out
    if args.draft_confidence_threshold is None:  # auto
        from .models.sources import auto_confidence_threshold

        args.draft_confidence_threshold = auto_confidence_threshold(args.draft_model_name, args.target_model_name)
    lookup = lookup_settings(args)  # checked before the models load
    sampling_params(args, "google", 0)  # the flags' combinations too
    if not args.input:
        raise SpecDecError("the input is empty", field="input")
    constraint = read_constraint(args)
    draft, target, tokenizer = load_pair(args.draft_model_name, args.target_model_name, device=args.device,
                                         dtype=args.dtype, device_map=args.device_map,
                                         trust_remote_code=args.trust_remote_code,
                                         draft_quantization=args.draft_quantization, compile=args.compile,
                                         weights=args.weights, quantize=args.quantize,
                                         draft_vocab_size=args.draft_vocab_size)
    decoder = SpeculativeDecoder(draft, target, tokenizer, lookup=lookup)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise SpecDecError("the target's tokenizer has no chat template; drop --chat", field="chat")
    prompt = encode_prompt(tokenizer, args.input, args.chat)
    grammar = compile_constraint(constraint, tokenizer, decoder.vocab_size)
    decode = decoder_of(tokenizer)
    runs = decodings(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)  # one seed for all methods
    color = use_color(out)

    if args.verbose:
        print(f"prompt: {len(prompt)} tokens, seed {seed}, gamma {'auto' if args.gamma is None else args.gamma}, "
              f"temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p}, drafter {args.drafter}, "
              f"verification {args.verification}, draft confidence threshold {args.draft_confidence_threshold:g}",
              file=out)
        print(legend(SOURCE_STYLES, color), file=out)
    for label, method, drafter in runs:
        result = decoder.generate(prompt, params=sampling_params(args, method, seed, drafter), grammar=grammar)
        print(f"== {label}: {title(label, method, drafter)} ==", file=out)
        if args.verbose:
            print(render_sources(token_pieces(decode, result.token_ids, prompt), result.sources, color), file=out)
        else:
            print(decode(result.token_ids), file=out)
        print(stats_line(result.stats), file=out)

    if args.benchmark:
        bench_runs = [("target", "target", args.drafter)] + [run for run in runs if run[0] != "target"]
        print(f"== benchmark: {args.repeats} runs per method, {args.max_tokens} tokens each ==", file=out)
        print(format_table(benchmark(decoder, prompt, bench_runs, args, seed, grammar)), file=out)
    return 0


def main(argv=None, prog: str = "main.py") -> int:
    """Run the command line; returns the exit status (2 for bad input, with one message on stderr)."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # argparse has printed usage and the message (or --help)
        return exit.code if isinstance(exit.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    logging.getLogger("specdec.models.default_pair").setLevel(logging.INFO)  # a first-run conversion shows its progress
    try:
        return run(args)
    except SpecDecError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


def console() -> int:
    """The `specdec` console script."""
    return main(prog="specdec")
