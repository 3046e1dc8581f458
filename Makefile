# Two commands for a fresh machine with Python 3.11 and pip:
#   make demo   install, generate a project, train DQN on CartPole with 2 CPU learners
#   make test   install, then test the template, the recipes and a generated project
PYTHON ?= python3.11
VENV ?= .venv
TRACKERS_VENV ?= .venv-trackers
DEMO_DIR ?= build/demo
BIN := $(VENV)/bin

.PHONY: install slurm demo test lint clean

install: $(VENV)/.installed $(TRACKERS_VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -c "from torchrl.data import TensorDictPrioritizedReplayBuffer as B, LazyTensorStorage as S; B(alpha=0.6, beta=0.4, storage=S(8)); print('prioritized replay buffer: ok')"
	$(BIN)/python -c "import ale_py, minatar, mujoco, popgym; print('env families atari, minatar, mujoco, popgym: ok')"
	touch $@

# The generated project's [wandb] and [mlflow] extras, for its tracker tests, in a venv of
# their own that sees the main one's packages: Lightning's loggers bring torchmetrics, which
# Fabric imports whenever it is installed (about 2 s of CPU for every process a test starts).
SITE_PACKAGES = $(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
$(TRACKERS_VENV)/.installed: $(VENV)/.installed
	rm -rf $(TRACKERS_VENV)
	$(PYTHON) -m venv $(TRACKERS_VENV)
	echo "import site; site.addsitedir('$$($(call SITE_PACKAGES,$(VENV)))')" \
		> "$$($(call SITE_PACKAGES,$(TRACKERS_VENV)))/main-venv.pth"
	$(TRACKERS_VENV)/bin/python -m pip install --quiet "wandb>=0.19" "mlflow>=2.8" "pytorch-lightning>=2.6.6,<2.7"
	$(TRACKERS_VENV)/bin/python -c "import wandb, mlflow, pytorch_lightning, torchrl; print('trackers wandb, mlflow: ok')"
	touch $@

DEMO_RUN := $(DEMO_DIR)/my-rl-project/runs/demo

# The main venv only: the demo logs to no tracker (the trackers' venv is for make test).
demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(BIN)/cookiecutter --no-input . --output-dir $(DEMO_DIR)
	cd $(DEMO_DIR)/my-rl-project && PATH="$(abspath $(BIN)):$$PATH" \
		fabric run --accelerator cpu --strategy ddp --devices 2 train.py \
		recipe=dqn env.id=CartPole-v1 total_frames=50000 eval.every=5000 seed=1 run_dir=runs/demo
	@$(BIN)/python -c 'import json, sys; s = json.load(open(sys.argv[1])); \
		best = max(s["eval_history"], key=lambda r: r["eval_return"]); \
		print("eval return %.1f: mean of %d greedy episodes after %d frames in %.0f s" \
		% (s["eval_return"], s["eval_episodes"], s["frames_collected"], s["wall_s"])); \
		print("best evaluation %.1f at %d frames" % (best["eval_return"], best["frames"]))' \
		$(DEMO_RUN)/summary.json
	@echo "results: $(DEMO_RUN) (summary.json, metrics.csv, learning_curve.png, checkpoints/final.pt)"

# A real one-node SLURM for the generated project's tests/test_slurm.py: Debian's packages,
# which need root; the test starts its own daemons. Elsewhere that test is skipped.
slurm:
	@if command -v sbatch >/dev/null && [ -x /usr/sbin/slurmctld ]; then echo "slurm: ok"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
		&& echo "slurm: installed"; \
	else echo "slurm: not installed (needs root and apt-get): tests/test_slurm.py will be skipped"; fi

# Where SLURM could be installed, its test must run, not skip.
test: install slurm
	REQUIRE_SLURM=$$([ "$$(id -u)" = 0 ] && command -v sbatch >/dev/null && echo 1 || echo 0) \
		TRACKERS_PYTHON=$(abspath $(TRACKERS_VENV))/bin/python $(BIN)/python -m pytest -n 2 --dist worksteal

# The template's code is linted in a baked project, under its own ruff settings: in place,
# the project's pyproject.toml is a Jinja template that ruff cannot read (tests/test_bake.py
# lints a baked project too).
LINT_DIR ?= build/lint

lint: $(VENV)/.installed
	$(BIN)/ruff check --no-cache tests template/hooks
	rm -rf $(LINT_DIR) && mkdir -p $(LINT_DIR)
	$(BIN)/cookiecutter --no-input . --output-dir $(LINT_DIR)
	cd $(LINT_DIR)/my-rl-project && $(abspath $(BIN))/ruff check --no-cache .

clean:
	rm -rf $(VENV) $(TRACKERS_VENV) build
