# hpcgnn: set-up, preprocessing, demo, tests and benchmarks.
#
#   make demo        create .venv, build native/, import Cora, partition it, train on 2 ranks
#   make test        same set-up, then the test suite
#
# TORCH picks the PyTorch requirement (an exact torch==X.Y.Z pin) and its pip options
# (default: the pinned CPU wheel from PyPI). On a GPU cluster point it at a CUDA build, e.g.
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# PyTorch is installed in a pip step of its own (the index applies to PyTorch alone; the
# other packages come from PyPI), and again whenever TORCH changes, also on an existing
# .venv. NATIVE_ARCH (or the HPCGNN_NATIVE_ARCH environment variable) picks the -march
# of native/ (default: the portable x86-64-v2 baseline with AVX2 kernels chosen at run
# time; "native" tunes for the build machine only, see setup.py); changing it rebuilds.
# MPI picks mpi4py's MPI: "wheel" (default: mpi4py and the MPICH wheel from PyPI, launched with
# .venv/bin/mpiexec) or "system" (mpi4py compiled from source with the site MPI's compiler
# wrapper MPICC, default mpicc, on PATH; no MPICH wheel; launched with the site's mpiexec/srun):
#   module load openmpi   # or the site's MPI
#   make install MPI=system [MPICC=mpicc]
# Switching MPI (or MPICC with MPI=system) reinstalls mpi4py, also on an existing .venv.
# Every target re-uses what is already built: a second run does no set-up work.

SHELL      := /bin/bash
PYTHON3    ?= python3
VENV       ?= .venv
TORCH      ?= torch==2.13.0
NATIVE_ARCH ?= $(HPCGNN_NATIVE_ARCH)
PY         := $(VENV)/bin/python
MPI        ?= wheel
MPICC      ?= mpicc
ifeq ($(filter $(MPI),wheel system),)
$(error MPI=$(MPI): expected wheel (mpi4py + the MPICH wheel from PyPI) or system (mpi4py built with MPICC))
endif
MPIEXEC    := $(if $(filter system,$(MPI)),mpiexec,$(VENV)/bin/mpiexec)
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

# value_stamp(NAME,VALUE): a stamp file named after a checksum of VALUE (which it holds),
# so that a rule making it runs again whenever VALUE changes; the rule removes the
# stamps of other values. Nothing is written while make reads this file (dry runs too).
value_stamp = $(VENV)/.$(1)-$(firstword $(shell printf '%s' '$(2)' | cksum))

PIP_STAMP    := $(VENV)/.pip-stamp
# the PyTorch step's stamp, named after the package in TORCH's pin and a checksum of TORCH
PT_NAME      := $(firstword $(subst ==, ,$(firstword $(TORCH))))
PT_STAMP     := $(call value_stamp,$(PT_NAME),$(TORCH))
# cmeel-metis: METIS 5.2 with 32-bit indices, half the partitioning memory of pymetis' build
# (hpcgnn falls back to pymetis' METIS without it; see hpcgnn/partition/metis.py).
# kaminpar: the partitioner for graphs beyond whole-graph METIS' memory (hpcgnn/partition/kaminpar.py);
# tensorboard: `hpcgnn report RUN --tensorboard DIR` (torch's SummaryWriter).
DEPS         := numpy h5py pymetis cmeel-metis kaminpar tensorboard matplotlib pytest pybind11 setuptools wheel
DEPS_STAMP   := $(call value_stamp,deps,$(DEPS))
# mpi4py and its MPI (see MPI above): a step of its own, again whenever the choice changes
MPI_STAMP    := $(call value_stamp,mpi,$(MPI)$(if $(filter system,$(MPI)), $(MPICC)))
ARCH_STAMP   := $(call value_stamp,native-arch,$(NATIVE_ARCH))
NATIVE_STAMP := $(VENV)/.native-stamp
NATIVE_SRC   := $(wildcard native/*.cpp native/*.h)

.PHONY: install native data partition demo test test-fast test-slurm bench-partition bench-partitioners bench-minibatch bench-fullgraph bench-halo-cache bench-tensor bench-rapa bench-plan bench-scale bench-papers bench-aggregate bench-dgl peer-dgl clean distclean

install: $(NATIVE_STAMP)

$(PIP_STAMP):
	@test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@touch $@

# PyTorch alone, with the options in TORCH (an --index-url there applies to PyTorch and its
# own dependencies only).
$(PT_STAMP): $(PIP_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	@rm -f $(VENV)/.$(PT_NAME)-[0-9]*
	@printf '%s\n' '$(TORCH)' > $@

# Everything else, from PyPI.
$(DEPS_STAMP): setup.py $(PIP_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check $(DEPS)
	@rm -f $(VENV)/.deps-[0-9]* $(VENV)/.deps-stamp
	@touch $@

# mpi4py: the PyPI wheel with the MPICH wheel (reinstalled over a source build), or built from
# source against the site MPI (no cached wheel: one built for another MPI must not be reused).
$(MPI_STAMP): $(PIP_STAMP)
ifeq ($(MPI),system)
	@command -v $(MPICC) >/dev/null || { echo "hpcgnn: MPI=system: the site MPI's compiler wrapper '$(MPICC)' is not on PATH (load the MPI module, or set MPICC=/path/to/mpicc)"; exit 2; }
	$(PY) -m pip uninstall -q -y mpich
	env MPICC='$(MPICC)' $(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps --no-binary=mpi4py mpi4py
else
	$(PY) -m pip install -q --disable-pip-version-check --force-reinstall --no-deps --only-binary=mpi4py,mpich mpi4py mpich
endif
	@rm -f $(VENV)/.mpi-[0-9]*
	@printf '%s\n' '$(MPI) $(MPICC)' > $@

$(ARCH_STAMP): $(PIP_STAMP)
	@rm -f $(VENV)/.native-arch-[0-9]*
	@printf '%s\n' '$(NATIVE_ARCH)' > $@

# The extension modules are built in place, incrementally (only changed
# families recompile); the package is then installed once, in editable mode,
# without compiling again. A failed compile stops here.
EDITABLE_STAMP := $(VENV)/.editable-stamp

$(NATIVE_STAMP): $(PT_STAMP) $(DEPS_STAMP) $(MPI_STAMP) $(ARCH_STAMP) $(NATIVE_SRC) setup.py
	flock .native.lock env HPCGNN_NATIVE_ARCH='$(NATIVE_ARCH)' $(PY) setup.py -q build_ext --inplace --parallel 2
	@$(PY) -c "import hpcgnn.native" || { echo "hpcgnn: native extension did not import"; exit 1; }
	@test -f $(EDITABLE_STAMP) || { HPCGNN_PREBUILT=1 HPCGNN_PT_REQUIREMENT="$(firstword $(TORCH))" \
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

# Cora with row-normalised features (the preprocessing of the published GCN results;
# inputs/cora-gcn-fullgraph.toml trains on it after `make partition GRAPH=data/cora-rownorm.h5`).
$(DATA)/cora-rownorm.h5: $(NATIVE_STAMP)
	@mkdir -p $(@D)
	$(HPCGNN) prepare --dataset cora --root inputs/data --normalize-features row --out $@ --force

data: $(DATA)/cora.h5 $(DATA)/cora-rownorm.h5 $(DATA)/synthetic-small.h5

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

# Bytecode first: where PYTHONDONTWRITEBYTECODE is set, every process of the suite would
# otherwise compile the package from source again (quick when nothing changed).
# The test tiers (markers in pyproject.toml, set in tests/conftest.py):
#   make test-fast   units and single-process equality: no MPI launch, no benchmark, no slow test
#   make test        everything but the SLURM test; changes nothing outside the checkout
#   make test-slurm  the SLURM scripts on a private single-node SLURM (installs Debian's
#                    slurm-wlm when missing, as root; skipped otherwise); .ci/run runs it after make test
test: $(NATIVE_STAMP)
	@$(PY) -m compileall -q -j 2 hpcgnn benchmarks tools tests > /dev/null
	$(PY) -m pytest -q tests -m "not slurm" $(PYTEST_ARGS)

test-fast: $(NATIVE_STAMP)
	@$(PY) -m compileall -q -j 2 hpcgnn benchmarks tools tests > /dev/null
	$(PY) -m pytest -q tests -m "not mpi and not slow and not bench and not slurm" $(PYTEST_ARGS)

test-slurm: $(NATIVE_STAMP)
	$(PY) -m pytest -q tests/test_slurm.py -m slurm $(PYTEST_ARGS)

# docs/config.md, the configuration reference, generated from the schema (tests/test_docs.py
# checks that it is current)
.PHONY: docs
docs: $(NATIVE_STAMP)
	$(HPCGNN) config --markdown > docs/config.md.tmp && mv docs/config.md.tmp docs/config.md

bench-partition: $(NATIVE_STAMP)
	$(PY) -m benchmarks.partition --out $(RUNS)/bench/partition.h5

# METIS against KaMinPar on one graph file (edge cut, the three balances, time, peak memory) at
# BENCH_PARTS, and --method auto under BUDGET:
#   make bench-partitioners GRAPH=data/products-like.h5 BENCH_PARTS="4 16" BUDGET=2GiB
BENCH_PARTS ?= 4 16
BUDGET      ?= 2GiB
bench-partitioners: $(NATIVE_STAMP)
	@test -n "$(GRAPH)" || { echo "make bench-partitioners: set GRAPH=FILE.h5 (a graph file from hpcgnn prepare)"; exit 2; }
	$(PY) -m benchmarks.partitioners $(GRAPH) --parts $(BENCH_PARTS) --budget $(BUDGET) --out $(RUNS)/bench/partitioners.h5

# BACKEND (runtime.backend of the runs: mpi4py, gloo, ...; default mpi4py) carries the data plane:
#   make bench-minibatch; make bench-minibatch BACKEND=gloo   # AEP wait share, back to back
# Another backend than mpi4py writes <bench>-<BACKEND>.h5.
BACKEND    ?= mpi4py
BENCH_TAG  := $(if $(filter-out mpi4py,$(BACKEND)),-$(BACKEND))

bench-minibatch: $(NATIVE_STAMP)
	$(PY) -m benchmarks.minibatch --backend $(BACKEND) --out $(RUNS)/bench/minibatch$(BENCH_TAG).h5

bench-fullgraph: $(NATIVE_STAMP)
	$(PY) -m benchmarks.fullgraph --backend $(BACKEND) --out $(RUNS)/bench/fullgraph$(BENCH_TAG).h5

# The halo cache against the exact halo (docs/capgnn.md): Cora (row-normalised), 4 ranks, full-graph
# GCN and SAGE with 3 layers, exact / S=2 pipelined / S=4 pipelined, seeds 0 and 1, 101 epochs;
# prints the bytes-and-accuracy table per model and writes $(RUNS)/bench/halo-cache-ARCH.h5
bench-halo-cache: $(DATA)/cora-rownorm.h5
	$(HPCGNN) partition $< --parts 4 --seed $(SEED) --out $(DATA)/cora-rownorm-metis-4 --force
	for arch in gcn sage; do \
	  HPCGNN_THREADS=1 $(MPIEXEC) -n 4 $(PY) -m benchmarks.fullgraph_cached \
	    --config inputs/cora-gcn-fullgraph.toml --store $(DATA)/cora-rownorm-metis-4 \
	    --work $(RUNS)/bench/halo-cache-$$arch --cases exact,S2+pipe,S4+pipe --seeds 0,1 --epochs 101 --eval-every 1 \
	    --set model.arch=$$arch --set model.layers=3 || exit 1; \
	  $(PY) -m benchmarks.fullgraph_cached --table --work $(RUNS)/bench/halo-cache-$$arch \
	    --cases exact,S2+pipe,S4+pipe --seeds 0,1 --out $(RUNS)/bench/halo-cache-$$arch.h5 || exit 1; \
	done

bench-tensor: $(NATIVE_STAMP)
	$(PY) -m benchmarks.tensor --out $(RUNS)/bench/tensor.h5

# RAPA (docs/rapa.md): 2 ranks with threads [1, 2], speed-proportional vs equal parts, back to back
bench-rapa: $(NATIVE_STAMP)
	$(PY) -m benchmarks.rapa --out $(RUNS)/bench/rapa.h5

# hpcgnn plan validated (docs/plan.md): calibrate, predict, train each engine on products-like
# scale 0.04 (2 ranks, 2 rounds), predicted vs measured peak memory and epoch-time order (about 12 min)
bench-plan: $(NATIVE_STAMP)
	$(PY) -m benchmarks.plan --out $(RUNS)/bench/plan.h5

# Not part of `make test`: an ogbn-products-sized graph end to end (about 15-20 min at scale 1.0).
# make bench-scale [SCALE=0.25] [DEVICE=cuda] [SCALE_ARGS="--ranks 2 --engines minibatch,fullgraph,tensor"]
SCALE      ?= 1.0
DEVICE     ?=
SCALE_ARGS ?=
bench-scale: $(NATIVE_STAMP)
	$(PY) -m benchmarks.scale --scale $(SCALE) --out $(RUNS)/bench/scale.h5 $(if $(DEVICE),--device $(DEVICE)) $(SCALE_ARGS)

# Not part of `make test`: an ogbn-papers100M-shaped graph end to end at scale SCALE (required):
# prepare, partition (--method auto) into RANKS parts, one minibatch epoch with the sampled
# evaluation and infer of the test vertices on RANKS ranks; wall time and peak memory per stage
# printed and in $(RUNS)/bench/papers-s$(SCALE).h5. Fit and project several scales with
#   .venv/bin/python -m benchmarks.papers --fit $(RUNS)/bench/papers-s0.01.h5 $(RUNS)/bench/papers-s0.05.h5
# make bench-papers SCALE=0.05 [RANKS=4] [PAPERS_ARGS="--keep-data --set minibatch.eval=full"]
RANKS       ?= 4
PAPERS_ARGS ?=
bench-papers: $(NATIVE_STAMP)
	@test "$(origin SCALE)" != file || { echo "make bench-papers: set SCALE=S (papers-like scale, 0 < S <= 1, e.g. 0.01)"; exit 2; }
	$(PY) -m benchmarks.papers --scale $(SCALE) --ranks $(RANKS) --out $(RUNS)/bench/papers-s$(SCALE).h5 $(PAPERS_ARGS)

# The aggregation paths (the native kernels, the device path, and that under train.deterministic), time per forward +
# backward and, on CUDA, device memory: make bench-aggregate [DEVICE=cuda] [AGG_ARGS="--widths 64"]
AGG_ARGS   ?=
bench-aggregate: $(NATIVE_STAMP)
	$(PY) -m benchmarks.aggregate --out $(RUNS)/bench/aggregate.h5 $(if $(DEVICE),--device $(DEVICE)) $(AGG_ARGS)

# hpcgnn's epoch time against DGL's (ratio hpcgnn / DGL; targets: full graph <= 0.67x, minibatch <= 0.5x),
# products-like scales 0.04 and 0.25, 1 process, back to back; needs `make peer-dgl` (about 25 min).
# hpcgnn runs with train.precision=$(DGL_PRECISION) (DGL in float32) and, in the minibatch runs,
# runtime.host_memory=retain; tables printed, figures in $(RUNS)/bench/dgl-s<scale>.h5.
DGL_PRECISION ?= bf16
bench-dgl: $(NATIVE_STAMP)
	$(PY) -m benchmarks.peers --scale 0.04 --rounds 3 --epochs 4 --precision $(DGL_PRECISION) \
	    --set runtime.host_memory=retain --work $(RUNS)/bench/peers-work --out $(RUNS)/bench/dgl-s0.04.h5
	$(PY) -m benchmarks.peers --scale 0.25 --rounds 2 --epochs 3 --precision $(DGL_PRECISION) \
	    --set runtime.host_memory=retain --work $(RUNS)/bench/peers-work-0.25 --out $(RUNS)/bench/dgl-s0.25.h5

# DGL as an optional benchmark peer: `make peer-dgl` creates its own virtual
# environment $(DGL_VENV) with torch==2.2.1 + DGL 2.1.0 (never the project's .venv: the PyTorch
# versions differ). When $(DGL_VENV)/bin/python exists, bench-fullgraph and bench-minibatch also
# time DGL on the same graph file in a subprocess (benchmarks/peer_dgl.py) and print the ratio;
# without it they time hpcgnn alone. Made once (stamp file). PyPI's torch==2.2.1 wheel brings the CUDA
# packages (about 3 GB); where the PyTorch CPU index is reachable, install the CPU wheel instead:
#   make peer-dgl DGL_TORCH="torch==2.2.1 --index-url https://download.pytorch.org/whl/cpu"
DGL_VENV  ?= .venv-dgl
DGL_TORCH_PIN := torch==2.2.1
DGL_PT_NAME := $(word 1,$(subst ==, ,$(DGL_TORCH_PIN)))
DGL_PT_VERSION := $(word 2,$(subst ==, ,$(DGL_TORCH_PIN)))
DGL_TORCH ?= torch==2.2.1
DGL_DEPS  := dgl==2.1.0 "numpy<2" "pandas<2.3" torchdata==0.7.1 h5py pydantic pyyaml psutil requests tqdm scipy
DGL_STAMP := $(DGL_VENV)/.peer-dgl-stamp

peer-dgl: $(DGL_STAMP)

# PyTorch alone first (DGL_TORCH's index options apply to it only), then DGL and the rest from
# PyPI with PyTorch pinned (torch==2.2.1) to the version just installed.
$(DGL_STAMP):
	@test -x $(DGL_VENV)/bin/python || $(PYTHON3) -m venv $(DGL_VENV)
	$(DGL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(DGL_TORCH)
	$(DGL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(DGL_TORCH_PIN) $(DGL_DEPS)
	$(DGL_VENV)/bin/python -c "import $(DGL_PT_NAME) as pt, dgl, h5py; assert pt.__version__.split('+')[0] == '$(DGL_PT_VERSION)', pt.__version__; print('peer-dgl: PyTorch', pt.__version__, 'dgl', dgl.__version__)"
	@touch $@

# make check-gpu (docs/gpu.md): every engine and mode on CUDA at 1 and 2 ranks against the same
# run on the CPU (tools/gpu_check.py); table printed, figures in $(RUNS)/gpu-check/gpu-check.h5,
# exit 1 when a row failed. Without a CUDA GPU: one line, exit 0, nothing set up.
# PYTHON=python3 checks that interpreter's own (CUDA) PyTorch instead of .venv's: a
# --system-site-packages venv $(GPU_VENV) of it gets only what it lacks, from the wheels in
# $(WHEELS) (no package index is contacted; `python3 tools/gpu_wheels.py download` prepares
# them where PyPI is reachable), and native/ is built in place for it.
# GPU_CHECK_ARGS: options of the driver, e.g. GPU_CHECK_ARGS="--ranks 1 --modes fullgraph-memory".
# make check-gpu-all: the same set-up, then every GPU check within a time budget
# (tools/gpu_session.py: check-gpu, pytest -m cuda, bench-aggregate and bench-scale at
# products-like 0.25 on the GPU; GPU_CHECK_ARGS="--budget 540 --work DIR" for instance, or
# "--deadline UNIX_TIME --archive FILE.tar.gz" to count the set-up and carry one file back), in
# $(RUNS)/gpu-session: for a GPU machine lent for minutes (docs/gpu.md).
PYTHON         :=# on the command line only (an environment PYTHON is not this one)
WHEELS         ?= .whl
GPU_VENV       ?= .venv-gpu
GPU_CHECK_ARGS ?=
GPU_PROBE      := $(if $(PYTHON),$(PYTHON),$(PY))
GPU_DRIVER     ?= gpu_check
.PHONY: check-gpu check-gpu-all check-gpu-run

check-gpu:
	@if command -v $(GPU_PROBE) >/dev/null 2>&1; then $(GPU_PROBE) -m tools.gpu_check --probe || exit 0; \
	elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	    echo "check-gpu: no CUDA GPU (nvidia-smi lists none; $(GPU_PROBE) is not set up); nothing to check"; exit 0; fi; \
	$(MAKE) --no-print-directory check-gpu-run GPU_DRIVER=$(GPU_DRIVER)

check-gpu-all:
	@$(MAKE) --no-print-directory check-gpu GPU_DRIVER=gpu_session

GPU_OUT = $(RUNS)/$(subst _,-,$(GPU_DRIVER))
ifeq ($(strip $(PYTHON)),)
check-gpu-run: $(NATIVE_STAMP)
	$(PY) -m tools.$(GPU_DRIVER) --out $(GPU_OUT) $(GPU_CHECK_ARGS)
else
check-gpu-run:
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv --without-pip --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python tools/gpu_wheels.py link --base-python $(PYTHON)
	$(GPU_VENV)/bin/python tools/gpu_wheels.py install --wheels $(WHEELS)
	flock .native.lock env HPCGNN_NATIVE_ARCH='$(NATIVE_ARCH)' $(GPU_VENV)/bin/python setup.py -q build_ext --inplace --parallel $$(nproc)
	$(GPU_VENV)/bin/python -m tools.$(GPU_DRIVER) --out $(GPU_OUT) $(GPU_CHECK_ARGS)
endif

clean:
	rm -rf build hpcgnn/_native*.so $(NATIVE_STAMP) .pytest_cache

distclean: clean
	rm -rf $(VENV) $(DATA) $(RUNS) hpcgnn.egg-info
