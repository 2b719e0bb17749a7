"""The HTTP service around one resident SpeculativeDecoder: `create_app` for gunicorn, `main` for
`specdec-serve`.

    app.py        the application factory         routes.py      the Blueprint of routes
    protocol.py   request models and parsing      errors.py      error answers
    config.py     settings                        service.py     a request's path: encode, queue, generate
    loader.py     loading the pair                generation.py  driving one generation, JSON or SSE
    scheduler.py  one at a time, bounded queue    metrics.py     Prometheus
    openapi.py    /openapi.json from the models   server.py      gunicorn
    openai_protocol.py  OpenAI's shapes (/v1)       openai_routes.py  the /v1 Blueprint
"""

__all__ = ["create_app"]


def __getattr__(name):
    # the application (Flask, the engine, torch) is imported when first asked for: gunicorn's config reads the
    # settings (serve.config) in the master, and only the worker needs the rest
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'specdec.serve' has no attribute {name!r}")
