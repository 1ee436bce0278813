# The two setup commands of the README: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := $(VENV)/.integrations

.PHONY: demo test scenarios scenarios-ci bench bench-smoke campaign stress install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned here: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The framework integrations' tests run against the versions they were written with (torch stays pinned).
$(EXTRAS): $(STAMP)
	$(BIN)/pip install -q transformers==5.24.0 accelerate==1.15.0 torchtitan==0.3.0 lightning==2.6.6 torch==2.13.0 \
	  s3fs==2026.2.0 fsspec==2026.2.0 'moto[server]==5.2.5' deepspeed==0.19.8 \
	  megatron-core==0.16.1 psutil==7.2.2
	touch $(EXTRAS)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/scout-ckpt demo --inject crash:rank=1:step=20 --inject bitflip:step=10

# The whole suite but the long torchrun scenarios (1,144 tests in 15.6 minutes on 2 cores at load 1-2 with a scenario run
# beside it for 3 of them, measured 2026-12-07, before a 35 s job moved to the CI tier; plus about 7 minutes of install).
test: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m "not scenario" --durations=25 tests

# The CI tier of the scenarios (.ci/run runs it after `make test`): every fault class, integration and storage
# the README claims: a SIGKILL inside a save under torchrun (sync and async), an FSDP2 shard fault, a DDP job
# hanging at 3 ranks (and its desync, crash and straggler) and at 2 ranks with the defaults, the demo's hang at 3
# ranks, a live-step SDC, the README's demo command (a crash and a flipped bit); a rank killed in the Trainer,
# Lightning, Accelerate and DeepSpeed, Megatron-Core replicas that disagree, TorchTitan's FSDP2 and TP meshes;
# an S3 upload killed, a node's worker killed under two torchrun agents, the fast tier's restart, an ECC event
# tainting the next checkpoint, a rank on a fleet suspect refusing to start (12 minutes on 2 cores, 38 tests,
# 2026-12-07). docs/tests.md lists them.
scenarios-ci: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m scenario_ci --durations=20 tests

# The long end-to-end scenarios under real torchrun (observer hangs/desyncs/crashes/stragglers on DDP and FSDP2,
# the short fault campaign, wrapped/unwrapped nanoGPT): several minutes each.
scenarios: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m scenario tests

# The tests whose outcome depends on timing (`-m timing`: the observer's judgement, the aftermath), 20 times in a
# row beside two CPU-bound processes, as users' and CI machines are: stops at the first failing run and names its
# seed. STRESS_ARGS passes more (e.g. STRESS_ARGS='--runs 5 --marker "timing and not scenario"').
stress: $(STAMP) $(EXTRAS)
	$(BIN)/python scripts/stress.py $(STRESS_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# Every bench (the campaign and the torture too) at a tiny size with --json, as CI runs it after the scenarios:
# fails on a bench that errs, prints no JSON object or leaves out a documented key, never on a missed target
# (targets are `make bench`'s). Writes bench/results/smoke.md.
bench-smoke: $(STAMP) $(EXTRAS)
	$(BIN)/python bench/run_all.py --smoke

# The demo's fault kinds and the SIGKILL torture, then users' scripts under real torchrun (FSDP2 shard faults,
# observer hangs/stragglers/desyncs/crashes) with their own healthy controls: well over an hour on 2 cores; then the
# faults of the world against the DDP example job (bench/campaign_murphy.py: wrongly_certified, good_lost, outcome).
campaign: scenarios
	$(BIN)/python bench/campaign.py
	$(BIN)/python bench/campaign.py --out bench/results/torchrun --healthy 0 --torture 0 --per-kind 2 \
	  --kinds fsdp_param,fsdp_optim,tr_hang,tr_slow,tr_slow_2x,tr_slow_1.5x,tr_desync,tr_crash
	$(BIN)/python bench/campaign.py --out bench/results/murphy --healthy 0 --torture 0 --per-kind 2 \
	  --kinds lost_ledger,transient_eio,enospc,clock_skew,gc_resave,second_container

clean:
	rm -rf $(VENV) build *.egg-info

# ---- The GPU proof (docs/gpu.md) ----------------------------------------------------------------------------------
# `make gpu-wheels`, on a machine with network: the wheels a bare GPU machine may lack (the project's dependencies but
# torch, pytest, and setuptools to build the project), for its Python and platform, into $(WHEELHOUSE); carry that
# folder with the checkout. `make gpu-check`, on the GPU machine (no network): scripts/gpu_check.py with that
# machine's own Python and CUDA torch, which it never touches; without a GPU it fails with one line.
GPU_PYTHON ?= python3
WHEELHOUSE ?= wheelhouse
GPU_PY_VERSION ?= 3.12
GPU_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
GPU_CHECK_OUT ?= gpu-check-results.json
GPU_WHEELS := 'safetensors>=0.4' 'numpy>=1.26' 'nvidia-ml-py>=12' 'sqlite-utils>=3.36' 'typer>=0.12' 'rich>=13' \
  'xxhash>=3.4' 'matplotlib>=3.8' 'pytest>=8' 'setuptools>=68'

.PHONY: gpu-check gpu-wheels

gpu-wheels:
	$(PYTHON) -m pip download -q --only-binary=:all: --implementation cp --python-version $(GPU_PY_VERSION) \
	  $(foreach p,$(GPU_PLATFORMS),--platform $(p)) -d $(WHEELHOUSE) $(GPU_WHEELS)
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE) | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)"

gpu-check:
	@$(GPU_PYTHON) scripts/gpu_check.py --wheels $(WHEELHOUSE) --out $(GPU_CHECK_OUT)

# Lint: ruff (check, format --check) over the repository and mypy over the package, at the versions the `lint`
# extra pins (pyproject.toml configures all three); then the generated API reference (docs/api.md) must be current.
LINT := $(VENV)/.lint

$(LINT): $(STAMP)
	$(BIN)/pip install -q -e '.[lint]'
	touch $(LINT)

.PHONY: lint
lint: $(LINT) $(EXTRAS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy scout_ckpt
	$(BIN)/python scripts/api_reference.py --check  # docs/api.md is what the code says (it imports every integration)
