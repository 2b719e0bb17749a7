"""Command-line entry point, compatible with the earlier tool: `python main.py --help`."""

from specdec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
