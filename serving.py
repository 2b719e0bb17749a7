"""The specdec HTTP service: `create_app` (an application factory for gunicorn), and `python serving.py`.

`python serving.py` replaces itself with gunicorn configured by config/gunicorn.conf.py (see
specdec/serve/server.py), which calls this factory in its worker: the models load there, after fork.
The application itself lives in specdec/serve/.
"""

import sys

__all__ = ["create_app"]  # noqa: F822 - resolved lazily by __getattr__


def __getattr__(name):
    # `create_app` is imported on first use, so `python serving.py` does not load torch before exec'ing gunicorn
    if name == "create_app":
        from specdec.serve import create_app

        return create_app
    raise AttributeError(f"module 'serving' has no attribute {name!r}")


if __name__ == "__main__":
    from specdec.serve.server import main

    main(sys.argv[1:])
