# hpcgnn: set-up, preprocessing, demo, tests and benchmarks.
#
#   make demo        create .venv, build native/, import Cora, partition it, train on 2 ranks
#   make test        same set-up, then the test suite
#
# TORCH picks the torch requirement (default: the pinned CPU wheel). On a GPU
# cluster point it at a CUDA build, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# Every target re-uses what is already built: a second run does no set-up work.

SHELL      := /bin/bash
PYTHON3    ?= python3
VENV       ?= .venv
TORCH      ?= torch==2.13.0
PY         := $(VENV)/bin/python
MPIEXEC    := $(VENV)/bin/mpiexec
HPCGNN     := $(PY) -m hpcgnn
DATA       ?= data
RUNS       ?= runs
GRAPH      ?= $(DATA)/cora.h5
PARTS      ?= 2
SEED       ?= 0
METHOD     ?= metis
NP         ?= 2
CONFIG     ?= inputs/cora-sage.toml
PYTEST_ARGS ?=

DEPS_STAMP   := $(VENV)/.deps-stamp
NATIVE_STAMP := $(VENV)/.native-stamp
NATIVE_SRC   := $(wildcard native/*.cpp native/*.h)

.PHONY: install native data partition demo test bench-partition bench-minibatch bench-fullgraph clean distclean

install: $(NATIVE_STAMP)

$(DEPS_STAMP): setup.py
	@test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH) numpy h5py pymetis mpi4py mpich pytest pybind11 setuptools wheel
	@touch $@

# The extension modules are built in place, incrementally (only changed
# families recompile); the package is then installed once, in editable mode,
# without compiling again. A failed compile stops here.
EDITABLE_STAMP := $(VENV)/.editable-stamp

$(NATIVE_STAMP): $(DEPS_STAMP) $(NATIVE_SRC) setup.py
	flock .native.lock $(PY) setup.py -q build_ext --inplace --parallel 2
	@$(PY) -c "import hpcgnn.native" || { echo "hpcgnn: native extension did not import"; exit 1; }
	@test -f $(EDITABLE_STAMP) || { HPCGNN_PREBUILT=1 HPCGNN_TORCH="$(firstword $(TORCH))" \
	    $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
	    && touch $(EDITABLE_STAMP); }
	@touch $@

native: $(NATIVE_STAMP)

# (Output directories are made in the recipes: a `data` directory target would be the phony
# `data` target below when DATA=data.)
$(DATA)/cora.h5: $(NATIVE_STAMP)
	@mkdir -p $(@D)
	$(HPCGNN) prepare --dataset cora --root inputs/data --out $@ --force

$(DATA)/synthetic-small.h5: $(NATIVE_STAMP)
	@mkdir -p $(@D)
	$(HPCGNN) prepare --dataset sbm --nodes 20000 --edges 200000 --features 64 --classes 8 --seed 0 --out $@ --force

data: $(DATA)/cora.h5 $(DATA)/synthetic-small.h5

# make partition GRAPH=data/cora.h5 PARTS=4 [METHOD=metis|random|contiguous]
partition: $(NATIVE_STAMP)
	$(HPCGNN) partition $(GRAPH) --parts $(PARTS) --method $(METHOD) --seed $(SEED) \
	    --out $(basename $(GRAPH))-$(METHOD)-$(PARTS) --force

$(DATA)/cora-metis-2/meta.h5: $(DATA)/cora.h5
	$(HPCGNN) partition $< --parts 2 --seed $(SEED) --out $(DATA)/cora-metis-2 --force

demo: $(DATA)/cora-metis-2/meta.h5
	$(HPCGNN) inspect $(DATA)/cora-metis-2
	$(MPIEXEC) -n 2 $(PY) -m hpcgnn train --config $(CONFIG) \
	    --set data.partitions=$(DATA)/cora-metis-2 --set output.dir=$(RUNS)/demo --force
	$(HPCGNN) report $(RUNS)/demo

test: $(NATIVE_STAMP)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench-partition: $(NATIVE_STAMP)
	$(PY) -m hpcgnn.bench.partition --out $(RUNS)/bench/partition.h5

bench-minibatch: $(NATIVE_STAMP)
	$(PY) -m hpcgnn.bench.minibatch --out $(RUNS)/bench/minibatch.h5

bench-fullgraph: $(NATIVE_STAMP)
	$(PY) -m hpcgnn.bench.fullgraph --out $(RUNS)/bench/fullgraph.h5

clean:
	rm -rf build hpcgnn/_native*.so $(NATIVE_STAMP) .pytest_cache

distclean: clean
	rm -rf $(VENV) $(DATA) $(RUNS) hpcgnn.egg-info
