"""Tensor parallelism for the inference decoder over the mesh's `tp` dimension (DeepSpeed's AutoTP).

Called by `engine.InferenceEngine` when `tensor_parallel.tp_size > 1`, with full weights on every rank
(after any checkpoint load). Megatron's layout, the same for every supported architecture because
they all map onto one decoder: q/k/v and the MLP's up/gate projections are column-parallel (each rank
keeps a contiguous block of heads / hidden units, `Shard(0)` of the weight), the attention output and
MLP down projections are row-parallel (`Shard(1)`), followed by one all-reduce of the partial sums
(through `deepfleet.engine.comm`, so it is counted) before the bias is added once. Embeddings, norms
and the output head stay replicated. Each rank's KV cache then holds only its own heads.

The shards are cut with DTensor (`distribute_tensor(w, tp_mesh, [Shard(d)]).to_local()`, which also
makes every rank's weights agree with the first rank's) and the layer then runs on plain local
tensors. Why not `torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel /
RowwiseParallel: the shards must then stay DTensor parameters of nn.Linear modules, but weight-only
quantization (`quantize.py`) replaces a shard by integer codes that the int8/int4 kernels take as
plain tensors, and a decode step of a small model is dominated by per-op overhead that DTensor
dispatch adds to every projection. The one collective per row-parallel layer is the same either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deepfleet.engine import comm
from deepfleet.engine.inference.decoder import Decoder, frozen_linear

COLUMN = ("q", "k", "v", "up", "gate")
ROW = ("o", "down")


class RowParallel(nn.Module):
    """y = all_reduce(x_shard @ w_shard.T) + b: a row-parallel projection; `linear` holds this rank's
    input columns without bias (it may be replaced by a quantized layer)."""

    def __init__(self, linear: nn.Module, bias: Tensor | None, *, group: Any) -> None:
        super().__init__()
        self.linear, self.bias, self.group = linear, bias, group
        self.out_features = getattr(linear, "out_features", None)

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        comm.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def tp_mesh(tp_size: int) -> Any:
    """The `tp` sub-mesh of a mesh over the whole world (data parallel replicas take the rest)."""
    import torch.distributed as dist

    from deepfleet.engine.parallel import ParallelDims

    if not dist.is_initialized():
        raise ValueError(f"tensor_parallel.tp_size: {tp_size} needs torch.distributed initialized on "
                         f"{tp_size} ranks or a multiple (launch with torchrun --nproc-per-node {tp_size})")
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size: {tp_size} does not divide the world size {world}; "
                         f"use a divisor of {world}")
    dims = ParallelDims(tp=tp_size, world_size=world, names={"tp": "tensor_parallel.tp_size"})
    dims.build_mesh()
    return dims.submesh("tp")


def _cut(t: Tensor, mesh: Any, dim: int) -> Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t.detach(), mesh, [Shard(dim)]).to_local().clone()


def _check(decoder: Decoder, tp: int) -> None:
    for i, layer in enumerate(decoder.layers):
        for name in (*COLUMN, *ROW):
            if getattr(layer, name) is not None and type(getattr(layer, name)) is not nn.Linear:
                raise ValueError(f"tensor_parallel.tp_size: layer {i}'s {name} projection is "
                                 f"{type(getattr(layer, name)).__name__}; only float nn.Linear layers can be "
                                 "sharded (quantize with quant.weight after sharding, not before)")
        heads = layer.q.weight.shape[0] // layer.head_dim
        kv_heads = layer.k.weight.shape[0] // layer.head_dim
        if heads % tp or kv_heads % tp or layer.up.weight.shape[0] % tp:
            raise ValueError(f"tensor_parallel.tp_size: {tp} must divide layer {i}'s {heads} attention heads, "
                             f"{kv_heads} key/value heads and {layer.up.weight.shape[0]} MLP units")


@torch.no_grad()
def shard_decoder(decoder: Decoder, *, tp_size: int, group: Any = None) -> Any:
    """Replace each layer's projections by this rank's shards, in place; returns the tp process group."""
    _check(decoder, tp_size)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
        if mesh.size() != tp_size:
            raise ValueError(f"tensor_parallel.tp_group: has {mesh.size()} ranks, tp_size is {tp_size}")
    else:
        mesh = tp_mesh(tp_size)
    for layer in decoder.layers:
        for name in COLUMN:
            lin = getattr(layer, name)
            if lin is not None:
                bias = None if lin.bias is None else _cut(lin.bias, mesh, 0)
                setattr(layer, name, frozen_linear(_cut(lin.weight, mesh, 0), bias))
        for name in ROW:
            lin = getattr(layer, name)
            bias = None if lin.bias is None else nn.Parameter(lin.bias.detach(), requires_grad=False)
            setattr(layer, name, RowParallel(frozen_linear(_cut(lin.weight, mesh, 1), None), bias, group=mesh.get_group()))
    return mesh.get_group()
