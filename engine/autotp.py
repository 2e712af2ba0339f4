"""AutoTP training: DeepSpeed's `tensor_parallel.autotp_size`, tensor parallelism on the mesh's `tp` axis.

`apply_autotp(model, parallel, config)` (called by `engine.initialize` before the ZeRO strategy wraps the
model) splits the Linear layers of every block (`deepfleet.engine.blocks.blocks`) Megatron's way:
*column* layers (q/k/v, gate/up, fc1 ...) keep 1/N of their output features and see the whole input,
*row* layers (o/out/down/fc2 ...) keep 1/N of their input features and all-reduce their outputs over
the tp group, so one block costs one all-reduce per row layer forward and one per column layer's input
gradient. Fused weights (q/k/v stacked in one `qkv`) are split per sub-block. Attention modules' head
counts (`num_heads`, `n_heads`, `num_key_value_heads`, ...) are divided by N. Which layer is which comes
from built-in name rules, or from `tensor_parallel.partition_config.layer_specs` (DeepSpeed's regex
rules), first match wins; a layer no rule names stays whole (replicated).

The split parameters are ordinary tensors holding this rank's share (each carries a `TPShard`, read
with `tp_shard(p)`), so every ZeRO stage 0-2 shards and reduces them over the data-parallel group as
any other parameter; replicated parameters get identical gradients on every tp rank (the column
layers' input gradients are summed over the group). What needs the tp group besides the forward:
- the global gradient norm (`zero/gradients.py: tensor_parallel_norm`): the split parameters' squares
  are summed over the tp group, the replicated ones counted once;
- checkpoints: each split tensor is saved as a 2-D `DTensor` over the (tp, dp) mesh with its full global
  shape (`wrap_state`), so `torch.distributed.checkpoint` writes whole tensors' pieces and a resume at
  another tp or dp degree reassembles them (fused weights only at the same tp degree);
- `save_16bit_model` gathers the full weights (`gather_full_state`).

Written here because torch's `parallelize_module` makes parameters `DTensor`s on the tp mesh, which the
ZeRO 1/2 flat buffers and DDP do not take; the layers' collectives are two autograd functions over
`engine/comm.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine import comm

# (regex over "<module path>.weight", kind, fused sub-blocks); the first match wins
_ATTENTION_COLUMN = r"(q_proj|k_proj|v_proj|query|key|value|q|k|v|wq|wk|wv)"
_DEFAULT_RULES: tuple[tuple[str, str, int], ...] = (
    (r"(^|\.)(qkv|qkv_proj|Wqkv|in_proj)\.weight$", "column", 3),
    (r"(^|\.)gate_up_proj\.weight$", "column", 2),
    (rf"(^|\.){_ATTENTION_COLUMN}\.weight$", "column", 1),
    (r"(^|\.)(gate_proj|up_proj|fc1|fc_in|c_fc|fc|w1|w3|wi|wi_0|wi_1|dense_h_to_4h|lin1)\.weight$", "column", 1),
    (r"(^|\.)(o_proj|out_proj|proj|c_proj|down_proj|fc2|fc_out|out|dense_4h_to_h|w2|wo|lin2)\.weight$", "row", 1),
)
# attributes of an attention module that count heads (divided by the tp degree)
_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
               "n_kv_heads", "n_kv_head", "nheads")
# attributes of an attention module that hold its projected width (divided too)
_WIDTH_ATTRS = ("embed_dim", "all_head_size", "inner_dim")


@dataclass(frozen=True)
class TPShard:
    """How a split parameter relates to the whole: split on `dim` into `size` parts (this is part `rank`),
    each of `blocks` sub-blocks (fused weights) split on its own; `full_shape` is the whole tensor's."""

    group: Any
    dim: int
    size: int
    rank: int
    blocks: int
    full_shape: tuple[int, ...]


def tp_shard(t: torch.Tensor) -> TPShard | None:
    """The `TPShard` of a split parameter, else None."""
    return getattr(t, "deepfleet_tp", None)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input gradient is summed over the tp group (each rank saw a slice of outputs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group, log_name="tp_all_reduce")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """The partial outputs of a row layer summed over the tp group; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group, log_name="tp_all_reduce")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Linear):
    """A Linear holding 1/N of the output features (see the module docstring)."""

    tp_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.tp_group), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """A Linear holding 1/N of the input features; outputs are summed over the tp group, then the (whole)
    bias is added."""

    tp_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTP.apply(F.linear(x, self.weight), self.tp_group)
        return out + self.bias if self.bias is not None else out


def _slice(t: torch.Tensor, *, dim: int, size: int, rank: int, blocks: int) -> torch.Tensor:
    shape = list(t.shape)
    if blocks > 1:  # (blocks * n, ...) -> (blocks, n, ...), split n, back
        blocked = t.reshape(blocks, shape[0] // blocks, *shape[1:])
        part = blocked.chunk(size, dim=1)[rank]
        return part.reshape(-1, *shape[1:]).clone()
    return t.chunk(size, dim=dim)[rank].clone()


def _rules(config: Any) -> list[tuple[re.Pattern, str, int]]:
    rules: list[tuple[re.Pattern, str, int]] = []
    partition = getattr(config, "partition_config", None)
    if partition is not None:
        for spec in partition.layer_specs:
            blocks = spec.shape[0] if spec.shape else 1
            rules += [(re.compile(p), spec.partition_type, blocks) for p in spec.patterns]
    if partition is None or partition.use_default_specs:
        rules += [(re.compile(p), kind, blocks) for p, kind, blocks in _DEFAULT_RULES]
    return rules


def _decide(name: str, rules: list[tuple[re.Pattern, str, int]]) -> tuple[str, int] | None:
    for pattern, kind, blocks in rules:
        if pattern.search(f"{name}.weight"):
            return (None if kind == "skip" else (kind, blocks))
    return None


def plan(model: nn.Module, config: Any) -> dict[str, tuple[str, int]]:
    """{module path: (column|row, fused sub-blocks)} for the Linear layers inside the model's blocks that a
    rule splits. Torch-only; no communication."""
    from deepfleet.engine.blocks import blocks

    rules = _rules(config)
    names = {id(m): n for n, m in model.named_modules()}
    chosen: dict[str, tuple[str, int]] = {}
    for block in blocks(model):
        prefix = names[id(block)]
        for sub, module in block.named_modules():
            if not sub or type(module) is not nn.Linear:
                continue
            name = f"{prefix}.{sub}" if prefix else sub
            decision = _decide(name, rules)
            if decision is not None:
                chosen[name] = decision
    return chosen


def apply_autotp(model: nn.Module, *, group: Any, config: Any) -> dict[str, tuple[str, int]]:
    """Split the model's block Linears over `group` (every rank of it must call this, with the same
    model); returns the plan. Raises ValueError naming a layer whose widths the degree does not divide,
    or a model with nothing to split."""
    size, rank = comm.get_world_size(group), comm.get_rank(group)
    chosen = plan(model, config)
    if not chosen:
        raise ValueError(
            "tensor_parallel.autotp_size: no Linear layer of the model's blocks matches a split rule; name "
            "them in tensor_parallel.partition_config.layer_specs (patterns + partition_type column/row)")
    kinds = {kind for kind, _ in chosen.values()}
    if kinds != {"column", "row"}:
        missing = ({"column", "row"} - kinds).pop()
        raise ValueError(
            f"tensor_parallel.autotp_size: the split rules found no {missing} layer (found only "
            f"{sorted(chosen)}); a column layer's sliced output must feed a row layer, so add a "
            f"partition_config.layer_specs rule for the {missing} layers")
    problems = []
    for name, (kind, blocks) in chosen.items():
        layer = model.get_submodule(name)
        width = layer.out_features if kind == "column" else layer.in_features
        if width % (size * blocks):
            what = f"{blocks} fused blocks of " if blocks > 1 else ""
            problems.append(f"{name}: {'out' if kind == 'column' else 'in'}_features {width} is not divisible into "
                            f"{what}{size} parts")
    if problems:
        raise ValueError("tensor_parallel.autotp_size: " + "; ".join(problems) + "; use a degree that divides them")
    with torch.no_grad():  # every tp rank slices the same weights: rank 0's
        for t in [*model.parameters(), *model.buffers()]:
            comm.broadcast(t.detach(), group=group, group_src=0)
    parents: set[str] = set()
    for name, (kind, blocks) in chosen.items():
        layer = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dim = 0 if kind == "column" else 1
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        full = tuple(layer.weight.shape)
        with torch.no_grad():
            weight = _slice(layer.weight.detach(), dim=dim, size=size, rank=rank, blocks=blocks)
            bias = layer.bias
            if bias is not None and kind == "column":
                bias = _slice(bias.detach(), dim=0, size=size, rank=rank, blocks=blocks)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = weight.shape[1], weight.shape[0]
        new.tp_group = group
        new.weight = nn.Parameter(weight, requires_grad=layer.weight.requires_grad)
        new.weight.deepfleet_tp = TPShard(group, dim, size, rank, blocks, full)
        if bias is None:
            new.register_parameter("bias", None)
        elif kind == "column":
            new.bias = nn.Parameter(bias, requires_grad=layer.bias.requires_grad)
            new.bias.deepfleet_tp = TPShard(group, 0, size, rank, blocks, tuple(layer.bias.shape))
        else:
            new.bias = layer.bias  # whole on every rank, added after the reduction
        new.train(layer.training)
        setattr(parent, child, new)
        if kind == "column" and (blocks > 1 or re.search(rf"(^|\.){_ATTENTION_COLUMN}$", name)):
            parents.add(parent_name)
    for parent_name in parents:  # attention modules: fewer heads per rank
        parent = model.get_submodule(parent_name) if parent_name else model
        for attr in (*_HEAD_ATTRS, *_WIDTH_ATTRS):
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % size:
                    raise ValueError(f"tensor_parallel.autotp_size: {parent_name or 'model'}.{attr} = {value} is not "
                                     f"divisible by {size}; use a degree that divides the head count")
                setattr(parent, attr, value // size)
    return chosen


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """DeepSpeed's `deepspeed.tp_model_init(model, tp_size, dtype)`: cast the model to `dtype` and mark it for
    AutoTP at degree `tp_size`; the split itself happens in `initialize` (which takes the degree from here
    when the config's `tensor_parallel.autotp_size` is unset, and refuses a different one). Returns the model."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: must be a positive integer, got {tp_size!r}")
    unknown = sorted(k for k in kwargs if k not in ("mpu", "tp_group"))
    if unknown or kwargs.get("mpu") is not None or kwargs.get("tp_group") is not None:
        raise ValueError(f"tp_model_init: {unknown or ['mpu/tp_group']} not supported; the tp group comes from "
                         "the engine's mesh, so pass only model, tp_size and dtype")
    if dtype is not None:
        model.to(dtype)
    model.deepfleet_autotp_size = tp_size
    return model


def model_tp_size(model: nn.Module | None, configured: int) -> int | None:
    """The degree `tp_model_init` recorded on `model` (None when it was not called); ValueError when the
    config asks for another."""
    marked = getattr(model, "deepfleet_autotp_size", None) if model is not None else None
    if marked is None:
        return None
    if configured > 1 and configured != marked:
        raise ValueError(f"tensor_parallel.autotp_size: {configured} but tp_model_init(tp_size={marked}); make "
                         "them agree or drop one")
    return marked


# --------------------------------------------------------------------------------------- whole tensors

def gather_full(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """The whole tensor from every tp rank's share (collective over the tp group)."""
    local = t.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    comm.all_gather(parts, local, group=shard.group)
    if shard.blocks > 1:
        rest = local.shape[1:]
        pieces = [p.reshape(shard.blocks, -1, *rest) for p in parts]
        return torch.cat(pieces, dim=1).reshape(shard.full_shape)
    return torch.cat(parts, dim=shard.dim)


def gather_full_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the module's state dict) with every split parameter whole (collective; a no-op without
    tensor parallelism)."""
    shards = {name: tp_shard(p) for name, p in module.named_parameters() if tp_shard(p) is not None}
    if not shards:
        return state
    return {k: gather_full(v, shards[k]) if k in shards else v for k, v in state.items()}


class TPCheckpointMesh:
    """The (tp, dp) mesh over which split tensors are saved as whole-shape 2-D DTensors."""

    def __init__(self, parallel: Any, dp_group: Any, device_type: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        ranks = parallel.mesh.mesh  # (pp, dp_replicate, dp_shard, sp, tp) global ranks
        coords = (ranks == comm.get_rank()).nonzero()[0].tolist()
        mine = ranks[coords[0], :, :, coords[3], :].reshape(-1, parallel.tp).T.contiguous()  # (tp, dp)
        self.mesh = DeviceMesh.from_group([parallel.submesh("tp").get_group(), dp_group], device_type,
                                          mesh=mine, mesh_dim_names=("tp", "dp"))

    def _wrap(self, value: torch.Tensor, shard: TPShard) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if isinstance(value, DTensor):  # stages 1/2: this rank's rows of its share, Shard(0) over dp
            local, dp = value.to_local(), Shard(0)
            share = tuple(value.shape)
        else:
            local, dp = value, Replicate()
            share = tuple(value.shape)
        if shard.blocks > 1:  # saved in the ranks' order of shares: whole-shaped, same tp degree only
            full = (share[0] * shard.size, *share[1:])
            placements = [Shard(0), dp]
        else:
            full = shard.full_shape
            placements = [Shard(shard.dim), dp]
        stride = torch.empty(full, device="meta").stride()
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(full), stride=stride)

    def wrap_state(self, state: dict, model: nn.Module, names: dict[str, str] | None = None) -> dict:
        """A copy of the strategy's `{"model": ..., "optim": {"state": ...}}` whose split entries are 2-D
        DTensors sharing storage with the originals (so a checkpoint load into it fills them in place)."""
        shards = {name: tp_shard(p) for name, p in model.named_parameters() if tp_shard(p) is not None}
        if not shards:
            return state
        out = dict(state)
        out["model"] = {k: self._wrap(v, shards[k]) if k in shards and isinstance(v, torch.Tensor) else v
                        for k, v in state["model"].items()}
        optim = state.get("optim")
        if optim and "state" in optim:
            per_param = {}
            for fqn, entries in optim["state"].items():
                shard = shards.get(fqn)
                if shard is None:
                    per_param[fqn] = entries
                    continue
                per_param[fqn] = {k: self._wrap(v, shard) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                  for k, v in entries.items()}
            out["optim"] = {**optim, "state": per_param}
        return out


def fused_layers(model: nn.Module) -> list[str]:
    """Names of split parameters saved in the share order (fused weights): resumable at the same tp degree only."""
    return [name for name, p in model.named_parameters() if tp_shard(p) is not None and tp_shard(p).blocks > 1]
