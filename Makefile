# flatshare-ops: `make demo` runs the main job, `make test` the tests.
# `make profiles` shows drift between the profile and its rendered files
# (exit 1); `make profiles UPDATE=1` rewrites them.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test profiles verify

setup:
	@./scripts/setup.sh

demo: setup
	$(BIN)/flatshare profiles render
	$(BIN)/flatshare profiles verify

test: setup
	$(BIN)/python -m pytest -q

profiles: setup
	@$(BIN)/flatshare profiles render $(if $(UPDATE),--update)

verify: setup
	$(BIN)/flatshare profiles verify
