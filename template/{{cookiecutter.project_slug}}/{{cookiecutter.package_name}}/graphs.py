"""CUDA graphs of the learner's update (``cudagraphs=true``): its forward and backward
recorded once and replayed, so that an update costs the GPU's time and not Python's.

tensordict's ``CudaGraphModule`` records and replays, as torchrl's sota scripts and LeanRL
use it. A graph replays the kernels it recorded, whatever Python would do now, so each
distinct update gets its own graph: by the batch's shape, the loss weight and the recipe's
``update_path`` (TD3: whether the actor learns). The optimizers step eagerly after the
replay, as the recipe's ``optimizer_step`` says (its branches stay Python's).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import CudaGraphModule

# Eager calls of each graph before it records, as torchrl's sota scripts: a compiled loss
# compiles its forward and backward in them, and nothing recompiles while recording.
WARMUP = 5


class GraphedGradients:
    """``model``'s loss on a batch and its gradients, from a CUDA graph per distinct update."""

    def __init__(
        self,
        model: Callable,
        optimizers: dict[str, torch.optim.Optimizer],
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        self.model, self.optimizers, self.autocast = model, optimizers, autocast
        self.graphs: dict[tuple, CudaGraphModule] = {}

    def __call__(
        self, batch: TensorDictBase, weight: float, path: Hashable
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(loss, priorities, metrics)`` as the recipe's ``forward`` gives them, with the
        gradients of ``loss * weight`` in the parameters' ``.grad``."""
        key = (tuple(batch.batch_size), weight, path)
        if key not in self.graphs:
            self.graphs[key] = CudaGraphModule(self.gradients(weight), warmup=WARMUP, in_keys=[], out_keys=[])
        out = self.graphs[key](batch)
        return out["loss"], out.get("priorities"), out["metrics"].to_dict()

    def gradients(self, weight: float) -> Callable[[TensorDictBase], TensorDict]:
        """The function a graph records. It zeroes the gradients in place and never sets them
        to None: every graph then writes the same ``.grad`` tensors, the ones the
        optimizers read. Set to None, each graph would hold its own, and the optimizers
        would read the last recorded graph's."""

        def loss_and_gradients(batch: TensorDictBase) -> TensorDict:
            with self.autocast():
                loss, priorities, metrics = self.model(batch)
            for optimizer in self.optimizers.values():
                optimizer.zero_grad(set_to_none=False)
            (loss * weight).backward()
            out = TensorDict(loss=loss.detach(), metrics=TensorDict(metrics))
            if priorities is not None:
                out["priorities"] = priorities.detach()
            return out

        return loss_and_gradients
