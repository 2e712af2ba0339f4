"""MLflow model registry: an exported model that carries its job's provenance is registered (local store
by default) and read back with MLflow's own client, its tags naming the job and the provenance head."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepfleet.controller import provenance as prov
from deepfleet.controller.cli import app as cli_app


def _chain(job_id: str) -> dict:
    records, prev = [], prov.GENESIS
    for seq, (kind, data) in enumerate([("submit", {"spec_sha256": "0" * 64}), ("checkpoint", {"tag": "global_step2"})]):
        r = {"job_id": job_id, "seq": seq, "kind": kind, "attempt": 0, "time": "2026-12-02T13:00:00+00:00",
             "data": data, "prev_hash": prev}
        r["hash"] = prev = prov.record_hash(**r)
        records.append(r)
    return {"job_id": job_id, "head": prev, "records": records}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
def test_a_registered_model_reads_back_with_mlflows_client(tmp_path: Path) -> None:
    import torch
    from mlflow import MlflowClient
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepfleet.controller.registry import default_store
    from deepfleet.engine.provenance import model_metadata

    chain = _chain("f" * 32)
    model = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(model), metadata=model_metadata(chain))
    store = tmp_path / "mlruns"
    runner = CliRunner()
    for expected in ("1", "2"):  # a second registration is the model's next version
        result = runner.invoke(cli_app, ["register", str(model), "--name", "gpt-small", "--store-dir", str(store)])
        assert result.exit_code == 0, result.output
        assert f"registered gpt-small version {expected} (job {'f' * 32}" in result.output

    client = MlflowClient(tracking_uri=default_store(store), registry_uri=default_store(store))
    versions = sorted(client.search_model_versions("name = 'gpt-small'"), key=lambda v: int(v.version))
    assert [str(v.version) for v in versions] == ["1", "2"]
    v = versions[-1]
    assert v.tags == {"deepfleet.job_id": "f" * 32, "deepfleet.provenance_head": chain["head"]}
    assert client.get_run(v.run_id).data.tags["deepfleet.job_id"] == "f" * 32
    local = client.download_artifacts(v.run_id, "model/model.safetensors", str(tmp_path / "back"))
    assert Path(local).read_bytes() == model.read_bytes()
    with safe_open(local, framework="pt") as f:
        assert f.metadata()["deepfleet.provenance_head"] == chain["head"]


def test_a_model_without_provenance_is_refused_in_one_line(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "bare.safetensors"
    save_file({"w": torch.ones(1)}, str(model))
    result = CliRunner().invoke(cli_app, ["register", str(model), "--name", "m", "--store-dir", str(tmp_path / "s")])
    assert result.exit_code == 2 and "carries no job provenance" in result.output
    assert not (tmp_path / "s").exists()
