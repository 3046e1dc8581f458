"""CUDA graphs on several learners, the part that runs without a GPU: the gradients as
views of one flat tensor, averaged by one all-reduce of it, between real processes over
gloo. The graphs themselves run in test_train.py's GPU tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from {{ cookiecutter.package_name }} import graphs

from .conftest import free_port


def average_over_two(rank: int, port: int, result: dict) -> None:
    """Learner ``rank`` of two: its own initial weights and inputs, two backward passes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)  # each learner's own weights, until the first learner's reach it
    model = torch.nn.Linear(3, 2)
    optimizers = {"adam": torch.optim.Adam(model.parameters())}
    graphs.broadcast_from_first(model, None, 0)
    averaged = graphs.AveragedGradients(optimizers, None, 2)
    for _ in range(2):  # the second backward lands in the same flat tensor, zeroed in place
        optimizers["adam"].zero_grad(set_to_none=False)
        model(torch.full((4, 3), rank + 1.0)).sum().backward()
        averaged.average()
    result[rank] = [model.weight.tolist(), model.weight.grad.tolist(), model.bias.grad.tolist()]
    dist.destroy_process_group()


def test_several_learners_average_their_gradients_in_one_flat_all_reduce():
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(average_over_two, args=(free_port(), result), nprocs=2)
        (weight, weight_grad, bias_grad), second = result[0], result[1]
    assert second == [weight, weight_grad, bias_grad]  # the first learner's weights, the same gradients
    # The gradient of the outputs' sum: the inputs summed over the batch of 4, 4 x 1 on one
    # learner and 4 x 2 on the other, averaged; the bias's: 4 on both.
    assert weight_grad == [[6.0] * 3] * 2 and bias_grad == [4.0] * 2
