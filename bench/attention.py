"""What attending row by row costs: the target's forward over n new tokens after a cached prompt, with our CPU
kernels, its attention row by row (what specdec.cpu.attention does after cached tokens, for bitwise one-by-one
logits) and as one masked call over all new tokens (what it did before), interleaved.

    python -m bench.attention [--target default] [--dtype float32] [--context 400] [--widths 1,5,7] [--repeats 12]

Medians over repeats (the first pass left out). A shared machine drifts by 5-10% between calls, so the width-1
forward, the same call either way, shows the noise.
"""

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from specdec.cpu import attention
from specdec.models.pair import load_pair


@contextlib.contextmanager
def one_masked_call():
    """Attention over all new tokens in one masked call (the plain causal mask not recognised), for comparison."""
    recognise = attention.is_causal_mask
    attention.is_causal_mask = lambda mask, rows, keys: False
    try:
        yield
    finally:
        attention.is_causal_mask = recognise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None)
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--widths", default="1,5,7")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    _, target, _ = load_pair(args.draft, args.target, device="cpu", dtype=args.dtype, draft_quantization="none")
    vocab = target.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    ms: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.randint(0, vocab, (1, args.context), generator=generator), cache=cache, use_cache=True)
        for repeat in range(args.repeats + 1):
            for width in widths:
                for mode in ("row by row", "one masked call"):
                    ids = torch.randint(0, vocab, (1, width), generator=generator)
                    with one_masked_call() if mode == "one masked call" else contextlib.nullcontext():
                        start = time.perf_counter()
                        target(input_ids=ids, cache=cache, use_cache=True)
                        seconds = time.perf_counter() - start
                    cache.crop(-width)
                    if repeat:
                        ms.setdefault((width, mode), []).append(1e3 * seconds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {args.context} cached; "
          f"ms per target forward, median of {args.repeats}\n")
    print("| new tokens | row by row | one masked call | row by row / one call |")
    print("|---|---|---|---|")
    for width in widths:
        row, one = (statistics.median(ms[(width, mode)]) for mode in ("row by row", "one masked call"))
        print(f"| {width} | {row:.1f} | {one:.1f} | {row / one:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
