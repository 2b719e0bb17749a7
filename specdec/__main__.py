"""`python -m specdec`: the command line (see specdec.cli)."""

from .cli import main

raise SystemExit(main(prog="python -m specdec"))
