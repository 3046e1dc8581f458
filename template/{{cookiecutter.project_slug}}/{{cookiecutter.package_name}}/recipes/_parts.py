"""Networks and helpers that several recipes use, imported by name (``from ._parts import
weighted_mean``): the one module a recipe may import from the project.

Every project has this file, whichever recipes it was made with, so nothing here belongs
to one algorithm. Like a recipe, it imports nothing else from the project, and is not a
recipe itself (``recipe=`` lists only modules whose names do not start with ``_``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.func import functional_call
from torchrl.modules import MLP, ConvNet


def image_encoder(observation_shape: torch.Size) -> tuple[nn.Sequential, int]:
    """The convolutions for uint8 images ``(channels, height, width)``, and how many
    features they output: the Nature CNN's convolutions (Mnih et al. 2015) for frames of 36
    pixels or more (Atari's 84x84), else the MinAtar network's one 3x3 convolution (Young &
    Tian 2019). The images become floats in ``[0, 1]`` first, inside the network.

    Its two modules, ``ToFloat`` and the convolutions, go first in the recipe's own
    ``nn.Sequential`` (``nn.Sequential(*encoder, head)``), so a checkpoint names their
    weights by their place in the recipe's network."""
    channels, height, _ = observation_shape
    if height >= 36:
        convolutions = ConvNet(
            channels,
            num_cells=[32, 64, 64],
            kernel_sizes=[8, 4, 3],
            strides=[4, 2, 1],
            activation_class=nn.ReLU,
        )
        scale = 255.0  # grey levels
    else:
        convolutions = ConvNet(
            channels, num_cells=[16], kernel_sizes=[3], strides=[1], activation_class=nn.ReLU
        )
        scale = 1.0  # MinAtar's channels are 0 or 1
    with torch.no_grad():
        features = convolutions(torch.zeros(1, *observation_shape)).shape[-1]
    return nn.Sequential(ToFloat(scale), convolutions), features


class ToFloat(nn.Module):
    """uint8 images (one byte per value from the env, through the collector and any replay)
    become floats here, on the network's device: a batch crosses to the GPU at a quarter
    of float32's size. torch has no module for a dtype cast with a scale."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().div_(self.scale)


def twin_critics(observations: int, actions: int, hidden_sizes: list[int]) -> nn.ModuleList:
    """Two Q networks (Fujimoto et al. 2018's clipped double Q), each an MLP on the
    observation and the action side by side."""
    return nn.ModuleList(
        MLP(
            in_features=observations + actions,
            out_features=1,
            num_cells=hidden_sizes,
            activation_class=nn.ReLU,
        )
        for _ in range(2)
    )


def smaller_q(
    critics: Iterable[Callable[[torch.Tensor], torch.Tensor]], observation: torch.Tensor, action: torch.Tensor
) -> torch.Tensor:
    """The smaller of the twin critics' values of ``action`` in ``observation``: clipped
    double Q, against the overestimation that one critic's maximum would learn."""
    state_action = torch.cat([observation, action], -1)
    return torch.min(*(critic(state_action).squeeze(-1) for critic in critics))


def td_errors(
    critics: nn.ModuleList, observation: torch.Tensor, action: torch.Tensor, target_q: torch.Tensor
) -> torch.Tensor:
    """Each critic's error against ``target_q`` on each transition, shape ``[2, batch]``."""
    state_action = torch.cat([observation, action], -1)
    return torch.stack([critic(state_action).squeeze(-1) - target_q for critic in critics])


def frozen(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` with its weights detached: gradients reach its input, not its weights
    (an actor's loss through a critic that one backward pass also trains on its own loss)."""
    weights = {name: value.detach() for name, value in module.named_parameters()}
    return lambda x: functional_call(module, weights, (x,))


@torch.no_grad()
def polyak(target: nn.Module, network: nn.Module, tau: float) -> None:
    """Each of ``target``'s parameters moves ``tau`` of the way towards ``network``'s."""
    for target_weight, weight in zip(target.parameters(), network.parameters(), strict=True):
        target_weight.lerp_(weight, tau)


# What a one-step TD target reads of each transition: the batch_keys of a replay recipe
# whose loss needs nothing more.
TRANSITION_KEYS = (
    "observation",
    "action",
    ("next", "observation"),
    ("next", "reward"),
    ("next", "terminated"),
)


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` under prioritized replay's importance weights."""
    return (values * weight).sum() / weight.sum()
