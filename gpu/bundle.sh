#!/usr/bin/env bash
# What the GPU machine needs to run this template's GPU checks, built here: that machine
# reaches no package registry, and its image has Python 3.12, torch 2.11 and lightning
# 2.6.6 but nothing else the project needs (../shared/STACK.md, "The GPU machine").
#
#   bash gpu/bundle.sh        # -> gpu/bundle/: the baked project, and the wheels it lacks there
#
# Then, with the device tool, from the repository root (gpu/run.sh lists the GPU checks):
#   run(command="bash gpu/run.sh 'python -m pytest -m gpu -rs -p no:cacheprovider'", carry=["gpu/bundle"])
#
# Needs python3.12 (the machine's Python, so that compiled wheels match it) and the
# registry. The wheels are those a venv with only torch 2.11 and lightning 2.6.6 would
# still install, with torchrl's C++ extension taken from torchrl 0.13.3: 0.14.1's is built
# against torch 2.14 and does not load on 2.11 (the two share its API).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu/bundle
PY=${PY:-python3.12}
TORCH=2.11.0
LIGHTNING=2.6.6
OLD_TORCHRL=0.13.3  # its extension loads on torch 2.11

command -v "$PY" >/dev/null || { echo "error: $PY not found (set PY=...)"; exit 1; }
[ -x .venv/bin/cookiecutter ] || { echo "error: .venv is not installed (make install)"; exit 1; }
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

.venv/bin/cookiecutter --no-input . --output-dir "$BUNDLE" >/dev/null
project="$BUNDLE/my-rl-project"
# torch 2.11's DDP names forward_sync_buffers broadcast_buffers: in this copy alone.
learner="$project/my_rl_project/learner.py"
grep -q "forward_sync_buffers=False" "$learner" || { echo "error: $learner no longer passes forward_sync_buffers"; exit 1; }
sed -i "s/forward_sync_buffers=False/broadcast_buffers=False/" "$learner"

# What the project needs on that machine: its dependencies, its env families (ale-py's
# vector env, MinAtar, MuJoCo) and its tests' (pytest), with torchrl and tensordict at its pins.
requirements=$("$PY" - "$project/pyproject.toml" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + extras["atari"] + extras["minatar"] + extras["mujoco"]
print("\n".join(r for r in wanted + ["pytest", "pytest-xdist", "tensorboardX"] if not r.startswith("torch>")))
EOF
)
# Declared but not imported by the checks, and too large for one call's 64 MiB: OpenCV
# (gymnasium's Atari wrappers: env.vectorization=sync/async, videos), SciPy (MinAtar
# declares it, and imports seaborn only), MuJoCo's viewer and OpenGL bindings (nothing
# renders), and TensorBoard, whose writer Lightning also finds in tensorboardX (20 MB
# against 0.1). gpu/run.sh puts the project on the path rather than installing it, so its
# declared dependencies are not checked.
skipped="opencv-python-headless|scipy|mujoco-studio|pyopengl|tensorboard|tensorboard-data-server|grpcio|werkzeug|markdown"
"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --quiet --disable-pip-version-check)
report() {  # the packages (name==version) a resolution of "$@" installs, from pip's report
    "${pip[@]}" install --dry-run --ignore-installed --report "$work/report.json" "$@" >/dev/null
    "$PY" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"].lower().replace("_", "-") + "==" + item["metadata"]["version"])' \
        "$work/report.json"
}
# Resolved beside torch 2.11, and without what torch and lightning bring (the machine has them).
mapfile -t needed < <(report "torch==$TORCH" "lightning==$LIGHTNING" $requirements | sort)
mapfile -t present < <(report "torch==$TORCH" "lightning==$LIGHTNING" | sort)
mapfile -t wheels < <(comm -23 <(printf '%s\n' "${needed[@]}") <(printf '%s\n' "${present[@]}") \
    | grep -v -E "^($skipped)==")
"${pip[@]}" wheel --no-deps --wheel-dir "$BUNDLE/wheels" "${wheels[@]}"

# torchrl's extension for torch 2.11, from torchrl 0.13.3's wheel.
"${pip[@]}" download --no-deps --only-binary :all: --dest "$work" "torchrl==$OLD_TORCHRL"
"$PY" - "$work"/torchrl-"$OLD_TORCHRL"-*.whl "$BUNDLE" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, bundle = zipfile.ZipFile(sys.argv[1]), Path(sys.argv[2])
(extension,) = [n for n in wheel.namelist() if n.startswith("torchrl/_torchrl") and n.endswith(".so")]
(bundle / Path(extension).name).write_bytes(wheel.read(extension))
EOF

echo "gpu/bundle: $(ls "$BUNDLE/wheels" | wc -l) wheels, $(du -sh "$BUNDLE" | cut -f1) in all (a run call carries 64 MiB)"
