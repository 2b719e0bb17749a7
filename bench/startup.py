"""Start-up profile: load a pair as the service does (load_pair, then a two-token greedy warm-up) and report, for
each step that loading logs, its seconds, the resident memory after it and the peak during it.

    .venv/bin/python -m bench.startup                 # the default pair, files as they are in the page cache
    .venv/bin/python -m bench.startup --cold          # evict the pair's files from the page cache first
    .venv/bin/python -m bench.startup --json out.json

Linux only: resident memory is VmRSS from /proc/self/status, and the peak of each step is VmHWM, reset between
steps through /proc/self/clear_refs. Run one at a time: the default pair needs several GB while loading.
"""

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

GB = 1e9


def memory() -> dict:
    """The process's resident memory now and its peak since the last `reset_peak`, in bytes."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def cpu_seconds() -> float:
    """CPU time of the whole process (all threads, user and system): the work, where wall time also counts
    waiting for a CPU on a busy machine."""
    times = os.times()
    return times.user + times.system


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current VmRSS
    except OSError:
        pass  # the peak is then the process's peak so far


def evict(paths) -> int:
    """Drop the files under `paths` from the page cache (posix_fadvise DONTNEED); returns the bytes evicted."""
    evicted = 0
    for root in paths:
        for path in Path(root).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd) if os.access(path, os.W_OK) else None
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                evicted += path.stat().st_size
    return evicted


class StepRecorder(logging.Handler):
    """One row per INFO record of the `specdec` loggers: the seconds since the previous row, memory after, peak."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.rows: list[dict] = []
        self.last, self.last_cpu = time.perf_counter(), cpu_seconds()
        reset_peak()

    def mark(self, step: str) -> None:
        now, cpu, mem = time.perf_counter(), cpu_seconds(), memory()
        self.rows.append({"step": step, "seconds": now - self.last, "cpu_seconds": cpu - self.last_cpu,
                          "rss": mem["VmRSS"], "peak": mem["VmHWM"], "anon": mem["RssAnon"], "file": mem["RssFile"]})
        self.last, self.last_cpu = now, cpu
        reset_peak()

    def emit(self, record: logging.LogRecord) -> None:
        self.mark(record.getMessage())


def weight_bytes(model) -> int:
    """The bytes a model's weights take as used: parameters and buffers, and int8 layers' packed weights."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() * weight.element_size()  # int8 values (scales: a few KB)
            total += 0 if bias is None else bias.numel() * bias.element_size()
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None)
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-quantization", default="int8")
    parser.add_argument("--cold", action="store_true", help="evict the pair's files from the page cache first")
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    import torch

    from specdec import SpeculativeDecoder, load_pair
    from specdec.models.sources import resolve_source

    evicted = 0
    if args.cold:
        evicted = evict({resolve_source(args.draft, "draft").path, resolve_source(args.target, "target").path})
    recorder = StepRecorder()
    logging.getLogger("specdec").addHandler(recorder)
    started = time.perf_counter()
    recorder.mark("start (imports done)")
    draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                                         draft_quantization=args.draft_quantization)
    load_seconds = time.perf_counter() - started
    recorder.mark("load_pair returned")
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    decoder.generate(tokenizer.encode("Hello", add_special_tokens=False)[:1] or [0], max_new_tokens=2,
                     method="google", gamma=4, temperature=0)
    recorder.mark("warm-up (2 greedy tokens)")
    total_seconds = time.perf_counter() - started
    logging.getLogger("specdec").removeHandler(recorder)

    weights = weight_bytes(draft) + weight_bytes(target)
    steady = memory()["VmRSS"]
    # clear_refs resets ru_maxrss too: the peak is the highest of the steps' peaks
    peak = max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024] + [row["peak"] for row in recorder.rows])
    load = os.getloadavg()[0]
    report = {"command_line": " ".join(["python -m bench.startup", *(argv if argv is not None else sys.argv[1:])]),
              "load_average_1min": load, "cold": args.cold, "evicted_bytes": evicted,
              "torch_threads": torch.get_num_threads(), "load_pair_seconds": load_seconds,
              "ready_seconds": total_seconds, "weights_bytes": weights, "steady_rss": steady, "peak_rss": peak,
              "steady_over_weights": steady / weights, "peak_over_steady": peak / steady, "steps": recorder.rows}
    print("| step (the log line that ends it) | s | CPU s | RSS after (GB) | peak during (GB) | anon | file |")
    print("|---|---|---|---|---|---|---|")
    for row in recorder.rows:
        print(f"| {row['step'][:100]} | {row['seconds']:.2f} | {row['cpu_seconds']:.2f} | {row['rss'] / GB:.2f} "
              f"| {row['peak'] / GB:.2f} | {row['anon'] / GB:.2f} | {row['file'] / GB:.2f} |")
    print(f"\nload_pair {load_seconds:.1f} s, ready (warm-up included) {total_seconds:.1f} s; weights as used "
          f"{weights / GB:.2f} GB; steady RSS {steady / GB:.2f} GB ({steady / weights:.2f}x weights); peak "
          f"{peak / GB:.2f} GB ({peak / steady:.2f}x steady); 1-minute load average {load:.1f} on "
          f"{os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
