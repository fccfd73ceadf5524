# Every target installs what it needs first (scripts/ensure-deps.sh is idempotent).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: deps peers cluster demo demo-host test unit vm-test lint proto proto-check settings settings-check bench bench-build clean help

help:
	@echo "make demo     build the node image, provision a racked server with it, attest, check, join a real cluster"
	@echo "              (DEMO_ARGS=--ipxe: through iPXE and the imager; DEMO_ARGS='--image F --build-key P': a signed build)"
	@echo "make demo-host  the same agent steps on the host against swtpm, no image or VM (seconds)"
	@echo "make test     lint, type-check and run every test tier (starts and stops the services it needs)"
	@echo "make vm-test  only the VM tier (vm-tests/)"
	@echo "make lint     ruff and mypy (strict)"
	@echo "make proto    regenerate protocol/_gen from protocol/proto"
	@echo "make settings regenerate docs/settings.md and its JSON Schemas from the settings tables"
	@echo "make bench    run the benchmarks in bench/ and print their figures"
	@echo "make bench-build  full vs incremental image build of the fixture (VMs, root, libvirtd; minutes)"
	@echo "make peers    build the pinned upstream test peers (interop/) into ~/.cache/nodetrust/peers; a no-op when built"
	@echo "make cluster  start a real Kubernetes control plane on this machine and print its kubeconfig"

deps:
	@scripts/ensure-deps.sh

peers:
	@interop/build.sh

cluster: deps peers
	$(PY) scripts/cluster.py $(CLUSTER_ARGS)

lint: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy protocol agent server imagebuilder imager tests bench scripts vm-tests fixtures

proto: deps
	$(PY) scripts/genproto.py

proto-check: deps
	$(PY) scripts/genproto.py --check

settings: deps
	$(PY) scripts/gensettings.py

settings-check: deps
	$(PY) scripts/gensettings.py --check

test: deps  # run-tests.sh builds the peers in the background: the VM tier needs them only for its last tests
	scripts/run-tests.sh all

unit: deps
	scripts/run-tests.sh fast

vm-test: deps  # the VM tier builds the peers it needs (interop/build.sh) when they are not built
	scripts/run-tests.sh vm

demo: deps peers
	$(PY) scripts/demo.py $(DEMO_ARGS)

demo-host: deps
	$(PY) scripts/demo.py --host-only

bench: deps peers
	$(PY) bench/attest.py
	$(PY) bench/join.py
	$(PY) -m bench.store
	$(PY) -m bench.check
	$(PY) -m bench.flood

bench-build: deps
	scripts/services.sh start
	$(PY) -m bench.build

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache
