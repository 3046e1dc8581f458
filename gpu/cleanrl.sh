#!/usr/bin/env bash
# CleanRL's eager MuJoCo scripts for the GPU machine, so that a device call runs the
# baseline beside the project's figures (benchmarks/gpu.py) on the same GPU. After
# gpu/bundle.sh, with a CleanRL clone (the .git of github.com/vwxyzjn/cleanrl):
#
#   bash gpu/cleanrl.sh /path/to/cleanrl/.git    # -> gpu/bundle/cleanrl/, wheels in gpu/bundle/wheels
#
# Then, in a gpu/run.sh command (run in the baked project):
#
#   'python ../cleanrl/run.py sac_continuous_action.py --env-id HalfCheetah-v5 --total-timesteps 6000'
#
# Takes ppo_continuous_action.py, sac_continuous_action.py and td3_continuous_action.py
# and the buffer they import (cleanrl_utils/buffers.py) from the clone's HEAD, and makes
# the changes gymnasium 1's vector API needs (../shared/STACK.md, "Running the baselines
# here"): same-step autoreset, infos["final_obs"], infos["final_info"] as a dict of arrays,
# and TransformObservation's observation space. Each change must apply once, or this
# stops. Their Atari scripts are left out: gymnasium's Atari wrappers need OpenCV, 50 MB
# that the 64 MiB a call carries has no room for.
set -euo pipefail
cd "$(dirname "$0")/.."
GIT=${1:?usage: bash gpu/cleanrl.sh /path/to/cleanrl/.git}
BUNDLE=gpu/bundle
DEST=$BUNDLE/cleanrl
[ -d "$BUNDLE/wheels" ] || { echo "error: no gpu/bundle: run gpu/bundle.sh first"; exit 1; }
rm -rf "$DEST" && mkdir -p "$DEST/cleanrl_utils"
SCRIPTS=(ppo_continuous_action sac_continuous_action td3_continuous_action)
for script in "${SCRIPTS[@]}"; do
    git --git-dir="$GIT" show "HEAD:cleanrl/$script.py" > "$DEST/$script.py"
done
git --git-dir="$GIT" show HEAD:cleanrl_utils/buffers.py > "$DEST/cleanrl_utils/buffers.py"
: > "$DEST/cleanrl_utils/__init__.py"
commit=$(git --git-dir="$GIT" rev-parse --short HEAD)

python3 - "$DEST" "${SCRIPTS[@]}" <<'EOF'
import re, sys
from pathlib import Path

dest, scripts = Path(sys.argv[1]), sys.argv[2:]
changes = [
    # (pattern, replacement, the scripts it applies to)
    (r"gym\.vector\.SyncVectorEnv\(\n(\s+)\[",
     r"gym.vector.SyncVectorEnv(\n\1autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,\n\1env_fns=[",
     scripts),
    (r'if "final_info" in infos:\n(\s+)for info in infos\["final_info"\]:',
     r'if "final_info" in infos and "episode" in infos["final_info"]:\n\1for info in [infos["final_info"]]:',
     scripts),
    (r'infos\["final_observation"\]', 'infos["final_obs"]',
     ["sac_continuous_action", "td3_continuous_action"]),
    (r"TransformObservation\(env, lambda obs: np\.clip\(obs, -10, 10\)\)",
     "TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)",
     ["ppo_continuous_action"]),
]
for script in scripts:
    path = dest / f"{script}.py"
    text = path.read_text()
    for pattern, replacement, applies in changes:
        if script not in applies:
            continue
        text, count = re.subn(pattern, replacement, text)
        if count != 1:
            sys.exit(f"error: {path.name}: {pattern!r} matched {count} times, not once")
    path.write_text(text)
EOF

cat > "$DEST/run.py" <<'EOF'
"""python ../cleanrl/run.py SCRIPT [ARGS]: one of CleanRL's scripts here, with tensorboardX's
SummaryWriter standing in for torch's (the GPU machine has no tensorboard)."""

import runpy
import sys
import types
from pathlib import Path

import tensorboardX

here = Path(__file__).resolve().parent
writer = types.ModuleType("torch.utils.tensorboard")
writer.SummaryWriter = tensorboardX.SummaryWriter
sys.modules["torch.utils.tensorboard"] = writer
sys.path.insert(0, str(here))  # cleanrl_utils
script = str(here / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
EOF
echo "CleanRL $commit" > "$DEST/COMMIT"

# tyro and what it needs beyond the machine's packages (typing_extensions comes with torch).
python3 -m pip --quiet --disable-pip-version-check download --no-deps --only-binary :all: \
    --dest "$BUNDLE/wheels" tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
echo "gpu/bundle/cleanrl: ${SCRIPTS[*]} from CleanRL $commit; gpu/bundle: $(du -sh "$BUNDLE" | cut -f1) in all (a run call carries 64 MiB)"
