"""The autotuner (`engine/planner/tune.py`, DeepSpeed's `autotuning` section): the planner prunes what
cannot fit the budget, trials are ordered and stopped as the section says, and the winning config is
written to results_dir and loads as an engine config. Trials are injected (a runner callable) except in
the end-to-end runs: real 1-rank trials in subprocesses, and real 2-rank trials in-process whose pick
(checkpointing and NVMe offload under a tight budget) then trains."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.planner.estimate import Choice, estimate
from deepfleet.engine.planner.profile import profile_model
from deepfleet.engine.planner.tune import experiments, tune
from tests.engine.planner_runs import gpt
from tests.engine.tune_runs import tune_then_train
from tests.spawn import spawn

MODEL = "tests.engine.planner_runs:gpt"


@functools.cache
def _profile():
    return profile_model(gpt, {"size": "small"})


def _base(tmp_path: Path, **tuning) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "autotuning": {"enabled": True, "results_dir": str(tmp_path / "results"),
                           "exps_dir": str(tmp_path / "exps"), **tuning}}


def _bytes(stage: int, mb: int, world: int = 2) -> float:
    cfg = load_config(_base(Path(".")), world_size=world)
    return estimate(_profile(), cfg, world_size=world, choice=Choice(stage=stage), micro_batch=mb).total


def test_the_planner_prunes_stages_that_do_not_fit_and_caps_the_micro_batch(tmp_path: Path) -> None:
    budget = (_bytes(0, 1) + _bytes(3, 1)) / 2  # stage 3 fits at micro-batch 1, stage 0 does not
    exps, pruned = experiments(_profile(), _base(tmp_path, max_train_micro_batch_size_per_gpu=64), world_size=2,
                               budget_bytes=budget, accelerator=False)
    assert {p["choice"]["stage"] for p in pruned} >= {0}
    assert exps and all(e.predicted_bytes <= budget for e in exps)
    assert 3 in {e.choice.stage for e in exps}
    top3 = max(e.micro_batch for e in exps if e.choice.stage == 3)
    assert _bytes(3, top3) <= budget < _bytes(3, top3 + 1)
    assert all(e.choice.offload_optimizer == "none" for e in exps)  # no accelerator: the engine refuses offload


def test_fast_mode_tries_offload_only_where_nothing_fits_without_it(tmp_path: Path) -> None:
    budget = (_bytes(2, 1) + _bytes(3, 1)) / 2
    fast, _ = experiments(_profile(), _base(tmp_path), world_size=2, budget_bytes=budget, accelerator=True)
    full, _ = experiments(_profile(), _base(tmp_path, fast=False), world_size=2, budget_bytes=budget,
                          accelerator=True)
    offloaded = {(e.choice.stage, e.choice.offload_optimizer) for e in fast if e.choice.offload_optimizer != "none"}
    assert offloaded and all(stage in (1, 2) for stage, _ in offloaded)  # stage 3 fits without offload
    assert any(e.choice.stage == 3 and e.choice.offload_optimizer != "none" for e in full)
    # on an accelerator stage 3 also tries the parameter shards on the offload device; never elsewhere
    assert any(e.choice.offload_param != "none" for e in full)
    assert all(e.choice.stage == 3 for e in full if e.choice.offload_param != "none")


def test_tune_picks_the_best_measured_trial_and_writes_a_loadable_config(tmp_path: Path) -> None:
    seen = []

    def runner(exp, _spec):  # tokens/s: bigger micro-batches are faster; stage 3 pays for its gathers
        seen.append(exp.name)
        return {"throughput": exp.micro_batch * (0.7 if exp.choice.stage == 3 else 1.0) + exp.choice.stage * 0.01}

    result = tune(_base(tmp_path, max_train_micro_batch_size_per_gpu=8, tuner_early_stopping=50), MODEL,
                  world_size=2, budget_gib=1.0, runner=runner, profile=_profile(), accelerator=False)
    assert result.best.name == "z2_mbs8" and len(seen) == len(result.experiments)
    written = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert written["zero_optimization"]["stage"] == 2 and written["train_micro_batch_size_per_gpu"] == 8
    assert "autotuning" not in written
    load_config(written, world_size=2)
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert summary["best"] == "z2_mbs8" and len(summary["experiments"]) == len(seen)


def test_early_stopping_trial_cap_and_reuse_without_overwrite(tmp_path: Path) -> None:
    calls = []

    def flat(exp, _spec):
        calls.append(exp.name)
        return {"throughput": 1.0}

    tune(_base(tmp_path, tuner_early_stopping=2, max_train_micro_batch_size_per_gpu=8), MODEL, world_size=2,
         budget_gib=1.0, runner=flat, profile=_profile(), accelerator=False)
    assert len(calls) == 3  # the first sets the best, two more without improvement stop the search
    calls.clear()
    tune(_base(tmp_path, tuner_num_trials=2, tuner_early_stopping=50), MODEL, world_size=2, budget_gib=1.0,
         runner=flat, profile=_profile(), accelerator=False)
    assert len(calls) == 2
    for name in calls:
        (tmp_path / "exps" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "exps" / name / "metric.json").write_text(json.dumps({"throughput": 5.0}))
    calls.clear()
    result = tune(_base(tmp_path, tuner_num_trials=2, overwrite=False, tuner_early_stopping=50), MODEL,
                  world_size=2, budget_gib=1.0, runner=flat, profile=_profile(), accelerator=False)
    assert calls == [] and result.best.metric == {"throughput": 5.0}


def test_latency_is_minimised_and_a_failed_trial_is_recorded(tmp_path: Path) -> None:
    def runner(exp, _spec):
        if exp.choice.stage == 1:
            raise RuntimeError("trial z1 failed (exit 1): out of memory")
        return {"latency": 1.0 / exp.micro_batch + exp.choice.stage}

    result = tune(_base(tmp_path, metric="latency", max_train_micro_batch_size_per_gpu=4, tuner_early_stopping=50),
                  MODEL, world_size=2, budget_gib=1.0, runner=runner, profile=_profile(), accelerator=False)
    assert result.best.name == "z0_mbs4"
    assert any(e.error and "out of memory" in e.error for e in result.experiments)


def test_bad_autotuning_keys_are_one_line_each() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1,
                     "autotuning": {"tuner_type": "bayes", "start_profile_step": 4, "end_profile_step": 2}})
    assert any(line.startswith("autotuning.tuner_type:") for line in err.value.errors)
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {"start_profile_step": 4,
                                                                         "end_profile_step": 2}})
    assert any("end_profile_step" in line and "\n" not in line for line in err.value.errors)


def test_a_section_with_enabled_false_is_refused_by_name(tmp_path: Path) -> None:
    base = _base(tmp_path)
    base["autotuning"]["enabled"] = False
    with pytest.raises(ConfigError) as err:
        tune(base, MODEL, world_size=2, budget_gib=1.0, runner=lambda e, s: {}, profile=_profile())
    assert err.value.errors[0].startswith("autotuning.enabled:")


@pytest.mark.slow
def test_real_trials_measure_tokens_per_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    base = _base(tmp_path, start_profile_step=2, end_profile_step=3, num_tuning_micro_batch_sizes=2,
                 max_train_micro_batch_size_per_gpu=4, tuner_num_trials=2)
    result = tune(base, MODEL, world_size=1, budget_gib=1.0, profile=_profile(), accelerator=False)
    assert [e.error for e in result.experiments] == [None, None]
    for exp in result.experiments:
        assert exp.metric["throughput"] > 0 and exp.metric["steps_timed"] == 2
        assert (tmp_path / "exps" / exp.name / "ds_config.json").exists()
    assert result.best.metric["throughput"] == max(e.metric["throughput"] for e in result.experiments)
    assert (tmp_path / "results" / "ds_config_optimal.json").exists()


MB = 8  # checkpointing and NVMe tiers are compared at one micro-batch size, where activations matter


def _need(stage: int, *, ckpt: bool = False, nvme: bool = False) -> float:
    """The planner's device bytes of a stage x checkpointing x NVMe choice at micro-batch MB, 2 ranks
    (NVMe in the tuner's default chunks, its staging buffers counted: there is no accelerator)."""
    exps, _ = experiments(_profile(), _base(Path("."), fast=False, min_train_micro_batch_size_per_gpu=MB,
                                             max_train_micro_batch_size_per_gpu=MB),
                          world_size=2, budget_bytes=None, accelerator=False, nvme_path="/nvme")
    found = [e.predicted_bytes for e in exps if e.choice.stage == stage and bool(e.choice.checkpoint) == ckpt
             and (e.choice.offload_optimizer == "nvme") == nvme and e.choice.offload_param == "none"]
    assert len(found) == 1
    return found[0]


def _tiers(budget: float, nvme_path: str | None) -> tuple[list, list]:
    return experiments(_profile(), _base(Path("."), min_train_micro_batch_size_per_gpu=MB,
                                         max_train_micro_batch_size_per_gpu=MB),
                       world_size=2, budget_bytes=budget, accelerator=False, nvme_path=nvme_path)


def test_checkpointing_and_nvme_are_tried_only_where_the_budget_needs_them(tmp_path: Path) -> None:
    plain = {s: _need(s) for s in range(4)}
    ckpt = {s: _need(s, ckpt=True) for s in range(4)}
    both = {s: _need(s, ckpt=True, nvme=True) for s in (1, 2, 3)}
    assert all(ckpt[s] < plain[s] for s in range(4)) and all(both[s] < ckpt[s] for s in (1, 2, 3))
    nvme = str(tmp_path)
    # Room for every stage as it is: no recompute, no files.
    exps, _ = _tiers(max(plain.values()) * 1.01, nvme)
    assert {e.choice.stage for e in exps} == {0, 1, 2, 3}
    assert not any(e.choice.checkpoint or e.choice.offload_optimizer != "none" for e in exps)
    # No stage fits as it is; checkpointing alone fits at some: those stages checkpoint, none offloads
    # there, and an offload tier appears only at a stage where checkpointing alone does not fit.
    budget = (min(plain.values()) + min(ckpt.values())) / 2
    assert budget < min(plain.values())
    exps, _ = _tiers(budget, nvme)
    assert exps and all(e.choice.checkpoint for e in exps) and all(e.predicted_bytes <= budget for e in exps)
    for e in exps:
        assert (e.choice.offload_optimizer == "nvme") == (ckpt[e.choice.stage] > budget), e.name
    # Only NVMe offload with checkpointing fits: every experiment offloads, and each config says where.
    budget = (min(ckpt.values()) + min(both.values())) / 2
    exps, pruned = _tiers(budget, nvme)
    assert exps and all(e.choice.offload_optimizer == "nvme" and e.choice.checkpoint for e in exps)
    for e in exps:
        zero = e.config["zero_optimization"]
        assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": nvme} and zero["sub_group_size"] > 0
        assert e.config["deepfleet_activation_checkpointing"] == {"mode": "blocks", "every": 1}
        load_config(e.config, world_size=2)
    # parameter offload is not a choice: it lowers no step's high-water mark
    assert all(e.choice.offload_param == "none" and "offload_param" not in e.config["zero_optimization"]
               for e in exps)
    # Without a directory for NVMe nothing fits that budget.
    exps, pruned = _tiers(budget, None)
    assert exps == [] and pruned


def test_the_full_grid_also_tries_checkpointing_where_the_state_fits(tmp_path: Path) -> None:
    exps, _ = experiments(_profile(), _base(tmp_path, fast=False, min_train_micro_batch_size_per_gpu=MB,
                                            max_train_micro_batch_size_per_gpu=MB),
                          world_size=2, budget_bytes=1 << 30, accelerator=False, nvme_path=str(tmp_path))
    names = {e.name for e in exps}
    assert {"z0_mbs8", "z0_ckpt2_mbs8", "z3_optnvme_mbs8", "z3_optnvme_ckpt2_mbs8"} <= names
    assert not any(e.choice.offload_optimizer == "cpu" for e in exps)  # no accelerator: CPU offload saves nothing


def test_a_base_config_that_checkpoints_keeps_its_choice(tmp_path: Path) -> None:
    base = _base(tmp_path, fast=False, max_train_micro_batch_size_per_gpu=2)
    base["deepfleet_activation_checkpointing"] = {"mode": "blocks", "every": 2}
    exps, _ = experiments(_profile(), base, world_size=2, budget_bytes=None, accelerator=False)
    assert exps and all(e.choice.checkpoint == (0,) for e in exps)
    assert all(e.config["deepfleet_activation_checkpointing"] == {"mode": "blocks", "every": 2} for e in exps)


def test_an_nvme_path_that_is_not_a_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--nvme-path: .* is not a directory; create it"):
        tune(_base(tmp_path), MODEL, world_size=2, budget_gib=1.0, runner=lambda e, s: {}, profile=_profile(),
             nvme_path=tmp_path / "missing")


def test_under_a_tight_budget_the_pick_checkpoints_offloads_to_nvme_and_trains(tmp_path: Path) -> None:
    ckpt = min(_need(s, ckpt=True) for s in range(4))
    both = min(_need(s, ckpt=True, nvme=True) for s in (1, 2, 3))
    budget = (ckpt + both) / 2
    base = _base(tmp_path, min_train_micro_batch_size_per_gpu=MB, max_train_micro_batch_size_per_gpu=MB,
                 tuner_early_stopping=50)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ranks = spawn(tune_then_train, 2, base, budget / 2**30, str(nvme), timeout=300)
    for r in ranks:
        assert r["errors"] and all(err is None for err in r["errors"]), r["errors"]
        assert r["best"] == ranks[0]["best"] and "optnvme_ckpt2" in r["best"]
        assert r["tried"] and all("optnvme_ckpt2" in name for name in r["tried"])
        assert r["recompute"] == ["full", "full"] and r["nvme_files"]  # the state lives in files
        assert all(x == x for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
    written = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert written == ranks[0]["config"] and written["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    load_config(written, world_size=2)


def test_the_cli_takes_an_nvme_path_and_refuses_a_missing_one_in_one_line(tmp_path: Path, capsys) -> None:
    from deepfleet.engine.planner.tune_cli import main

    code = main([json.dumps(_base(tmp_path)), "--model", MODEL, "--world-size", "2", "--budget-gib", "1",
                 "--nvme-path", str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("--nvme-path: ") and "create it" in err[0]
