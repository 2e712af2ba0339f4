"""The MoE job example: `examples/gpt/moe_job.yaml` validates as a job spec with its engine config's
`moe` section, and the managed loop's factory (`examples.gpt.factories:build_moe`) builds the MoE GPT
that section describes, reading it from the job environment the worker sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deepfleet.controller.spec import validate_job
from deepfleet.engine.job_env import ENGINE_CONFIG_ENV

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt"


def test_moe_job_spec_validates() -> None:
    doc = yaml.safe_load((EXAMPLE / "moe_job.yaml").read_text())
    doc["spec"]["engine"] = json.loads((EXAMPLE / doc["spec"]["engine"]).read_text())
    job = validate_job(doc)
    assert job is not None


def test_factory_builds_the_configured_moe_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepfleet.engine.moe.groups import model_ep_sizes, moe_layers
    from examples.gpt.factories import build_moe

    monkeypatch.setenv(ENGINE_CONFIG_ENV, (EXAMPLE / "moe_ds_config.json").read_text())
    job = build_moe(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, num_samples=8)
    layers = moe_layers(job.model)
    assert len(layers) == 2 and model_ep_sizes(job.model, 2) == [2]
    assert {(layer.gate.num_experts, layer.gate.k, layer.gate.capacity_factor) for layer in layers} == {(4, 2, 1.25)}
    monkeypatch.setenv(ENGINE_CONFIG_ENV, json.dumps({"moe": {"num_experts": 4, "ep_size": 3}}))
    with pytest.raises(ValueError, match="ep_size"):
        build_moe()
