"""Train an agent (the code is in {{ cookiecutter.package_name }}/train.py):

    python train.py                                # one process (replay buffer in-process)
    python train.py fabric.devices=2               # Fabric starts 2 ranks itself
    fabric run --accelerator cpu --strategy ddp --devices 2 train.py seed=1
    python train.py --print-config env.id=Acrobot-v1   # show the resolved config and stop
    python train.py recipe=<name> --help           # every key: its value and what it means
"""

import sys

from {{ cookiecutter.package_name }}.train import main

if __name__ == "__main__":
    sys.exit(main())
