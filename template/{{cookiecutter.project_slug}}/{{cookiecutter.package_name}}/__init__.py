"""Distributed reinforcement learning with Lightning Fabric and torchrl."""

import os

# torchrl logs every storage allocation and env-spec check at INFO; keep its warnings.
# It reads this variable once, when it is first imported.
os.environ.setdefault("RL_LOGGING_LEVEL", "WARNING")
