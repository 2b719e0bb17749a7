"""The specdec HTTP service: `create_app` (an application factory for gunicorn), and `python serving.py`.

`python serving.py` replaces itself with gunicorn configured by config/gunicorn.conf.py (which checks the
configuration), which calls `serving:create_app()` in its worker: the models load there, after fork.
The application itself lives in specdec/service.py.
"""

import os
import sys

__all__ = ["create_app"]

ROOT = os.path.dirname(os.path.abspath(__file__))
GUNICORN_CONF = os.path.join(ROOT, "config", "gunicorn.conf.py")


def __getattr__(name):
    # `create_app` is imported on first use, so `python serving.py` does not load torch before exec'ing gunicorn
    if name == "create_app":
        from specdec.service import create_app

        return create_app
    raise AttributeError(f"module 'serving' has no attribute {name!r}")


def main(argv: list[str]) -> None:
    """Start gunicorn; extra arguments go to gunicorn (e.g. `python serving.py --log-level debug`).

    The configuration is checked by config/gunicorn.conf.py as gunicorn starts: a bad one stops it there.
    """
    os.execv(sys.executable, [sys.executable, "-m", "gunicorn", "--config", GUNICORN_CONF, "--chdir", ROOT,
                              *argv, "serving:create_app()"])


if __name__ == "__main__":
    main(sys.argv[1:])
