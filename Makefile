# The two set-up commands of the README.
PY ?= python3

.PHONY: run test lint

# Run the default job (cluster.yml: this machine, two CPU ranks).
run:
	@scripts/bootstrap.sh
	@$(PY) -m invoke launch

# The whole test suite: lint, types, unit and sshd-lab integration tests.
test:
	@scripts/bootstrap.sh --test
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

lint:
	$(PY) -m ruff check .
	$(PY) -m mypy
