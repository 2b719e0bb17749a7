"""`specdec-serve` and `python serving.py`: replace this process with gunicorn, configured by
config/gunicorn.conf.py (which checks the specdec configuration), serving `specdec.serve:create_app()` (the
factory serving.py names).

gunicorn calls the factory in its worker, so the models load there, after fork. Both processes stay in the
directory the service was started from, so that a relative path in a setting (SPECDEC_CONFIG, a model folder,
the API keys file) means the same to the master, which checks the settings, and to the worker, which uses them;
the factory comes from the installed package, not from a serving.py in that directory.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUNICORN_CONF = ROOT / "config" / "gunicorn.conf.py"
USAGE = f"""usage: specdec-serve [gunicorn options]   (also: python serving.py)

Starts the specdec service (POST /predict, the OpenAI-compatible /v1 routes) under gunicorn, configured by
{GUNICORN_CONF}. Its settings come from config/default.toml, then the TOML file named by SPECDEC_CONFIG, then
SPECDEC_<KEY> variables (README.md, "Configuration"); host and port are SPECDEC_HOST and SPECDEC_PORT.
Arguments are passed to gunicorn, whose own options follow; the defaults they show (bind, worker class, config
file) are replaced by that configuration's.
"""


def main(argv: list[str] | None = None) -> None:
    """Start gunicorn; extra arguments go to gunicorn (e.g. `specdec-serve --log-level debug`)."""
    argv = sys.argv[1:] if argv is None else argv
    if not GUNICORN_CONF.is_file():  # a wheel installed alone: config/ is the checkout's
        sys.exit(f"specdec-serve: {GUNICORN_CONF} does not exist: the service reads config/ from the project's "
                 "checkout; install it editable there (pip install -e ., as make does)")
    if "-h" in argv or "--help" in argv:
        print(USAGE, flush=True)  # then gunicorn's own options
    os.execv(sys.executable, [sys.executable, "-m", "gunicorn", "--config", str(GUNICORN_CONF), *argv,
                              "specdec.serve:create_app()"])
