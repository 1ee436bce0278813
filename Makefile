# The two setup commands of the README: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := $(VENV)/.integrations

.PHONY: demo test scenarios scenarios-ci bench campaign install clean

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

# The whole suite but the long torchrun scenarios (8-12 minutes on 2 cores, measured 2026-12-02, plus about 7 minutes of install).
test: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m "not scenario" --durations=25 tests

# The CI tier of the scenarios (.ci/run runs it after `make test`): one scenario per fault class: a SIGKILL
# inside a save under torchrun (sync and async), an FSDP2 shard fault, a DDP job hanging at 3 ranks (and its
# desync, crash and straggler) and at 2 ranks with the defaults, the demo's hang at 3 ranks, a live-step SDC,
# an S3 upload killed, a rank killed in the Trainer, Lightning, Accelerate and DeepSpeed, the README's demo
# command (7-11 minutes on 2 cores, 2026-12-02). docs/tests.md lists them.
scenarios-ci: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m scenario_ci --durations=20 tests

# The long end-to-end scenarios under real torchrun (observer hangs/desyncs/crashes/stragglers on DDP and FSDP2,
# the short fault campaign, wrapped/unwrapped nanoGPT): several minutes each.
scenarios: $(STAMP) $(EXTRAS)
	$(BIN)/python -m pytest -q -m scenario tests

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

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

# Lint: ruff (check, format --check) over the repository and mypy over the package, at the versions the `lint`
# extra pins (pyproject.toml configures all three).
LINT := $(VENV)/.lint

$(LINT): $(STAMP)
	$(BIN)/pip install -q -e '.[lint]'
	touch $(LINT)

.PHONY: lint
lint: $(LINT)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy scout_ckpt
