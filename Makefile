# The two quick-start commands: `make bench` (the main job) and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: bench test lint

bench:
	bash tools/ci/setup_env.sh
	$(PYTHON) -m epcomm.bench $(ARGS)

test:
	bash tools/ci/setup_env.sh
	$(PYTHON) -m ruff check epcomm tests tools shim
	bash tools/ci/compile_kernels.sh
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

lint:
	$(PYTHON) -m ruff check epcomm tests tools shim
