"""The grouped kernel's AMX path against its VNNI path, on the default pair with shipped weights: ms per forward
of each model over n new tokens after 300 cached ones (what a draft step, a target step and verifications of
several widths cost), with the kernel's AMX path on and off.

    python -m bench.amx --out bench/results/amx

The two paths give the same bits (tests/test_grouped.py), so only time differs. Each repeat times every model,
path and width once, interleaved, so the machine's drift falls on all alike; medians over repeats. Where the
CPU has no AMX both columns are the VNNI path's (the report says which). Writes results.json and results.md.
"""

import argparse
import time

WIDTHS = (1, 2, 5, 8, 12, 16)


def forward_ms(forwards: dict, configs: dict, widths=WIDTHS, repeats=12) -> dict:
    """{"<role>-<amx|vnni>-<n>": median ms} (`bench.forwards.forward_ms_by_path`), the AMX path on and off."""
    import torch

    from bench.forwards import forward_ms_by_path

    def use(on: bool):
        return lambda role: torch.ops.specdec_grouped.amx(on)

    try:
        return forward_ms_by_path(forwards, configs, {"vnni": use(False), "amx": use(True)}, widths, repeats)
    finally:
        torch.ops.specdec_grouped.amx(True)


def report(ms: dict, amx: bool, command: str, when: str, threads: int) -> tuple[dict, str]:
    from bench.machine import machine_info

    machine = machine_info()
    widths = sorted({int(key.rsplit("-", 1)[1]) for key in ms})
    lines = [f"# The grouped kernel's AMX path against its VNNI path, {when}", "", f"Command: `{command}`", "",
             f"Machine: {machine.get('cpu')}, cores {machine.get('cores')}, torch threads {threads}; AMX "
             f"{'usable' if amx else 'not usable here: both columns are the VNNI path'}", "",
             "Default pair, shipped weights; ms per forward over n new tokens after 300 cached ones (median; each "
             "model's paths and widths interleaved). Ratios: VNNI / AMX, and the forward against one token's.", "",
             "| model | tokens | VNNI ms | AMX ms | VNNI / AMX | VNNI / 1 token | AMX / 1 token |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for role in ("draft", "target"):
        one = ms[f"{role}-vnni-1"]
        for n in widths:
            vnni, tiles = ms[f"{role}-vnni-{n}"], ms[f"{role}-amx-{n}"]
            summary[f"{role}-{n}"] = {"vnni_ms": vnni, "amx_ms": tiles, "speedup": vnni / tiles}
            lines.append(f"| {role} | {n} | {vnni:.1f} | {tiles:.1f} | {vnni / tiles:.2f}x | {vnni / one:.2f} | "
                         f"{tiles / one:.2f} |")
    return {"forward_ms": ms, "amx": amx, "summary": summary}, "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch

    from bench.machine import command_line, save_results
    from specdec.cpu.grouped import grouped_kernel
    from specdec.fused_forward import fused_forward
    from specdec.models.pair import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/amx")
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    draft, target, _ = load_pair(device="cpu", weights="shipped")
    forwards = {"draft": fused_forward(draft), "target": fused_forward(target)}
    if not grouped_kernel() or any(forward is None for forward in forwards.values()):
        raise SystemExit("the grouped kernel is not built here, or the pair is not grouped")
    ms = forward_ms(forwards, {"draft": draft.config, "target": target.config}, repeats=args.repeats)
    command = command_line("bench.amx", argv)
    record, markdown = report(ms, bool(torch.ops.specdec_grouped.amx()), command, when, args.threads)
    save_results(args.out, {"command": command, "when": when, **record}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
