"""CPU linear micro-benchmark: ms for a stack of weights of the default target's shapes, by number of input rows,
with `F.linear`, oneDNN-packed weights and the few-rows kernel (specdec/cpu/linear.py).

    python -m bench.linear [--rows 1,4,5,8] [--repeats 7] [--shapes 8960x1536,...] [--stack-mb 600]
                           [--dtype float32|bfloat16]

Each stack holds enough weights (at least 600 MB) that they stream from memory, as in a forward of the target.
Bfloat16 weights and inputs compare F.linear (oneDNN's bfloat16 GEMM) with the kernel; oneDNN packing is float32
only.
Medians over repeats, the best of two interleaved passes; a shared machine drifts by 10-20%, so compare columns
of one run, not runs.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.cpu import linear as cpu_linear

# (out, in) of the default target (Qwen2.5-1.5B): gate and up, down, the output layer
SHAPES = "8960x1536,1536x8960,151936x1536"


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,5,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default=SHAPES, help="out x in of each weight")
    parser.add_argument("--stack-mb", type=float, default=600, help="weights per stack: at least this many MB")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    kernels = {"F.linear": lambda x, w, packed: F.linear(x, w)}
    if cpu_linear.packing_supported() and dtype == torch.float32:
        kernels["oneDNN packed"] = lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                                           [], "")
    if cpu_linear.few_rows_kernel():
        kernels["few-rows"] = lambda x, w, packed: torch.ops.specdec.few_rows_linear(x, w, None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; ms per stack, median of "
          f"{args.repeats}\n")
    print("| weight (out x in) | stack | rows | " + " | ".join(kernels) + " |")
    print("|---|---|---|" + "---|" * len(kernels))
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for out_features, in_features in shapes:
            count = max(1, round(args.stack_mb * 1e6 / (out_features * in_features * dtype.itemsize)))
            weights = [(torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
                       for _ in range(count)]
            packed = ([torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear.PACK_BATCH_HINT) for w in weights]
                      if "oneDNN packed" in kernels else [None] * count)
            for n in rows:
                x = torch.randn(n, in_features, generator=generator).to(dtype)
                best = {}
                for _ in range(2):
                    for label, kernel in kernels.items():
                        ms = median_ms(lambda: [kernel(x, w, p) for w, p in zip(weights, packed)], args.repeats)
                        best[label] = min(ms, best.get(label, ms))
                print(f"| {out_features} x {in_features} | {count} | {n} | " + " | ".join(f"{best[k]:.2f}" for k in kernels) + " |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
