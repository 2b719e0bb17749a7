"""What a benchmark's results record beside its figures: the machine it ran on (the CPU, cores, threads, GPU and
versions), the command that reproduces it, and the two files it writes."""

import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers
    from transformers.utils import is_sklearn_available

    # scikit-learn's presence changes HF assisted generation: it then refits its confidence threshold every round
    sklearn = importlib.metadata.version("scikit-learn") if is_sklearn_available() else "absent"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "scikit_learn": sklearn}


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces a run: `python -m <module>` and its arguments (sys.argv's where argv is None)."""
    return f"python -m {module} {' '.join(sys.argv[1:] if argv is None else argv)}".strip()


def save_results(out: str | Path, record: dict, markdown: str) -> None:
    """record as `out`/results.json and markdown as `out`/results.md (the folder made if missing), and the markdown
    printed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1))
    (out / "results.md").write_text(markdown)
    print(markdown)
