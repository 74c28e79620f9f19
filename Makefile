# Build, demo and test pocketflow. `make demo` and `make test` are the two entry points; both run
# `make install` first, which is idempotent and cheap when everything is already in place.

PYTHON ?= python3
CARGO ?= cargo
SERVER_BINARY := servers/target/release/pocketflow-server
PACKAGED_BINARY := pocketflow/_bin/pocketflow-server
DIST_DIR := dist
ADAPTERS := $(wildcard adapters/*/)

.PHONY: all install system-packages python-packages server wheels demo test test-rust lint \
	test-docs test-wheels test-python test-lithops docs clean

all: install

install: system-packages python-packages server

# redis-server and fio are the baselines of the benchmarks; libreadline-dev is what the gg
# adapter's real build (Lua) links. Installed only when missing and root.
system-packages:
	@if command -v redis-server >/dev/null 2>&1 && command -v fio >/dev/null 2>&1 \
			&& dpkg -s libreadline-dev >/dev/null 2>&1; then \
		true; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server fio \
			libreadline-dev; \
	else \
		echo "warning: redis-server, fio or libreadline-dev missing and not root;" \
			"benchmarks and tests needing them skip" >&2; \
	fi

# The core package (with its native client core), then each adapter, a package of its own.
# Then their bytecode, as a wheel install compiles it: editable installs do not, and where
# PYTHONDONTWRITEBYTECODE is set no process ever caches it, so every short-lived task process
# (Lithops starts a fresh one per call) would compile each module it imports again.
python-packages:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	for adapter in adapters/*/; do \
		$(PYTHON) -m pip install --quiet --disable-pip-version-check -e "$$adapter" || exit 1; \
	done
	$(PYTHON) -m compileall -q pocketflow adapters/*/pocketflow_* benchmarks

server:
	cd servers && $(CARGO) build --release --locked
	mkdir -p pocketflow/_bin
	# Copy, then rename: a running server keeps its old binary instead of "text file busy".
	cp $(SERVER_BINARY) $(PACKAGED_BINARY).tmp
	mv -f $(PACKAGED_BINARY).tmp $(PACKAGED_BINARY)

# The core wheel (the native client core and the server binary inside, built by setuptools-rust
# into servers/target, so after `make install` cargo finds both up to date) and one pure-Python
# wheel per adapter, in dist/. Installing them needs no Rust toolchain.
wheels:
	rm -rf $(DIST_DIR) build
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps \
		--wheel-dir $(DIST_DIR) . $(ADAPTERS)

demo: install
	$(PYTHON) -m pocketflow demo

test: install test-rust lint test-docs test-wheels test-python test-lithops

test-rust:
	cd servers && $(CARGO) test --release --locked --workspace
	cd servers && $(CARGO) clippy --release --workspace --all-targets --locked -- -D warnings
	cd servers && $(CARGO) fmt --all --check

lint:
	$(PYTHON) -m ruff check .

# The docs site (mkdocs.yml); --strict turns a broken link or a missing API reference into a
# failure (not with --quiet, which drops the warnings before strict mode counts them). `make
# docs` serves it at http://127.0.0.1:8000 while you edit.
test-docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir build/site

docs:
	$(PYTHON) -m mkdocs serve --dev-addr 127.0.0.1:8000

# The wheels installed into fresh virtualenvs without cargo on PATH: a client round trip from a
# client-only install, then a small demo sort with the cluster and Lithops extras.
test-wheels: wheels
	$(PYTHON) .ci/wheel_smoke.py --dist $(DIST_DIR)

test-python:
	$(PYTHON) -m pytest

# Lithops' own storage, map, call_async and futures tests, run by pytest against the `pocket`
# storage backend on an embedded local cluster; a failing Lithops test fails this target.
test-lithops:
	$(PYTHON) adapters/lithops/run_lithops_tests.py

clean:
	rm -rf $(PACKAGED_BINARY) $(DIST_DIR) build .pytest_cache .ruff_cache
	cd servers && $(CARGO) clean
