# Quick start: `make train` and `make test`. Both create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.m2po-installed
CONFIG ?= configs/default.yaml
SPACE  ?= tune/spaces/cpu.yaml
ARGS   ?=

.PHONY: docs setup train lab calibrate calibrate-powered repro repro-powered repro-s64 repro-8token mismatch adaptive phase tool test test-fast bench clean

setup: $(STAMP)

# Re-install only when the dependency files change.
$(STAMP): pyproject.toml constraints/cpu.txt constraints/gpu.txt scripts/setup_env.sh
	VENV=$(VENV) bash scripts/setup_env.sh
	@touch $(STAMP)

train: setup
	$(VENV)/bin/m2po train --config $(CONFIG) $(ARGS)

# The staleness lab: a Ray Tune search over loss x staleness (x tau x lr) x seeds, then its
# report (table + plots) in the experiment directory. `make lab ARGS="--out runs/lab/a"`.
lab: setup
	$(VENV)/bin/m2po lab --space $(SPACE) $(ARGS)

# In which regime a config trains: the paper's two conditions. M2 of stale data as a multiple
# of tau at three learning rates (calibrate.yaml), and the on-policy arm's held-out change within
# one staleness window at two (calibrate_window.yaml); one report (its "Regime" section, with a
# verdict on each condition) in runs/calibrate/report. Interrupted? The same command continues.
calibrate: setup
	$(VENV)/bin/m2po lab --space tune/spaces/calibrate.yaml --out runs/calibrate/m2 --no-report $(ARGS)
	$(VENV)/bin/m2po lab --space tune/spaces/calibrate_window.yaml --out runs/calibrate/window --no-report $(ARGS)
	$(VENV)/bin/m2po report runs/calibrate/m2 runs/calibrate/window --out runs/calibrate/report

# Condition 2 at lr 1e-5 with 6 seeds (~15 min more): seeds 3-5 of calibrate_window.yaml's arm,
# reported with `make calibrate`'s runs in runs/calibrate/powered-report.
calibrate-powered: setup
	$(VENV)/bin/m2po lab --space tune/spaces/calibrate_window_powered.yaml --out runs/calibrate/window-powered --no-report $(ARGS)
	$(VENV)/bin/m2po report runs/calibrate/m2 runs/calibrate/window runs/calibrate/window-powered --out runs/calibrate/powered-report

# The paper's comparison in miniature, in the paper's regime (23 min here): M2PO vs GRPO vs
# no trust region at staleness 256 and M2PO on-policy, 3 seeds, 1024 updates, 1000 held-out
# problems; the report, with each claim's interval and verdict, in runs/repro/paper-mini/report.
# Interrupted? The same command continues it (finished trials are kept).
repro: setup
	$(VENV)/bin/m2po lab --space tune/spaces/paper_mini.yaml --out runs/repro/paper-mini $(ARGS)

# The same comparison with enough seeds to resolve +-2 points: seeds 3-9 (~55 min here;
# tune/spaces/paper_mini_powered.yaml says how to run it in pieces, or on a cluster with
# `ray job submit`), reported with `make repro`'s seeds 0-2 in runs/repro/powered-report.
repro-powered: setup
	$(VENV)/bin/m2po lab --space tune/spaces/paper_mini_powered.yaml --out runs/repro/paper-mini-powered --no-report $(ARGS)
	$(VENV)/bin/m2po report $(wildcard runs/repro/paper-mini) runs/repro/paper-mini-powered --out runs/repro/powered-report

# The comparison where the paper's two regime conditions hold here: staleness 64 standing for
# 256 (a window in which the miniature's policy moves as little as the condition asks), lr 1e-5,
# 3 seeds, 1024 updates (~52 min here; the same command continues it).
repro-s64: setup
	$(VENV)/bin/m2po lab --space tune/spaces/paper_mini_s64.yaml --out runs/repro/paper-mini-s64 $(ARGS)

# The first cycle's miniature (3-digit answers of 8 tokens, lr 3e-5: outside the paper's
# regime, M2 3-9x tau), kept for its history: docs/history/repro-8token.
repro-8token: setup
	$(VENV)/bin/m2po lab --space tune/spaces/paper_mini_8token.yaml --out runs/repro/paper-mini-8token $(ARGS)

# Engine numerics (~17 min): M2PO at staleness 64 with the engine in fp32, in bf16, and in bf16
# with recomputed behaviour log-probs + truncated IS, 3 seeds; report in runs/mismatch/report.
mismatch: setup
	$(VENV)/bin/m2po lab --space tune/spaces/mismatch.yaml --out runs/mismatch $(ARGS)

# The staleness bound steered by M2 (~75 min): fixed bounds {2, 8, 32, 128} vs
# max_staleness=auto under long-tailed generation times, 3 seeds, then bounds {8, 128} vs
# auto with the policy moving 2x faster, 2 seeds; one report in runs/adaptive/report.
adaptive: setup
	$(VENV)/bin/m2po lab --space tune/spaces/adaptive.yaml --out runs/adaptive/base --no-report $(ARGS)
	$(VENV)/bin/m2po lab --space tune/spaces/adaptive_fast.yaml --out runs/adaptive/fast --no-report $(ARGS)
	$(VENV)/bin/m2po report runs/adaptive/base runs/adaptive/fast --out runs/adaptive/report

# Where each loss holds on the reasoning-length task (~70 min): no trust region, clipped GRPO
# and M2PO (tau 0.04) over staleness {0, 64, 256} x lr {1x, 3x, 10x}, the cells cut to fit
# listed in the space file; the report (with the map, phase_map.png) in runs/phase/report.
phase: setup
	$(VENV)/bin/m2po lab --space tune/spaces/phase.yaml --out runs/phase $(ARGS)

# The tool task: M2PO on multi-turn episodes with a sandboxed calculator, 3 seeds (tune/spaces/tool.yaml).
tool: setup
	$(VENV)/bin/m2po lab --space tune/spaces/tool.yaml --out runs/tool $(ARGS)

# The suite in TEST_WORKERS processes (pytest-xdist; whole files to a worker, so a module's
# fixtures are built once; each worker's torch gets its share of the cores: tests/conftest.py).
# TEST_WORKERS=0 runs it in this process, one test after another.
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile
test: setup
	$(PYTEST) $(ARGS)
	@echo "set-up time of this .venv (cold install): $$(cat $(VENV)/.m2po-setup-seconds 2>/dev/null || echo '?') s"

test-fast: setup
	$(PYTEST) -m "not slow" $(ARGS)

# Each script prints its figures and writes bench/results/<name>.json; run with nothing
# else on the machine (a second CPU-heavy process slows 2-thread torch 10-40x).
bench: setup
	$(PY) bench/bench_losses.py
	$(PY) bench/bench_reward.py
	$(PY) bench/bench_engines.py
	$(PY) bench/bench_long_answers.py
	$(PY) bench/bench_weight_sync.py
	$(PY) bench/bench_step.py
	$(PY) bench/bench_async.py
	$(PY) bench/bench_learner_memory.py
	$(PY) bench/bench_main_job.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The documentation site (mkdocs.yml over docs/) into runs/site; `make test` builds it strict.
docs: setup
	$(VENV)/bin/mkdocs build --strict
