"""CUDA graphs of the learner's update (``cudagraphs=true``): its forward and backward
recorded once and replayed, so that an update costs the GPU's time and not Python's.

tensordict's ``CudaGraphModule`` records and replays, as torchrl's sota scripts and LeanRL
use it. A graph replays the kernels it recorded, whatever Python would do now, so each
distinct update gets its own graph: by the batch's shape, the loss weight and the recipe's
``update_path`` (TD3: whether the actor learns). The optimizers step eagerly after the
replay, as the recipe's ``optimizer_step`` says (its branches stay Python's).

Several learners: a graph records only this learner's own kernels, so the graph holds the
forward and backward of the bare agent (no DDP), whose gradients land in one flat tensor,
and one all-reduce of that tensor after each replay averages them over the learners.
DDP's own all-reduces cannot be recorded over gloo at all, nor over NCCL but under
conditions (DDP made on a side stream, eleven eager steps first); one flat all-reduce
works with either backend.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import CudaGraphModule

# Eager calls of each graph before it records, as torchrl's sota scripts: a compiled loss
# compiles its forward and backward in them, and nothing recompiles while recording.
WARMUP = 5


class AveragedGradients:
    """The gradients of every parameter the optimizers step, as views of one flat tensor,
    averaged over the learners by one all-reduce of it (``learners`` in ``group``)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], group, learners: int) -> None:
        params = [p for o in optimizers.values() for g in o.param_groups for p in g["params"]]
        self.flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        # Backward adds into a gradient that exists, in place: into the flat tensor, as
        # DDP's gradient_as_bucket_view has it add into DDP's buckets.
        for param, grad in zip(params, self.flat.split([p.numel() for p in params]), strict=True):
            param.grad = grad.view_as(param)
        self.group, self.learners = group, learners

    def average(self) -> None:
        dist.all_reduce(self.flat, group=self.group)
        self.flat.div_(self.learners)


def broadcast_from_first(module: torch.nn.Module, group, first_rank: int) -> None:
    """``module``'s parameters and buffers made the first learner's on every learner, as
    DDP makes them when it wraps a module."""
    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=first_rank, group=group)


class GraphedGradients:
    """``model``'s loss on a batch and its gradients, from a CUDA graph per distinct update;
    with ``averaged``, the gradients averaged over the learners after each replay."""

    def __init__(
        self,
        model: Callable,
        optimizers: dict[str, torch.optim.Optimizer],
        autocast: Callable[[], AbstractContextManager],
        averaged: AveragedGradients | None = None,
    ) -> None:
        self.model, self.optimizers, self.autocast = model, optimizers, autocast
        self.averaged = averaged
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
        if self.averaged is not None:
            self.averaged.average()
        return out["loss"], out.get("priorities"), out["metrics"].to_dict()

    def gradients(self, weight: float) -> Callable[[TensorDictBase], TensorDict]:
        """The function a graph records. It zeroes the gradients in place and never sets them
        to None: every graph then writes the same ``.grad`` tensors, the ones the
        optimizers read (and the all-reduce averages). Set to None, each graph would hold
        its own, and the optimizers would read the last recorded graph's."""

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
