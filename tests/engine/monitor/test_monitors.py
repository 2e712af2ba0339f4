"""The monitors: one training run with tensorboard, csv_monitor, wandb (offline) and mlflow (local
SQLite store) enabled; each output is read back with its own reader (TensorBoard's event reader, CSV
rows, the W&B offline run file, MlflowClient) and holds the run's loss values. A monitor that fails
while training is logged and training goes on; comet without comet_ml fails initialize in one line;
other ranks than 0 get no monitors."""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import shutil
import struct
import sys
import warnings
import zipfile

import pytest
import torch
import torch.distributed as dist

from deepfleet.engine.config import load_config
from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import Guarded, build_monitors

STEPS, MICRO = 4, 2
MLFLOW_NOISE = "ignore:The ``noload`` loader strategy is deprecated"  # MLflow 3.18 on SQLAlchemy 2.1


def train(config: dict, *, steps: int = STEPS, between=None) -> tuple[list[StepMetrics], object]:
    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=1)
    engine, _, loader, _ = deepspeed.initialize(
        model=GPTWithLoss(cfg), training_data=SyntheticTokens(num_samples=64, seq_len=16, vocab_size=64),
        config={"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                **config})
    seen: list[StepMetrics] = []
    engine.sinks.insert(0, seen.append)
    try:
        for i, batch in enumerate(loader):
            if i == steps:
                break
            engine.backward(engine(batch))
            engine.step()
            if between is not None:
                between(i, engine)
        engine.destroy()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return seen, engine


def _train_in(folder, config: dict) -> list[StepMetrics]:
    cwd = os.getcwd()
    os.chdir(folder)  # wandb's ./wandb and mlflow's ./mlruns.db land here
    try:
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The ``noload`` loader strategy")
            mp.setenv("WANDB_MODE", "offline")
            mp.delenv("MLFLOW_TRACKING_URI", raising=False)
            seen, _ = train(config)
    finally:
        os.chdir(cwd)
    return seen


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """TensorBoard and CSV: no service, seconds."""
    folder = tmp_path_factory.mktemp("monitors")
    return folder, _train_in(folder, {
        "tensorboard": {"enabled": True, "output_path": str(folder / "tb"), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": str(folder / "csv"), "job_name": "job"},
    })


@pytest.fixture(scope="module")
def service_run(tmp_path_factory):
    """W&B (its local service process) and MLflow (SQLite schema migrations): tens of seconds."""
    folder = tmp_path_factory.mktemp("monitors_services")
    return folder, _train_in(folder, {
        "wandb": {"enabled": True, "project": "deepfleet-test"},
        "mlflow": {"enabled": True, "experiment_name": "monitors", "run_name": "r1"},
    })


def expected(seen: list[StepMetrics]) -> list[tuple[int, float]]:
    return [(m.global_samples, m.loss) for m in seen]


def same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """Same steps, same losses (TensorBoard keeps float32)."""
    return [s for s, _ in got] == [s for s, _ in want] and [v for _, v in got] == pytest.approx(
        [v for _, v in want], rel=1e-6)


def test_tensorboard_events_hold_the_losses(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, seen = run
    acc = EventAccumulator(str(folder / "tb" / "job"))
    acc.Reload()
    events = acc.Scalars("Train/Samples/train_loss")
    assert same([(e.step, e.value) for e in events], expected(seen))
    assert "Train/Samples/lr" in acc.Tags()["scalars"]


def test_csv_rows_hold_the_losses(run) -> None:
    folder, seen = run
    with open(folder / "csv" / "job" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert same([(int(s), float(v)) for s, v in rows[1:]], expected(seen))


def read_wandb_history(path: str) -> list[dict[str, str]]:
    """History records of a W&B run file: a 7-byte header, then LevelDB-log framed protobuf records
    (32 KiB blocks; each chunk: crc32, length, type; type 1 = full, 2/3/4 = first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # block padding
            pos += left - 7
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            records.append(chunk)
            chunk = b""
    history = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return history


@pytest.mark.slow
def test_wandb_offline_run_file_holds_the_losses(service_run) -> None:
    folder, seen = service_run
    [path] = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = read_wandb_history(path)
    got = [(int(h["_step"]), float(h["Train/Samples/train_loss"])) for h in history]
    assert same(got, expected(seen))


@pytest.mark.slow
@pytest.mark.filterwarnings(MLFLOW_NOISE)
def test_mlflow_run_holds_the_losses(service_run) -> None:
    from mlflow.tracking import MlflowClient

    folder, seen = service_run
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlruns.db'}")
    experiment = client.get_experiment_by_name("monitors")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "r1" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "train_loss")
    assert same(sorted((m.step, m.value) for m in history), expected(seen))


def test_a_failing_monitor_is_logged_and_training_goes_on(tmp_path, caplog) -> None:
    out = tmp_path / "csv"

    def break_the_folder(i: int, engine) -> None:
        if i == 1:  # from the third step on, the monitor's folder is a file: every write fails
            shutil.rmtree(out / "job")
            (out / "job").write_text("not a folder")
            sink = next(s for s in engine.sinks if isinstance(s, Guarded))
            sink.flush()
            sink.monitor.close()  # drop its open files: the next write reopens them, and fails

    with caplog.at_level(logging.WARNING, "deepfleet.engine.monitor"):
        seen, _ = train({"csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "job"}},
                        between=break_the_folder)
    assert [m.step for m in seen] == [1, 2, 3, 4]
    failures = [r.getMessage() for r in caplog.records if "monitor csv_monitor failed" in r.getMessage()]
    assert len(failures) == 1 and "training goes on" in failures[0]  # logged once, not once per step


def read_comet_offline_metrics(folder) -> list[tuple[int, float]]:
    """(step, value) of `train_loss` from a Comet offline archive (a zip whose messages.json holds one
    JSON message per line; metric messages carry metricName, metricValue and step)."""
    [archive] = glob.glob(str(folder / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        lines = z.read("messages.json").decode().splitlines()
    out = []
    for line in lines:
        message = json.loads(line)
        metric = message.get("payload", {}).get("metric") if message.get("type") == "metric_msg" else None
        if metric and metric["metricName"] == "Train/Samples/train_loss":
            out.append((int(metric["step"]), float(metric["metricValue"])))
    return out


@pytest.mark.slow
def test_comet_offline_experiment_holds_the_losses(tmp_path, monkeypatch) -> None:
    pytest.importorskip("comet_ml")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    monkeypatch.setenv("COMET_GIT_DIRECTORY", str(tmp_path))  # no repository: nothing of ours is uploaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # comet_ml's own deprecation noise at import
        seen = _train_in(tmp_path, {"comet": {"enabled": True, "online": False, "project": "deepfleet-test",
                                              "experiment_name": "r1", "samples_log_interval": 1}})
    assert same(read_comet_offline_metrics(tmp_path / "comet"), expected(seen))


def test_comet_without_comet_ml_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # what an environment without the package sees
    config = load_config({"train_micro_batch_size_per_gpu": 1, "comet": {"enabled": True}})
    with pytest.raises(ValueError) as e:
        build_monitors(config, rank=0)
    assert str(e.value) == ("comet.enabled: needs the comet_ml package, which is not installed; "
                            "pip install 'deepfleet[monitor]' (or comet_ml), or set comet.enabled to false")


def test_only_rank_zero_gets_monitors(tmp_path) -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1,
                          "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    assert build_monitors(config, rank=1) == []
    [sink] = build_monitors(config, rank=0)
    assert sink.name == "csv_monitor"
    sink.close()
