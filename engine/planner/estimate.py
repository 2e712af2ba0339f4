"""The planner: per-rank peak memory and step-time factors for each ZeRO stage x offload x activation
checkpointing choice, before anything is launched.

Callers: `deepfleet plan` (`engine/planner/cli.py`), the autotuner (`engine/planner/tune.py`), the
memory-budget mode of activation checkpointing (`checkpoint_blocks_for_budget`), the accuracy test
(`tests/engine/test_planner.py`) and `benchmarks/planner.py`.

Model state follows what the strategies under `engine/zero/` hold (the figures `engine/memory.py`
measures): parameters, gradients, optimizer state and fp32 masters (16-bit training), each replicated
or divided by the data-parallel size as ZeRO's stage says, plus the transient buffers a stage builds
(stages 1/2: one reduce bucket of `reduce_bucket_size` elements; stage 3: what FSDP2 holds at each
point of backward, walked unit by unit in `_stage3_backward`). Activations
come from `profile.py`'s measured profile. Offloaded state moves from the device to its tier (cpu, or
nvme: optimizer state with `buffer_count` chunk buffers in host memory; stage-3 parameter shards, with
their fp32 masters, less the `max_in_cpu` elements kept in host memory). On the CPU path, where the
device is host memory, NVMe parameter offload frees the blocks' shards from the end of each block's
forward to its backward and between steps; backward reads them all back for the reduction and the
optimizer step, so backward's walk counts the shards back at each point and the reduction phase counts
them all (measured with a storage tracker that follows in-place resizes, the step's high-water mark
with parameter offload is within 3% of the one without).

Step-time factors are relative to plain data parallelism on the same model: `recompute` (checkpointed
blocks run their forward twice; a forward is about a third of a step's arithmetic and a block's share
of it is its share of the parameters), `comm_volume` (bytes each rank sends per step in units of the
gradient bytes: 2 for all-reduce or reduce-scatter + all-gather, 3 at stage 3, which gathers the
parameters again in backward), and bytes crossing to host and NVMe per step. They rank choices; the
autotuner's short trials measure the real step time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deepfleet.engine.config import DeepFleetConfig, load_config
from deepfleet.engine.planner.profile import ModelProfile, profile_model

GIB = 1024**3
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# Optimizer state tensors per parameter (fp32 each) by optimizer type; SGD counts its momentum buffer.
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Lamb": 2, "OneBitAdam": 2, "ZeroOneAdam": 2, "OneBitLamb": 2,
                    "Adagrad": 1, "Lion": 1, "SGD": 1}


@dataclass(frozen=True)
class Choice:
    """One configuration the planner estimates: ZeRO stage, where optimizer state and (stage 3)
    parameter shards live, and which blocks are checkpointed (indices into `blocks(model)`)."""

    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    checkpoint: tuple[int, ...] = ()

    def label(self, num_blocks: int) -> str:
        ckpt = ("all" if len(self.checkpoint) == num_blocks else f"{len(self.checkpoint)}/{num_blocks}") \
            if self.checkpoint else "none"
        return (f"stage {self.stage}, offload opt={self.offload_optimizer} param={self.offload_param}, "
                f"checkpoint {ckpt}")


@dataclass
class Estimate:
    """Per-rank bytes on the training device for one choice, by category, and what moved to other tiers."""

    choice: Choice
    params: float
    grads: float
    optimizer: float
    master: float
    buckets: float
    activations: float
    activations_without_checkpointing: float
    offloaded: dict[str, float] = field(default_factory=dict)
    """Bytes per rank held in host memory ("cpu") and in files ("nvme") instead of on the device."""
    recompute: float = 1.0
    comm_volume: float = 2.0
    host_transfer_bytes: float = 0.0
    nvme_transfer_bytes: float = 0.0

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer + self.master + self.buckets

    total: float = 0.0
    """The step's high-water mark: the larger of its two phases (see `peak_phase`), so not always the
    sum of the categories, which are each one's own largest."""
    peak_phase: str = "backward"
    """"backward" (activations at their largest, at the end of forward) or "reduction" (gradients
    reduced and buffered after the activations are freed)."""

    def fits(self, budget_bytes: float | None) -> bool:
        return budget_bytes is None or self.total <= budget_bytes

    def device_total(self, *, host_is_device: bool) -> float:
        """The high-water mark in the training device's memory: `total`, plus what moved to host memory
        when the device is the host (a run without an accelerator, where CPU-tier bytes such as NVMe
        staging buffers share the budget); bytes in files never count."""
        return self.total + (self.offloaded.get("cpu", 0.0) if host_is_device else 0.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["choice"]["checkpoint"] = list(self.choice.checkpoint)
        out.update(model_state=self.model_state)
        return out


@dataclass
class Plan:
    world_size: int
    micro_batch: int
    profile: ModelProfile
    estimates: list[Estimate]
    budget_bytes: float | None = None
    current: Estimate | None = None
    """The estimate of the config as given."""

    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits(self.budget_bytes)]

    def to_dict(self) -> dict[str, Any]:
        p = self.profile
        return {
            "world_size": self.world_size, "micro_batch": self.micro_batch, "budget_bytes": self.budget_bytes,
            "model": {"params": p.num_params, "trainable_params": p.trainable_params, "blocks": len(p.blocks),
                      "activation_bytes_per_sample": p.activation_peak.per_sample,
                      "activation_bytes_fixed": p.activation_peak.fixed, "probe_device": p.probe_device},
            "current": self.current.to_dict() if self.current else None,
            "estimates": [e.to_dict() | {"fits": e.fits(self.budget_bytes)} for e in self.estimates],
        }


def _precision(config: DeepFleetConfig) -> tuple[int, bool]:
    """(bytes per parameter/gradient element, keeps fp32 masters)."""
    sixteen = config.bf16.enabled or config.fp16.enabled
    return (2, True) if sixteen else (4, False)


def _states_per_param(config: DeepFleetConfig) -> int:
    opt = config.optimizer
    kind = getattr(opt, "type", None) if opt is not None else None
    if kind == "SGD":
        momentum = getattr(getattr(opt, "params", None), "momentum", 0.0) or 0.0
        return 1 if momentum else 0
    return _STATE_PER_PARAM.get(kind or "AdamW", 2)


def estimate(profile: ModelProfile, config: DeepFleetConfig, *, world_size: int, choice: Choice,
             micro_batch: int | None = None) -> Estimate:
    """The per-rank estimate of `choice` for `profile` under `config`'s precision, optimizer and buckets."""
    mb = int(micro_batch or config.train_micro_batch_size_per_gpu or 1)
    n = max(1, world_size)
    p = profile.trainable_params
    frozen = profile.num_params - p
    elem, masters = _precision(config)
    zero = config.zero_optimization
    states = _states_per_param(config)
    stage = choice.stage

    def shard(x: float) -> float:
        return x / n

    # Persistent state between steps, and the transient buffers of each phase of a step.
    params = (p + frozen) * elem if stage < 3 else shard((p + frozen) * elem)
    optimizer = p * 4 * states if stage == 0 else shard(p * 4 * states)
    master = (p * 4 if stage == 0 else shard(p * 4)) if masters else 0.0
    full_grads = p * (4 if masters else elem)
    bucket = min(zero.reduce_bucket_size, p) * 4
    grads = {0: full_grads, 1: 0.0, 2: shard(p * 4), 3: shard(p * 4)}[stage]
    # Stage 1 holds the full gradients only while it reduces them (after backward, with one flat
    # reduce buffer); stage 2 packs each final gradient into its bucket during backward; stage 3
    # holds the last block's gathered parameters when backward starts, and later its gradient shards
    # (freed between steps), a gathered unit, the one prefetched and a unit's unsharded gradients.
    unit = profile.largest_block_params
    during_backward = {0: 0.0, 1: 0.0, 2: bucket, 3: unit * elem}[stage]
    reduce_phase = {0: 0.0, 1: full_grads + bucket, 2: bucket, 3: 2 * unit * elem + unit * 4}[stage]
    persistent_grads = 0.0 if stage == 3 else grads
    offloaded: dict[str, float] = {"cpu": 0.0, "nvme": 0.0}
    host_bytes = nvme_bytes = 0.0
    if choice.offload_optimizer != "none" and stage >= 1:
        moved = optimizer + master
        offloaded[choice.offload_optimizer] += moved
        optimizer = master = 0.0
        # Gradient shards down to the host and updated parameter shards back, every step.
        host_bytes += shard(p * 4) + shard(p * elem)
        if choice.offload_optimizer == "nvme":
            chunk = min(zero.sub_group_size or p, shard(p)) * 4 * (states + (1 if masters else 0))
            offloaded["cpu"] += _nvme_buffers(config, "offload_optimizer", chunk_bytes=chunk)
            nvme_bytes += 2 * moved  # read and write back every optimizer state byte per step
    back_for_step = 0.0  # offloaded shards backward reads back for the reduction and the optimizer step
    if choice.offload_param != "none" and stage == 3:
        host_bytes += 2 * params  # shards fetched for forward and again for backward
        if choice.offload_param == "nvme":
            # engine/zero/nvme_param.py: the files hold FSDP2's fp32 shards, which at stage 3 are the
            # master weights, so 16-bit masters move with them (unless the optimizer offload took them);
            # `max_in_cpu` shard elements stay in host memory; reads land in the shards themselves (no
            # staging buffers); each step reads every offloaded shard back and writes it out again.
            files = shard((p + frozen) * 4)  # the fp32 shards, whatever the compute dtype
            kept = min(1.0, _max_in_cpu(config) / max(1.0, shard(p + frozen)))
            offloaded["cpu"] += kept * files
            offloaded["nvme"] += (1.0 - kept) * files
            nvme_bytes += 2 * (1.0 - kept) * files
            back_for_step = (1.0 - kept) * files
            master = 0.0
        else:
            offloaded[choice.offload_param] += params
        params = 0.0

    act_scale = elem / 4 if profile.param_bytes == 4 * profile.num_params else 1.0
    act_plain = profile.activation_peak.at(mb) * act_scale
    freed = [profile.blocks[i].freed_by_checkpoint(mb) * act_scale for i in choice.checkpoint]
    act = act_plain - sum(freed) + (profile.recompute_overhead.at(mb) * act_scale if freed else 0.0)
    act = max(0.0, act)
    # The step's high-water mark is the larger of its two phases: end of forward (activations at
    # their largest) and the gradient reduction (activations mostly freed by then).
    base = params + optimizer + master + persistent_grads
    backward_peak = base + act + during_backward
    if stage == 3 and profile.blocks:
        in_files = back_for_step / max(1.0, profile.num_params)  # per parameter, read back in backward
        backward_peak = base + _stage3_backward(profile, mb, act, elem=elem, world_size=n, act_scale=act_scale,
                                                checkpointed=set(choice.checkpoint), shard_back_bytes=in_files)
        during_backward = backward_peak - base - act
    reduction_peak = base + reduce_phase + (grads - persistent_grads) + back_for_step
    phase = "backward" if backward_peak >= reduction_peak else "reduction"
    buckets = during_backward if phase == "backward" else reduce_phase
    ckpt_params = sum(profile.blocks[i].params for i in choice.checkpoint)
    recompute = 1.0 + (ckpt_params / max(1, profile.num_params)) / 3.0
    return Estimate(choice=choice, params=params, grads=grads, optimizer=optimizer, master=master,
                    buckets=buckets, activations=act, activations_without_checkpointing=act_plain,
                    offloaded={k: v for k, v in offloaded.items() if v}, recompute=recompute,
                    comm_volume=3.0 if stage == 3 else 2.0, host_transfer_bytes=host_bytes,
                    nvme_transfer_bytes=nvme_bytes, total=max(backward_peak, reduction_peak), peak_phase=phase)


def _stage3_backward(profile: ModelProfile, mb: int, act: float, *, elem: int, world_size: int,
                     checkpointed: set[int], act_scale: float, shard_back_bytes: float = 0.0) -> float:
    """Stage 3's largest transient bytes over backward, above the persistent shards: activations plus
    what FSDP2 holds at each point, walked unit by unit in backward's order (the last block first).

    Each block is an FSDP2 unit and the root unit holds the rest (embeddings, final norm, head). The
    root stays gathered from forward to the end of backward, and its gradients (the head's, computed
    first) live until its reduce-scatter at the very end. While the loss and head run backward, the
    last block is gathered and its all-gather buffer is in flight. While block i runs backward, block
    i and the one prefetched for the next step back (i-1) are gathered, the previous unit's unsharded
    gradients are still held as the input of its reduce-scatter, and every unit already reduced keeps
    its fp32 gradient shard. Activations fall as blocks finish: a plain block frees what it saved, a
    checkpointed one its kept output. With parameter offload to NVMe, `shard_back_bytes` per parameter
    come back from files for the root, the unit running, the one prefetched and every unit done (they
    stay for the optimizer step); no unit is released again inside backward."""
    units = [b.params for b in profile.blocks]
    root = max(0, profile.num_params - sum(units))
    last = len(units) - 1
    ahead = units[last - 1] if last > 0 else 0
    phases = [act + (root + 2 * units[last]) * elem + (root + units[last] + ahead) * shard_back_bytes]
    freed = reduced = 0.0
    done = root  # parameters whose shards are back in memory (the root never leaves in backward)
    for k, i in enumerate(range(last, -1, -1)):
        nxt = units[i - 1] if i > 0 else 0
        gathered = (root + units[i] + nxt) * elem
        grads = root * elem + (units[i + 1] * elem if k > 0 else 0.0) + reduced
        done += units[i]
        phases.append(act - freed + gathered + grads + (done + nxt) * shard_back_bytes)
        block = profile.blocks[i]
        freed += (block.output if i in checkpointed else block.saved).at(mb) * act_scale
        reduced += units[i] * 4 / world_size
    return max(phases)


def _max_in_cpu(config: DeepFleetConfig) -> float:
    """Parameter elements NVMe parameter offload keeps in host memory: the config's `max_in_cpu` when it
    offloads parameters to NVMe itself; 0 for a candidate choice (the planner asks what offloading them
    would move)."""
    sec = config.zero_optimization.offload_param
    if sec is None or sec.device != "nvme":
        return 0.0
    return float(sec.max_in_cpu)


def _nvme_buffers(config: DeepFleetConfig, section: str, *, chunk_bytes: float) -> float:
    """Host staging buffers of NVMe offload: `buffer_count` buffers of one chunk each (the optimizer's
    chunk is `sub_group_size` parameters' state; a parameter buffer is `buffer_size` elements)."""
    sec = getattr(config.zero_optimization, section, None)
    count = getattr(sec, "buffer_count", 4) or 0
    return float(count * chunk_bytes)


def choices(num_blocks: int, *, stages: Sequence[int] = (0, 1, 2, 3), offload: Sequence[str] = OFFLOAD_DEVICES,
            checkpointing: Sequence[str] = ("none", "all")) -> list[Choice]:
    """Every valid stage x offload x checkpointing choice (optimizer offload needs stage >= 1; parameter
    offload needs stage 3 and goes to the optimizer's tier)."""
    out = []
    for stage, device, ckpt in itertools.product(stages, offload, checkpointing):
        if device != "none" and stage == 0:
            continue
        blocks = tuple(range(num_blocks)) if ckpt == "all" else ()
        if ckpt == "all" and not num_blocks:
            continue
        out.append(Choice(stage=stage, offload_optimizer=device, checkpoint=blocks))
        if stage == 3 and device != "none":
            out.append(Choice(stage=stage, offload_optimizer=device, offload_param=device, checkpoint=blocks))
    return out


def choice_of(config: DeepFleetConfig, num_blocks: int) -> Choice:
    """The choice a config makes as written (checkpointing from its checkpointing section when present)."""
    zero = config.zero_optimization
    opt = getattr(zero.offload_optimizer, "device", "none") if zero.offload_optimizer else "none"
    par = getattr(zero.offload_param, "device", "none") if zero.offload_param else "none"
    return Choice(stage=zero.stage, offload_optimizer=opt, offload_param=par,
                  checkpoint=checkpointed_blocks(config, num_blocks))


def checkpointed_blocks(config: DeepFleetConfig, num_blocks: int) -> tuple[int, ...]:
    """Blocks a config's `deepfleet_activation_checkpointing` section checkpoints (every k-th block in
    "blocks" mode); none when the section is absent or off."""
    section = getattr(config, "deepfleet_activation_checkpointing", None)
    if section is None or not getattr(section, "enabled", True) or getattr(section, "mode", "blocks") != "blocks":
        return ()
    every = int(getattr(section, "every", 1) or 1)
    return tuple(i for i in range(num_blocks) if i % every == 0)


def checkpoint_blocks_for_budget(profile: ModelProfile, config: DeepFleetConfig, *, world_size: int,
                                 budget_bytes: float, micro_batch: int | None = None,
                                 base: Choice | None = None) -> tuple[int, ...] | None:
    """The fewest blocks to checkpoint so that `base` (default: the config's stage and offload) fits in
    `budget_bytes` per rank: () when it fits without checkpointing, None when even checkpointing every
    block does not fit. Blocks that free the most bytes go first; among equals, spread evenly."""
    num = len(profile.blocks)
    base = base or choice_of(config, num)
    mb = micro_batch

    def total(ckpt: tuple[int, ...]) -> float:
        c = Choice(stage=base.stage, offload_optimizer=base.offload_optimizer, offload_param=base.offload_param,
                   checkpoint=ckpt)
        return estimate(profile, config, world_size=world_size, choice=c, micro_batch=mb).total

    if total(()) <= budget_bytes:
        return ()
    m = mb or config.train_micro_batch_size_per_gpu or 1
    for k in range(1, num + 1):
        spread = sorted({round(j * num / k) for j in range(k)})
        ranked = sorted(range(num), key=lambda i: (-round(profile.blocks[i].freed_by_checkpoint(m)), i not in spread, i))
        picked = tuple(sorted(ranked[:k]))
        if total(picked) <= budget_bytes:
            return picked
    return None


def plan(config: DeepFleetConfig | Mapping[str, Any] | str, model_factory: str | Callable[..., Any], *,
         world_size: int = 1, budget_gib: float | None = None, micro_batch: int | None = None,
         factory_kwargs: Mapping[str, Any] | None = None, profile: ModelProfile | None = None,
         candidate_choices: Sequence[Choice] | None = None, probe_device: str = "cpu") -> Plan:
    """Estimate every stage x offload x checkpointing choice for `model_factory`'s model at `world_size`
    data-parallel ranks (the config's micro batch unless `micro_batch` is given).

    Raises `ConfigError` for a bad config and ValueError for a factory that cannot be called."""
    cfg = config if isinstance(config, DeepFleetConfig) else load_config(config, world_size=world_size)
    prof = profile or profile_model(model_factory, factory_kwargs, probe_device=probe_device)
    mb = int(micro_batch or cfg.train_micro_batch_size_per_gpu or 1)
    num = len(prof.blocks)
    cands = list(candidate_choices) if candidate_choices is not None else choices(num)
    ests = [estimate(prof, cfg, world_size=world_size, choice=c, micro_batch=mb) for c in cands]
    current = estimate(prof, cfg, world_size=world_size, choice=choice_of(cfg, num), micro_batch=mb)
    return Plan(world_size=world_size, micro_batch=mb, profile=prof, estimates=ests,
                budget_bytes=budget_gib * GIB if budget_gib is not None else None, current=current)
