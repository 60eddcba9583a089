VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install proto demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch pinned: on this machine the CPU wheel on disk, elsewhere the normal build.
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[all,dev]"
	@touch $(STAMP)

# Regenerates the Python code under proto/pdserve/v1 from the .proto files.
proto: install
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
		proto/pdserve/v1/*.proto

demo: install
	$(VENV)/bin/pdserve demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m benchmarks.tiers

clean:
	rm -rf $(VENV) build *.egg-info
