# The two quick-start commands: `make bench` (the main job) and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: bench test lint

bench:
	bash scripts/setup_env.sh
	$(PYTHON) -m epcomm.bench $(ARGS)

test:
	bash scripts/setup_env.sh
	$(PYTHON) -m ruff check epcomm tests scripts
	bash scripts/compile_kernels.sh
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

lint:
	$(PYTHON) -m ruff check epcomm tests scripts
