"""What a training step holds per decoder layer beyond the planner's count (``kimi_tools.plan.activations``).

* Forward: ``KimiK3Model.loss`` drops each layer's aux (attention and MLP outputs, MoE selection scores, DSA top-k)
  as the layer returns. Under whole-layer recomputation those are outputs of the checkpoint, not saved activations:
  kept, they stayed until the forward ended (0.44 GB per K3.1 Pro MoE layer at 8192 tokens, beside the 0.117 GB
  partial sum the planner counts). ``forward(return_aux=True)`` still keeps them all.
* Backward under FSDP2: each decoder layer gathers its parameters once. A layer that returned the caller's AttnRes
  block tensors had FSDP2's pre-backward hook on them, which fired again once the block's whole gradient was
  complete (at the block's first layer, after the layer's post-backward): a second all-gather of every layer of the
  block, held until the backward ended.

Tiny preset (9 layers, AttnRes blocks written at layers 0, 4 and 8), fp32, every layer recomputed whole.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from dist_helpers import run_workers

from kimi.config import load_config

T = 40


def _model_and_batch():
    from kernels_torch.activation_memory import recompute_layers
    from kernels_torch.model import KimiK3Model

    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = KimiK3Model(cfg)
    recompute_layers(model, "layer")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g)
    return model, cfg, ids[:, :T], ids[:, 1:]


def _aux_alive_at_head(model, run) -> tuple[int, int]:
    """``(alive, made)``: how many of the layers' aux tensors (the partial sum ``residual`` left out: it is the next
    layer's input) are still alive when the final norm starts, of all the layers made, for one ``run()``."""
    refs = []

    def keep(mod, args, out):
        refs.extend(weakref.ref(t) for k, t in out[2].items() if k != "residual" and isinstance(t, torch.Tensor))

    seen = {}

    def at_head(mod, args):
        seen["alive"] = sum(r() is not None for r in refs)

    handles = [layer.register_forward_hook(keep) for layer in model.model.layers]
    handles.append(model.model.norm.register_forward_pre_hook(at_head))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen["alive"], len(refs)


def test_loss_forward_keeps_no_layer_aux():
    """Under whole-layer recomputation, no layer's aux tensor is alive when ``loss`` reaches the head; with
    ``return_aux`` every one is (kept for the comparison tools)."""
    model, cfg, ids, labels = _model_and_batch()
    alive, made = _aux_alive_at_head(model, lambda: model.loss(ids, labels).backward())
    assert made >= 3 * cfg.num_hidden_layers  # attention and MLP outputs, MoE scores and ids, DSA top-k
    assert alive == 0, f"{alive} of {made} aux tensors alive at the head"
    kept = []
    alive, made = _aux_alive_at_head(model, lambda: kept.append(model(ids, return_aux=True)))
    assert alive == made


def _gather_count_worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    from kernels_torch.parallel.fsdp import init_mesh
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize

    class Counting(AllGather):
        """FSDP2's all-gather (``all_gather_into_tensor``), counting its calls in the backward."""

        def __init__(self):
            self.backward = 0

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.backward += torch._C._current_graph_task_id() != -1
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)

    model, cfg, ids, labels = _model_and_batch()
    parallelize(model, init_mesh(dp=world), ParallelPolicy(master_dtype=None))
    counts = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            counts[name] = Counting()
            m.set_custom_all_gather(counts[name])
    with warnings.catch_warnings():  # a wrapped layer that returns a view: its in-place use skips the all-gather
        warnings.filterwarnings("error", message=".*returned a view tensor.*")
        model.loss(ids, labels).backward()
    last = f"model.layers.{cfg.num_hidden_layers - 1}"  # keeps its gathered parameters from its forward
    got = {n: c.backward for n, c in counts.items() if n.startswith("model.layers.") and n != last}
    assert len(got) == cfg.num_hidden_layers - 1
    twice = {n: k for n, k in got.items() if k != 1}
    assert not twice, f"decoder layers gathered other than once in the backward: {twice}"


@pytest.mark.distributed
def test_fsdp_gathers_each_layer_once_in_the_backward():
    """FSDP2 on two gloo ranks, every layer recomputed: each decoder layer that reshards after its forward
    all-gathers its parameters exactly once in the backward, whatever AttnRes block it reads; no layer returns a
    view (FSDP2's warning made an error)."""
    run_workers(_gather_count_worker, 2)
