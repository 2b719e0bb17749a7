"""The benchmark's plot: each method's speedup over our target-only, one panel per prompt set, as a PNG."""

from pathlib import Path


def plottable(report: dict) -> bool:
    """Whether the plot has anything to show: some method's speedup over our target-only, which a run without
    target-only (a block-gain run of model-token alone, say) does not have."""
    return any(row.get("speedup_vs_target") for modes in report["summary"].values() for block in modes.values()
               for row in block["methods"].values())


def plot(report: dict, path: Path) -> None:
    """One panel per prompt set: each method's median speedup over our target-only (bars, one per mode), every
    prompt's own (dots), and the Leviathan bound of model drafting (dashed, per mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["summary"])
    fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 5.6), squeeze=False)
    colours = {"greedy": "tab:blue", "sampling": "tab:orange", "t0.7": "tab:green"}
    for ax, set_name in zip(axes[0], sets):
        modes = list(report["summary"][set_name])
        methods = [m for m in dict.fromkeys(m for mode in modes for m in report["summary"][set_name][mode]["methods"])
                   if m not in ("target", "draft")]
        width = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            rows = report["summary"][set_name][mode]["methods"]
            xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(methods))]
            medians = [rows.get(m, {}).get("prompt_speedup_vs_target") or rows.get(m, {}).get("speedup_vs_target")
                       or 0 for m in methods]
            ax.bar(xs, medians, width, color=colours.get(mode), alpha=0.75, label=f"{mode} (median)")
            for x, m in zip(xs, methods):
                spread = rows.get(m, {}).get("prompt_speedups_vs_target") or []
                ax.scatter([x] * len(spread), spread, s=8, color="black", alpha=0.5, zorder=3)
            bound = next((row["leviathan_bound"] for m, row in rows.items() if row.get("leviathan_bound")), None)
            if bound:
                ax.axhline(bound, color=colours.get(mode), linestyle="--", linewidth=1.2,
                           label=f"Leviathan bound, model drafting ({mode}): {bound:.2f}x")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right")
        ax.set_ylabel("speedup over our target-only (per prompt)")
        ax.set_title(f"{set_name} prompts ({report['prompts'][set_name] if isinstance(report['prompts'], dict) else report['prompts']}"
                     f", {report['max_new_tokens']} tokens)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)  # below: bars reach the top
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
