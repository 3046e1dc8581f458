#!/usr/bin/env bash
# On the GPU machine, from the repository root, with gpu/bundle carried (gpu/bundle.sh):
#
#   bash gpu/run.sh 'COMMAND' ['COMMAND' ...]
#
# Puts the bundle's wheels beside the machine's own torch and lightning, then runs each
# COMMAND in the baked project (bash, python the machine's), one after the other, each
# stopped after $LIMIT seconds (default 240) so that one slow command leaves the others
# their time. Each command's output goes to $OUT/<n>.txt and its last lines to stdout.
# Commands the GPU checks need, for example:
#
#   'python -m pytest -m gpu -rs -p no:cacheprovider'   # the tests that need a GPU
#   'python benchmarks/gpu.py --recipes sac td3 --frames 6000'
#   'python ../cleanrl/run.py sac_continuous_action.py --env-id HalfCheetah-v5 --total-timesteps 6000'   # gpu/cleanrl.sh
#   'python benchmarks/scaling.py --recipes ppo --accelerator cuda --workers 1 2 4 8 --frames 16384 env.id=ALE/Breakout-v5 env.num_envs=8'
#   'python benchmarks/scaling.py --recipes ppo dqn && cp scaling.png $OUT/'   # 1 to 8 CPU learners
set -uo pipefail
ROOT=$(pwd)
BUNDLE=$ROOT/gpu/bundle
PYTHON=${PYTHON:-python}  # the machine's, with its torch: the commands call it python
LIMIT=${LIMIT:-240}
export OUT=${OUT:-$ROOT/gpu/out}  # the commands may write files there too (the device tool returns $OUT)
SITE=$ROOT/gpu/site  # the wheels, installed beside the machine's packages rather than over them
mkdir -p "$OUT"
[ -d "$BUNDLE/wheels" ] || { echo "error: no gpu/bundle: run gpu/bundle.sh here, and carry gpu/bundle"; exit 1; }

# Installed once per bundle: a warm machine keeps gpu/site between calls.
if ! ls "$BUNDLE/wheels" | cmp -s - "$SITE/.installed"; then
    rm -rf "$SITE"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$BUNDLE"/wheels/*.whl || exit 1
    cp "$BUNDLE"/_torchrl*.so "$SITE/torchrl/" && ls "$BUNDLE/wheels" > "$SITE/.installed"
fi
cd "$BUNDLE"/my-rl-project
export PYTHONPATH=$SITE:$(pwd) PATH=$SITE/bin:$PATH
# The machine has no libEGL (MUJOCO_GL=egl failed there at import), and nothing here renders.
export MUJOCO_GL=disable
"$PYTHON" -c 'import torch, torchrl, tensordict, lightning_fabric
print(f"torch {torch.__version__}, torchrl {torchrl.__version__}, tensordict {tensordict.__version__},",
      f"lightning_fabric {lightning_fabric.__version__}; cuda: {torch.cuda.is_available()}, {torch.get_num_threads()} threads")
from torchrl.data import TensorDictPrioritizedReplayBuffer as B, LazyTensorStorage as S
B(alpha=0.6, beta=0.4, storage=S(8))' || exit 1

status=0
n=0
for command in "$@"; do
    n=$((n + 1))
    echo "== $n: $command (at most $LIMIT s)"
    start=$SECONDS
    timeout -k 10 "$LIMIT" bash -c "$command" > "$OUT/$n.txt" 2>&1
    code=$?
    tail -n 25 "$OUT/$n.txt"
    echo "== $n: exit $code after $((SECONDS - start)) s"
    [ $code -eq 0 ] || status=1
done
exit $status
