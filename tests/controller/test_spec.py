"""JobSpec parsing: the example document, field-path errors for bad input, world size, the frozen schema."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from deepfleet.controller.spec import JobSpec, SpecError, job_world_size, node_bounds, parse_job_yaml
from tests.controller.snapshot import assert_matches_snapshot

EXAMPLE = textwrap.dedent(
    """
    apiVersion: deepfleet/v1
    kind: TrainingJob
    metadata: {name: gpt-small, project: research, labels: {team: nlp}}
    spec:
      backend: local
      image: registry.example.com/deepfleet-worker:0.1
      nodes: 2
      processesPerNode: 1
      resources: {cpu: "2", memory: 8Gi, gpu: 0, gpuType: null}
      entrypoint: {script: examples/gpt/train.py, args: ["--steps", "50"]}
      checkpoint: {dir: ./runs/gpt-small, everySteps: 20, keepLast: 3}
      restartPolicy: {maxRestarts: 3, backoffSeconds: 5}
      priority: normal
      queue: default
      env: {KEY: value}
    """
)


def _errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job_yaml(text)
    return info.value.errors


def test_example_parses_and_round_trips() -> None:
    spec = parse_job_yaml(EXAMPLE)
    assert spec.metadata.name == "gpt-small"
    assert spec.spec.processes_per_node == 1
    assert spec.spec.entrypoint.script == "examples/gpt/train.py"
    assert spec.spec.checkpoint.every_steps == 20
    assert job_world_size(spec) == 2
    again = JobSpec.model_validate(spec.to_document())
    assert again == spec
    assert spec.to_document()["spec"]["processesPerNode"] == 1


def test_elastic_nodes_and_factory_entrypoint() -> None:
    text = EXAMPLE.replace("nodes: 2", "nodes: {min: 1, max: 4}").replace(
        "{script: examples/gpt/train.py, args: [\"--steps\", \"50\"]}", "{factory: \"examples.gpt.model:build\"}"
    ).replace("processesPerNode: 1", "processesPerNode: 2")
    with pytest.raises(SpecError) as e:  # the managed loop needs a step budget, caught at submit
        parse_job_yaml(text)
    assert e.value.errors == [
        "spec.maxSteps: a factory entrypoint needs it; set spec.maxSteps to the optimizer steps to train"]
    spec = parse_job_yaml(text.replace("processesPerNode: 2", "processesPerNode: 2\n  maxSteps: 5"))
    assert node_bounds(spec) == (1, 4)
    assert job_world_size(spec) == 8
    assert spec.spec.entrypoint.factory == "examples.gpt.model:build" and spec.spec.max_steps == 5


def test_factory_args_are_a_typed_mapping_and_the_old_strings_say_the_rewrite() -> None:
    text = EXAMPLE.replace(
        "{script: examples/gpt/train.py, args: [\"--steps\", \"50\"]}",
        "{factory: \"examples.gpt.model:build\", args: {d_model: 64, lr: 5e-4, tied: true}}",
    ).replace("processesPerNode: 1", "processesPerNode: 1\n  maxSteps: 5")
    assert parse_job_yaml(text).spec.entrypoint.args == {"d_model": 64, "lr": 5e-4, "tied": True}
    old = text.replace("{d_model: 64, lr: 5e-4, tied: true}", "[\"max_steps=40\", \"d_model=64\"]")
    with pytest.raises(SpecError) as e:
        parse_job_yaml(old)
    assert e.value.errors == ["spec.entrypoint.args: factory args are a mapping now, not key=value strings; "
                              "write args: {d_model: 64} and move max_steps: 40 to spec.maxSteps"]
    with pytest.raises(SpecError) as e:
        parse_job_yaml(text.replace("d_model: 64", "max_steps: 64"))
    assert e.value.errors == ["spec.entrypoint.args: max_steps is the job's step budget, not a factory "
                              "argument; move it to spec.maxSteps"]


def test_restart_policy_is_the_workers_model_with_one_set_of_defaults() -> None:
    from deepfleet.controller.lifecycle import JobState, Phase
    from deepfleet.worker.spec import RestartPolicy

    spec = parse_job_yaml(EXAMPLE)
    assert isinstance(spec.spec.restart_policy, RestartPolicy)
    defaults = RestartPolicy()
    state = JobState(phase=Phase.RUNNING)
    assert (state.max_restarts, state.backoff_seconds, state.retry_user_errors) == (
        defaults.max_restarts, defaults.backoff_seconds, defaults.retry_on_user_error)
    none = parse_job_yaml(EXAMPLE.replace("maxRestarts: 3", "maxRestarts: 0"))
    assert none.spec.restart_policy.in_place_budget == 0


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("name: gpt-small", "name: GPT_small", "metadata.name: must be a DNS-1123 label"),
        ("name: gpt-small", "name: " + "a" * 41, "metadata.name: String should have at most 40 characters"),
        ("backend: local", "backend: slurm", "spec.backend: Input should be 'local', 'kubernetes' or 'azureml'"),
        ("nodes: 2", "nodes: 0", "spec.nodes: Input should be greater than or equal to 1"),
        ("nodes: 2", "nodes: {min: 3, max: 2}", "spec.nodes: min (3) is greater than max (2); set min <= max"),
        ("processesPerNode: 1", "processesPerNode: 1\n  gpus: 2", "spec.gpus: unknown field; remove it"),
        ("everySteps: 20", "everySteps: 20, every: 3", "spec.checkpoint.every: unknown field"),
        ("memory: 8Gi", "memory: lots", "spec.resources.memory: must be a Kubernetes quantity"),
        ("{script: examples/gpt/train.py,", "{module: examples/gpt/train.py,", "spec.entrypoint: give either"),
        ("env: {KEY: value}", "env: {DEEPFLEET_TOKEN: x}", "spec.env: DEEPFLEET_TOKEN is set by deepfleet"),
        ("env: {KEY: value}", "env: {DEEPFLEET_CA_BUNDLEX: x}", "spec.env: DEEPFLEET_CA_BUNDLEX is set by deepfleet"),
        ("queue: default", "queue: default\n  registerModel: {name: gpt-small, dtype: int8}",
         "spec.registerModel.dtype: Input should be 'fp32', 'bf16' or 'fp16'"),
        ("queue: default", "queue: default\n  registerModel: {name: 'gpt small'}", "spec.registerModel.name: String"),
        ("checkpoint: {dir: ./runs/gpt-small, everySteps: 20, keepLast: 3}", "registerModel: {name: gpt-small}",
         "spec.registerModel: the model is exported from the newest complete checkpoint; set checkpoint"),
        ("backend: local", "backend: kubernetes\n  registerModel: {name: gpt-small}",
         "spec.registerModel: not supported on backend kubernetes yet"),
        ("priority: normal", "priority: urgent", "spec.priority: Input should be 'low', 'normal' or 'high'"),
        ("backend: local\n  image: registry.example.com/deepfleet-worker:0.1", "backend: kubernetes",
         "spec.image: required for backend kubernetes"),
        ("queue: default", "queue: default\n  azureml: {compute: c}", "spec.azureml: only applies to backend azureml; remove"),
        ("apiVersion: deepfleet/v1", "apiVersion: deepfleet/v2", "apiVersion: Input should be 'deepfleet/v1'"),
    ],
)
def test_bad_fields_are_named_with_a_fix(old: str, new: str, expected: str) -> None:
    text = EXAMPLE.replace(old, new)
    assert text != EXAMPLE
    errors = _errors(text)
    assert any(line.startswith(expected) for line in errors), errors


def test_every_problem_is_reported_at_once() -> None:
    text = EXAMPLE.replace("nodes: 2", "nodes: -1").replace("priority: normal", "priority: top")
    errors = _errors(text)
    assert [e.split(":")[0] for e in errors] == ["spec.nodes", "spec.priority"]


def test_missing_field_and_malformed_yaml() -> None:
    assert _errors(EXAMPLE.replace("  entrypoint:", "  # entrypoint:")) == [
        "spec.entrypoint: required field is missing; add it"
    ]
    (line,) = _errors("apiVersion: [deepfleet/v1\nkind: x")
    assert line.startswith("(document): malformed YAML at line 2")
    (line,) = _errors(EXAMPLE.replace("priority: normal", "priority: normal\n  priority: high"))
    assert line.startswith("(document): malformed YAML at line ") and "duplicate key 'priority'" in line
    assert _errors("- just\n- a list") == [
        "(document): expected a mapping with apiVersion, kind, metadata, spec; got list"
    ]


def test_yaml_scalars_in_env_and_resources_become_strings() -> None:
    spec = parse_job_yaml(EXAMPLE.replace("env: {KEY: value}", "env: {N: 1, FLAG: true}").replace('cpu: "2"', "cpu: 2")
                          .replace('"--steps", "50"', '"--steps", 50, "--lr", 0.5').replace("team: nlp", "v: 2"))
    assert spec.spec.env == {"N": "1", "FLAG": "true"}
    assert spec.spec.entrypoint.args == ["--steps", "50", "--lr", "0.5"]
    assert spec.metadata.labels == {"v": "2"}
    assert spec.spec.resources.cpu == "2"


def test_engine_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        parse_job_yaml(EXAMPLE.replace("queue: default", "queue: default\n  engine: ./nope.json"), base_dir=tmp_path)
    (line,) = info.value.errors
    assert line.startswith("spec.engine: file './nope.json' not found")


def test_engine_config_is_validated_at_world_size(tmp_path: Path) -> None:
    pytest.importorskip("deepfleet.engine.config")
    # 2 nodes x 1 process: a global batch of 3 with micro batch 1 cannot split over 2 ranks.
    bad = EXAMPLE.replace(
        "queue: default",
        "queue: default\n  engine: {train_batch_size: 3, train_micro_batch_size_per_gpu: 1}",
    )
    errors = _errors(bad)
    assert errors and all(e.startswith("spec.engine.") for e in errors), errors
    unknown = EXAMPLE.replace("queue: default", "queue: default\n  engine: {train_batch_size: 4, zero_optimisation: {}}")
    errors = _errors(unknown)
    assert any("zero_optimisation" in e and e.startswith("spec.engine.") for e in errors), errors
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}))
    good = parse_job_yaml(EXAMPLE.replace("queue: default", "queue: default\n  engine: ds.json"), base_dir=tmp_path)
    assert good.spec.engine == "ds.json"


def test_json_schema_snapshot() -> None:
    assert_matches_snapshot(JobSpec.model_json_schema(), "jobspec.schema.json")


def test_retry_on_user_error_reaches_the_restart_decision() -> None:
    """`restartPolicy.retryOnUserError` is what lets decide() retry a worker exit 65."""
    from deepfleet.controller.db.models import Job
    from deepfleet.controller.reconciler import Reconciler

    for flag in (True, False):
        spec = {"spec": {"restartPolicy": {"maxRestarts": 2, "retryOnUserError": flag}}}
        job = Job(spec=spec, phase="RUNNING", current_attempt=1, restart_counts={}, desired_state=None,
                  not_before=None, last_heartbeat=None)
        assert Reconciler._state(job, None).retry_user_errors is flag


def test_a_job_may_name_its_ca_bundle_and_ask_for_registration() -> None:
    from deepfleet.controller.compile import worker_spec

    text = EXAMPLE.replace("env: {KEY: value}", "env: {DEEPFLEET_CA_BUNDLE: /etc/deepfleet/ca.pem}")
    spec = parse_job_yaml(text.replace("queue: default", "queue: default\n  registerModel: {name: gpt-small, dtype: bf16}"))
    assert spec.spec.env == {"DEEPFLEET_CA_BUNDLE": "/etc/deepfleet/ca.pem"}
    ws = worker_spec(spec, job_id="j", attempt=0)
    assert ws.export is not None and ws.export.dtype == "bf16" and str(ws.export_dir) == "runs/gpt-small/export"
    assert worker_spec(parse_job_yaml(EXAMPLE), job_id="j", attempt=0).export is None
