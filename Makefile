# Every target sets up .venv itself when it is missing or older than pyproject.toml.
VENV := .venv
PY := $(VENV)/bin/python
# torch is optional for kvtier; the tests need it for the GPU tier on CPU tensors. 2.13.0 is the CPU build.
TORCH := torch==2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/kvtier demo

test: $(VENV)/.installed
	$(VENV)/bin/pytest -q

bench: $(VENV)/.installed
	$(PY) bench/host_copy.py
	$(PY) bench/disk.py

clean:
	rm -rf $(VENV) build *.egg-info
