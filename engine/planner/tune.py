"""The autotuner behind `deepfleet tune`: choose ZeRO stage, micro-batch size, activation
checkpointing and offload for the most tokens/s within a per-rank memory budget, and write the winning
ds_config.

Caller: `engine/planner/tune_cli.py`; tests and `benchmarks/autotune.py` call `tune` directly.

How (DeepSpeed's `autotuning` section gives the knobs, `engine/config_autotuning.py`):
1. The planner (`estimate.py`) profiles the model once and, for every stage x checkpointing x offload
   choice, finds the micro-batch sizes that fit the budget (between
   min/max_train_micro_batch_size_per_gpu, and with the train batch between min/max_train_batch_size);
   choices that fit at no size, or that the engine config refuses, are pruned without a trial.
   `num_tuning_micro_batch_sizes` sizes per choice are kept, spread geometrically from the smallest to
   the largest that fits. Per stage the choices come in tiers of rising cost: plain, every block
   checkpointed (`deepfleet_activation_checkpointing`), optimizer state offloaded, both. With `fast`
   a stage stops at the first tier that fits (recompute and offload traffic are slower whenever the
   state already fits); a base config that checkpoints blocks itself keeps its own choice.
2. Experiments are ordered by `tuner_type`: the grid in order ("gridsearch"), shuffled ("random",
   seeded by the config's `seed`), or by the planner's cost model — micro-batch over the recompute
   factor and the extra communication of stage 3 and of offload ("model_based").
3. Each experiment is a short trial (`trial.py`: steps 1..end_profile_step, timed from
   start_profile_step) in its own processes; its config and metric land under `exps_dir`. At most
   `tuner_num_trials` run; the search stops after `tuner_early_stopping` trials in a row without a
   better `metric`. With `overwrite` false an experiment whose metric is already there is not rerun.
4. The best experiment's config (without the `autotuning` section) is written to
   `results_dir/ds_config_optimal.json`, with `summary.json` listing every experiment.

A training device without an accelerator keeps CPU-offloaded state in the same memory, so CPU offload
is tried only when an accelerator is present. NVMe offload of the optimizer state moves it to files
(`engine/zero/nvme.py`) and saves memory on any device: it is tried when a directory for it is given
(`--nvme-path`, or `zero_optimization.offload_optimizer.nvme_path` in the base config); without an
accelerator its host staging buffers count against the budget.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepfleet.engine.config import ConfigError, DeepFleetConfig, load_config
from deepfleet.engine.config_source import read_source
from deepfleet.engine.planner.estimate import GIB, Choice, checkpointed_blocks, estimate
from deepfleet.engine.planner.profile import ModelProfile, profile_model

HIGHER_IS_BETTER = {"throughput": True, "flops": True, "latency": False}


@dataclass
class Experiment:
    name: str
    choice: Choice
    micro_batch: int
    gas: int
    predicted_bytes: float
    config: dict[str, Any]
    score: float = 0.0
    """The planner's cost-model rank (higher first under "model_based")."""
    metric: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class TuneResult:
    best: Experiment | None
    experiments: list[Experiment] = field(default_factory=list)
    pruned: list[dict[str, Any]] = field(default_factory=list)
    """Choices the planner ruled out (they fit the budget at no micro-batch size)."""
    optimal_config_path: Path | None = None
    metric: str = "throughput"

    def summary(self) -> dict[str, Any]:
        def row(e: Experiment) -> dict[str, Any]:
            d = asdict(e)
            d["choice"]["checkpoint"] = list(e.choice.checkpoint)
            return d
        return {"metric": self.metric, "best": self.best.name if self.best else None,
                "optimal_config": str(self.optimal_config_path) if self.optimal_config_path else None,
                "experiments": [row(e) for e in self.experiments], "pruned": self.pruned}


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def _micro_batches(lo: int, hi: int, count: int) -> list[int]:
    """`count` sizes from lo to hi, spread geometrically (both ends included)."""
    if hi <= lo or count <= 1:
        return [hi]
    ratio = (hi / lo) ** (1 / (count - 1))
    return sorted({max(lo, min(hi, round(lo * ratio**i))) for i in range(count)})


def _largest_fitting(profile: ModelProfile, cfg: DeepFleetConfig, *, world: int, choice: Choice, lo: int,
                     hi: int, budget: float | None, host_counts: bool = False) -> int | None:
    def fits(mb: int) -> bool:
        if budget is None:
            return True
        est = estimate(profile, cfg, world_size=world, choice=choice, micro_batch=mb)
        return est.device_total(host_is_device=host_counts) <= budget

    if not fits(lo):
        return None
    if fits(hi):
        return hi
    good, bad = lo, hi  # binary search: memory grows with the micro-batch
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _tiers(stage: int, *, offloads: tuple[str, ...], checkpoint: tuple[int, ...] | None,
           fixed_checkpoint: tuple[int, ...], param_offload: bool) -> list[list[Choice]]:
    """The choices of one stage, cheapest first, in tiers: plain; every block checkpointed; optimizer
    state offloaded; offloaded and checkpointed. Recomputing a forward costs less than moving the
    optimizer state over a bus or to files each step, so checkpointing comes first. `checkpoint` is the
    blocks the checkpointing tiers use (None: that dimension is not searched, every choice keeps
    `fixed_checkpoint`, the base config's own). With `param_offload`, stage 3's offload tiers also move
    the parameter shards with the optimizer state (an accelerator's memory is then what it saves; on the
    host the shards are all back for the gradient reduction and the optimizer step, so it lowers no
    step's high-water mark there)."""
    ckpts = [fixed_checkpoint] if checkpoint is None else [(), checkpoint]
    tiers: list[list[Choice]] = []
    for offloaded in (False, True):
        for ckpt in ckpts:
            tier = []
            for device in offloads:
                if (device != "none") != offloaded or (offloaded and stage == 0):
                    continue
                params = ("none", device) if param_offload and stage == 3 and device != "none" else ("none",)
                tier += [Choice(stage=stage, offload_optimizer=device, offload_param=param, checkpoint=ckpt)
                         for param in params]
            if tier:
                tiers.append(tier)
    return tiers


def experiments(profile: ModelProfile, base: dict[str, Any], *, world_size: int, budget_bytes: float | None,
                accelerator: bool | None = None,
                nvme_path: str | None = None) -> tuple[list[Experiment], list[dict[str, Any]]]:
    """The experiments worth a trial, in `tuner_type` order, and the pruned choices.

    Per stage the tiers of `_tiers` are tried in order; with `fast` the first tier where some choice
    fits the budget is the stage's last (checkpointing and offload only where nothing cheaper fits).
    Optimizer-state NVMe offload is a choice when `nvme_path` (or the base config's
    `zero_optimization.offload_optimizer.nvme_path`) names a directory; CPU offload only with an
    accelerator. Without an accelerator the host staging buffers of NVMe offload are counted in the
    budget: host memory is the training device's memory there."""
    cfg = load_config(base, world_size=world_size)
    at = cfg.autotuning
    dp = max(1, world_size // at.mp_size)
    accelerator = _has_accelerator() if accelerator is None else accelerator
    nvme_path = nvme_path or base_nvme_path(base)
    offloads = ("none", "cpu", "nvme") if accelerator else ("none", "nvme") if nvme_path else ("none",)
    num_blocks = len(profile.blocks)
    fixed = checkpointed_blocks(cfg, num_blocks)
    searched = tuple(range(num_blocks)) if num_blocks and not _checkpointing_set(base) else None
    chunk = _nvme_chunk(base, trainable=profile.trainable_params, dp=dp)
    fixed_batch = base.get("train_batch_size")
    gas_default = int(base.get("gradient_accumulation_steps") or 1)
    lo = at.min_train_micro_batch_size_per_gpu
    hi = at.max_train_micro_batch_size_per_gpu
    if at.max_train_batch_size:
        hi = min(hi, max(lo, at.max_train_batch_size // (dp * gas_default)))
    out: list[Experiment] = []
    pruned: list[dict[str, Any]] = []
    for stage in range(4):
        for tier in _tiers(stage, offloads=offloads, checkpoint=searched, fixed_checkpoint=fixed,
                           param_offload=accelerator):
            fitted = False
            for choice in tier:
                shape = {"nvme_path": nvme_path, "nvme_chunk": chunk, "search_checkpointing": searched is not None}
                loaded = _loaded(base, choice, world_size=world_size, **shape)
                if isinstance(loaded, str):
                    pruned.append({"choice": asdict(choice) | {"checkpoint": list(choice.checkpoint)},
                                   "reason": f"the engine config refuses it: {loaded}"})
                    continue
                top = _largest_fitting(profile, loaded, world=dp, choice=choice, lo=lo, hi=hi, budget=budget_bytes,
                                       host_counts=not accelerator)
                if top is None:
                    pruned.append({"choice": asdict(choice) | {"checkpoint": list(choice.checkpoint)},
                                   "reason": f"does not fit {budget_bytes / GIB:.3f} GiB at micro-batch {lo}"})
                    continue
                fitted = True
                for mb in _micro_batches(lo, top, at.num_tuning_micro_batch_sizes):
                    if fixed_batch:
                        if fixed_batch % (mb * dp):
                            continue
                        gas = fixed_batch // (mb * dp)
                    else:
                        gas = gas_default
                    if mb * gas * dp < at.min_train_batch_size:
                        continue
                    if at.max_train_batch_size and mb * gas * dp > at.max_train_batch_size:
                        continue
                    est = estimate(profile, loaded, world_size=dp, choice=choice, micro_batch=mb)
                    out.append(Experiment(name=_name(choice, mb), choice=choice, micro_batch=mb, gas=gas,
                                          predicted_bytes=est.device_total(host_is_device=not accelerator),
                                          config=_config(base, choice, mb, gas, **shape),
                                          score=_score(est, mb)))
            if fitted and at.fast:
                break  # fast: nothing costlier for a stage where this tier fits
    if at.tuner_type == "random":
        random.Random(cfg.seed).shuffle(out)
    elif at.tuner_type == "model_based":
        out.sort(key=lambda e: -e.score)
    return out, pruned


def _loaded(base: dict[str, Any], choice: Choice, *, world_size: int, **shape: Any) -> DeepFleetConfig | str:
    """`choice` applied to `base` as a loaded config (what the planner estimates it with: NVMe chunk
    sizes, buffers), or the first config error when this engine refuses the combination (e.g. an
    offload tier it cannot use)."""
    try:
        return load_config(_config(base, choice, 1, 1, **shape), world_size=world_size)
    except ConfigError as e:
        return e.errors[0] if e.errors else str(e)


def _nvme_chunk(base: Mapping[str, Any], *, trainable: int, dp: int) -> int | None:
    """`sub_group_size` for NVMe experiments when the base config leaves it unset (DeepSpeed's default,
    1e9 elements, would make each staging buffer as large as the whole shard's state, so offloading
    would save nothing): chunks of a quarter of the shard over the buffers, so all `buffer_count`
    staging buffers together hold a quarter of the state that moved to files."""
    zero = base.get("zero_optimization") or {}
    if "sub_group_size" in zero:
        return None
    count = int((zero.get("offload_optimizer") or {}).get("buffer_count", 4) or 4)
    return max(4096, -(-trainable // (dp * 4 * count)))


def base_nvme_path(base: Mapping[str, Any]) -> str | None:
    """The base config's `zero_optimization.offload_optimizer.nvme_path`, if any."""
    section = ((base.get("zero_optimization") or {}).get("offload_optimizer") or {})
    return section.get("nvme_path") if isinstance(section, Mapping) else None


def _checkpointing_set(base: Mapping[str, Any]) -> bool:
    """The base config checkpoints blocks itself (the tuner then keeps its choice instead of searching)."""
    section = base.get("deepfleet_activation_checkpointing")
    return isinstance(section, Mapping) and section.get("mode", "off") != "off"


def _score(est: Any, mb: int) -> float:
    """The planner's throughput proxy: samples per step-time unit (bigger micro-batches use the hardware
    better; recompute, stage 3's third pass of communication and offload traffic cost time)."""
    comm = 1.0 + 0.1 * (est.comm_volume - 2.0)
    offload = 1.0 + (0.5 if est.host_transfer_bytes else 0.0) + (1.0 if est.nvme_transfer_bytes else 0.0)
    return mb / (est.recompute * comm * offload)


def _name(choice: Choice, mb: int) -> str:
    off = "" if choice.offload_optimizer == "none" else f"_opt{choice.offload_optimizer}"
    off += "" if choice.offload_param == "none" else f"_param{choice.offload_param}"
    ckpt = f"_ckpt{len(choice.checkpoint)}" if choice.checkpoint else ""
    return f"z{choice.stage}{off}{ckpt}_mbs{mb}"


def _config(base: dict[str, Any], choice: Choice, mb: int, gas: int, *, nvme_path: str | None = None,
            nvme_chunk: int | None = None, search_checkpointing: bool = False) -> dict[str, Any]:
    """`base` as one experiment: its stage, offload devices (NVMe state under `nvme_path` unless the base
    names its own, in chunks of `nvme_chunk` parameters unless it sets `sub_group_size`), micro-batch
    and accumulation; with `search_checkpointing`, the experiment's `deepfleet_activation_checkpointing`
    (every block, or the section dropped)."""
    cfg = copy.deepcopy(base)
    cfg.pop("autotuning", None)
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = mb
    cfg["gradient_accumulation_steps"] = gas
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = choice.stage
    for key, device in (("offload_optimizer", choice.offload_optimizer), ("offload_param", choice.offload_param)):
        if device == "none":
            zero.pop(key, None)
        else:
            zero[key] = {**(zero.get(key) or {}), "device": device}
            if device == "nvme" and nvme_path:
                zero[key].setdefault("nvme_path", nvme_path)
            if device == "nvme" and key == "offload_optimizer" and nvme_chunk:
                zero.setdefault("sub_group_size", nvme_chunk)
    cfg["zero_optimization"] = zero
    if search_checkpointing:
        cfg.pop("deepfleet_activation_checkpointing", None)
        if choice.checkpoint:
            cfg["deepfleet_activation_checkpointing"] = {"mode": "blocks", "every": 1}
    return cfg


def _better(value: float, than: float, *, higher: bool) -> bool:
    return value > than if higher else value < than


Runner = Callable[[Experiment, dict[str, Any]], dict[str, Any]]


def subprocess_runner(*, model: str, model_args: Mapping[str, Any], world_size: int, exps_dir: Path,
                      start: int, end: int, metric_path: str | None, timeout: float = 600.0) -> Runner:
    """Run each experiment as `world_size` torchrun processes of `trial.py`; returns its metric dict.
    Raises RuntimeError with the trial's last output when it fails or writes no metric."""

    def run(exp: Experiment, _: dict[str, Any]) -> dict[str, Any]:
        folder = exps_dir / exp.name
        folder.mkdir(parents=True, exist_ok=True)
        metric_file = Path(metric_path) / f"{exp.name}.json" if metric_path else folder / "metric.json"
        spec = {"config": exp.config, "model": model, "model_args": dict(model_args),
                "start_profile_step": start, "end_profile_step": end, "metric_path": str(metric_file)}
        (folder / "ds_config.json").write_text(json.dumps(exp.config, indent=2))
        (folder / "exp.json").write_text(json.dumps(spec, indent=2))
        metric_file.unlink(missing_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               "-m", "deepfleet.engine.planner.trial", str(folder / "exp.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        (folder / "stdout.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not metric_file.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"trial {exp.name} failed (exit {proc.returncode}): {' | '.join(tail)}")
        return json.loads(metric_file.read_text())

    return run


def inprocess_runner(make: Callable[[], Any], *, start: int, end: int) -> Runner:
    """Measure each experiment on the caller's process group (every rank calls it, in the same order):
    `make()` builds a fresh `profile.Built` (model and data) per trial. How a job tunes itself inside
    its own processes (the managed loop, `worker/train.py`)."""
    import gc

    from deepfleet.engine.planner.trial import measure

    def run(exp: Experiment, _: dict[str, Any]) -> dict[str, Any]:
        metric = measure(make(), exp.config, start=start, end=end)
        gc.collect()  # the trial's engine and model go before the next one is built
        return metric

    return run


def tune_job(config: dict[str, Any], make: Callable[[], Any], *, model_factory: str, world_size: int,
             write: bool) -> dict[str, Any]:
    """The managed loop's tuning: the winning config for a job whose engine config enables `autotuning`,
    tuned in-process on the job's ranks (`autotuning.deepfleet_budget_gib` is the per-rank budget). A
    winner already in results_dir (an earlier attempt's) is used as it is, so restarts and resumes train
    with the same config. Only the rank with `write` writes files."""
    import torch.distributed as dist

    cfg = load_config(config, world_size=world_size)
    at = cfg.autotuning
    optimal = Path(at.results_dir) / "ds_config_optimal.json"
    # The writing rank decides for all (results_dir may be on its node only).
    found = [json.loads(optimal.read_text()) if write and optimal.exists() else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        return found[0]
    built = make()
    result = tune(config, model_factory, world_size=world_size, budget_gib=at.deepfleet_budget_gib,
                  runner=inprocess_runner(make, start=at.start_profile_step, end=at.end_profile_step),
                  profile=profile_from_built(built), write=write)
    best = [result.best.config if result.best else None]
    dist.broadcast_object_list(best, src=0)
    if best[0] is None:
        raise RuntimeError("autotuning: no experiment completed; see "
                           f"{Path(at.results_dir) / 'summary.json'} for each trial's error")
    return best[0]


def profile_from_built(built: Any) -> ModelProfile:
    """The planner's profile of a factory's already built job."""
    from deepfleet.engine.planner.profile import profile_model

    return profile_model(lambda: built)


def tune(config: dict[str, Any] | str | Path, model_factory: str, *, world_size: int = 1,
         budget_gib: float | None = None, factory_kwargs: Mapping[str, Any] | None = None,
         runner: Runner | None = None, profile: ModelProfile | None = None,
         accelerator: bool | None = None, write: bool = True, nvme_path: str | Path | None = None) -> TuneResult:
    """Search, measure, and write `results_dir/ds_config_optimal.json` (see the module docstring).

    `runner(experiment, spec)` measures one experiment (default: `subprocess_runner`); `write`: write
    the experiment and result files (false on all but one rank of an in-process tuning); `nvme_path`: a
    directory for optimizer-state NVMe offload, which makes that offload a choice (the base config's
    `offload_optimizer.nvme_path` does too). Raises `ConfigError` for a bad config and ValueError for
    an `nvme_path` that is not a directory."""
    errors: list[str] = []
    base = read_source(config, errors)
    if base is None:
        raise ConfigError(errors)
    cfg = load_config(base, world_size=world_size)
    at = cfg.autotuning
    if "autotuning" in base and not at.enabled:
        raise ConfigError(['autotuning.enabled: false turns the tuner off for this config; set "enabled": true '
                           "or drop the section to tune with its defaults"])
    if nvme_path is not None and not Path(nvme_path).is_dir():
        raise ValueError(f"--nvme-path: {nvme_path} is not a directory; create it or name an existing one")
    prof = profile or profile_model(model_factory, factory_kwargs)
    budget = budget_gib * GIB if budget_gib is not None else None
    exps, pruned = experiments(prof, base, world_size=world_size, budget_bytes=budget, accelerator=accelerator,
                               nvme_path=str(nvme_path) if nvme_path is not None else None)
    exps_dir, results_dir = Path(at.exps_dir), Path(at.results_dir)
    if write and at.overwrite and exps_dir.exists():
        shutil.rmtree(exps_dir)
    if write:
        exps_dir.mkdir(parents=True, exist_ok=True)
    run = runner or subprocess_runner(model=model_factory, model_args=factory_kwargs or {}, world_size=world_size,
                                      exps_dir=exps_dir, start=at.start_profile_step, end=at.end_profile_step,
                                      metric_path=at.metric_path)
    higher = HIGHER_IS_BETTER[at.metric]
    best: Experiment | None = None
    since_best = 0
    done: list[Experiment] = []
    for exp in exps[: at.tuner_num_trials]:
        cached = exps_dir / exp.name / "metric.json"
        try:
            exp.metric = json.loads(cached.read_text()) if not at.overwrite and cached.exists() else run(exp, {})
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            exp.error = str(e)
        done.append(exp)
        value = exp.metric.get(at.metric) if exp.metric else None
        if value is not None and (best is None or _better(value, best.metric[at.metric], higher=higher)):
            best, since_best = exp, 0
        else:
            since_best += 1
            if since_best >= at.tuner_early_stopping:
                break
    result = TuneResult(best=best, experiments=done, pruned=pruned, metric=at.metric)
    if not write:
        return result
    results_dir.mkdir(parents=True, exist_ok=True)
    if best is not None:
        result.optimal_config_path = results_dir / "ds_config_optimal.json"
        result.optimal_config_path.write_text(json.dumps(best.config, indent=2) + "\n")
    (results_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    return result
