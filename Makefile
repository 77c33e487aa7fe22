# flatshare-ops: `make demo` runs the main job, `make test` the tests.
# `make profiles` shows drift between the profile and its rendered files
# (make exits 2; 'flatshare profiles render' itself exits 1); `make profiles UPDATE=1` rewrites them.
VENV := .venv
BIN := $(VENV)/bin
# Python writes bytecode here even where the machine's environment says not to: the tests and a release start
# thousands of Python processes, and compiling the package in each one costs about a fifth of their CPU.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test check profiles verify sandbox-down

setup:
	@./scripts/setup.sh

# The main job on the local sandbox fleet (scripts/demo.sh): check the checkout,
# bring cyan and peacock up, release both, serving-check both, print their status.
demo: setup
	@./scripts/vllm-venvs.sh
	@./scripts/demo.sh

# The tests in TEST_PROCESSES parallel processes (pytest-xdist), each group of tests whole in one of them,
# the longest first (tests/conftest.py, "parallel test processes"). TEST_PROCESSES=0 runs them in this one.
# The 25 slowest are listed at the end: where the suite's time goes, in every run.
TEST_PROCESSES ?= 4
test: setup
	@./scripts/vllm-venvs.sh
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadgroup --no-loadscope-reorder --durations=25

# The inner loop (about 40 s on 2 CPUs, once vLLM's venvs are built): ruff on the whole tree, mypy on the files pyproject.toml's
# [tool.mypy] names (about 10 s), then the tests that need no sandbox, no engine and no machine (pure cores, fake connections,
# the CLI's conventions, the rendered files' drift).
# `make test` runs them too, with everything else.
CHECK_TESTS := tests/test_analysis.py tests/test_commands.py tests/test_durable.py tests/test_engine_output.py \
	tests/test_golden.py tests/test_plan.py tests/test_profile.py tests/test_report.py tests/test_rollout_decisions.py \
	tests/test_layout.py tests/test_cli_conventions.py tests/test_make_profiles.py tests/test_node_answers.py \
	tests/test_node_manager.py tests/test_canary_clock.py
check: setup
	@./scripts/vllm-venvs.sh
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 $(CHECK_TESTS)

sandbox-down: setup
	$(BIN)/flatshare sandbox down

profiles: setup
	@$(BIN)/flatshare profiles render $(if $(filter 1 yes true,$(UPDATE)),--update)

verify: setup
	$(BIN)/flatshare profiles verify
