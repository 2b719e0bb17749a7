"""The command that prepares the default pair in the cache (`make models`, the image, the Kubernetes init
container); the work is specdec.models.default_pair's.

    python -m specdec.default_pair prepare [--force | --quick]   # join, verify, convert what is missing
    python -m specdec.default_pair status                        # what the cache holds
"""

import argparse
import logging
import sys

from .errors import SpecDecError
from .models import default_pair
from .models.cache import int8_form_path, shipped_form_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.default_pair",
                                     description="Prepare the default pair in the cache.")
    parser.add_argument("command", choices=("prepare", "status"),
                        help="prepare: join, verify and convert what is missing; status: show the cache")
    parser.add_argument("--force", action="store_true", help="convert again even if the cache is complete")
    parser.add_argument("--quick", action="store_true",
                        help="prepare: where the pair is converted and the int8 draft's form is there, stop without "
                             "checking the form's key (make serve: loading checks it, and rebuilds a stale one)")
    args = parser.parse_args(argv)
    if args.quick and args.force:
        parser.error("--quick and --force exclude each other")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for source in (default_pair.TARGET, default_pair.DRAFT):
            folder = default_pair.model_dir(source)
            if args.command == "prepare":
                folder = default_pair.prepare_model(source, force=args.force)
                print(f"{source.role}: {folder} ready")
                if source is default_pair.DRAFT and args.quick and default_pair.int8_form_present(folder):
                    print(f"draft: its int8 form is in {int8_form_path(folder)} (checked when loaded)")
                elif source is default_pair.DRAFT:
                    from .models.load import keep_int8_draft  # torch: not imported for --quick or status
                    from .models.sources import ModelSource

                    kept = keep_int8_draft(ModelSource(str(folder)))
                    if kept:
                        print(f"draft: its int8 form kept in {kept}")
                # the draft's 4-bit form too: draft_quantization = "auto" serves it (1.05x faster, measured)
                for requantize in (None, 4) if source is default_pair.DRAFT else (None,):
                    what = "GGUF weights" if requantize is None else f"GGUF weights, requantized to {requantize} bits,"
                    if args.quick and shipped_form_path(folder, requantize).is_file():
                        print(f"{source.role}: its {what} are packed in {shipped_form_path(folder, requantize)} "
                              f"(checked when loaded)")
                    else:
                        from .models.shipped import keep_shipped
                        from .models.sources import ModelSource

                        kept = keep_shipped(ModelSource(str(folder)), requantize)
                        if kept:
                            print(f"{source.role}: its {what} packed in {kept}")
            elif not default_pair.is_ready(folder, source):
                print(f"{source.role}: {folder} not prepared")
            else:
                problem = default_pair.integrity_problem(folder)
                print(f"{source.role}: {folder} {'ready' if problem is None else 'damaged: ' + problem}")
    except SpecDecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
