"""`specdec-serve` and `python serving.py`: replace this process with gunicorn, configured by
config/gunicorn.conf.py (which checks the specdec configuration), serving `serving:create_app()`.

gunicorn calls the factory in its worker, so the models load there, after fork.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUNICORN_CONF = ROOT / "config" / "gunicorn.conf.py"


def main(argv: list[str] | None = None) -> None:
    """Start gunicorn; extra arguments go to gunicorn (e.g. `specdec-serve --log-level debug`)."""
    argv = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "gunicorn", "--config", str(GUNICORN_CONF), "--chdir", str(ROOT),
                              *argv, "serving:create_app()"])
