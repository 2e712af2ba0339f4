"""End to end on PostgreSQL with the real controller and `deepfleet-worker`: a tiny GPT job trains to
SUCCEEDED, then a ServingJob of its checkpoint reaches RUNNING with its endpoint's address, answers
/v1/completions (plain and streamed) with the tokens `init_inference` gives on the same checkpoint in this
process, and CANCEL stops the serving process; the serving job ran in its own area with a copy of the
checkpoint and the job-scoped token only."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from deepfleet.controller.backends.local import _marked
from deepfleet.controller.cli_jobs import load_job_document
from deepfleet.controller.spec import SERVED_CHECKPOINT_DIR
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import checkpoint_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# vocab 256: every token is one byte, so the endpoint's text (UTF-8 bytes) is the token sequence itself.
ARGS = {"vocab_size": 256, "seq_len": 32, "d_model": 32, "n_heads": 4, "n_layers": 2, "num_samples": 64}
PROMPT = [72, 101, 108, 108, 111, 32, 119]
NEW = 12


def train_doc() -> str:
    doc = json.loads(load_job_document(ROOT / "examples" / "gpt" / "job.yaml"))
    doc["metadata"].update(name="tiny-train", project="test")
    doc["spec"].update(nodes=1, maxSteps=4, checkpoint={"dir": "ck", "everySteps": 2},
                       restartPolicy={"maxRestarts": 0})
    doc["spec"]["entrypoint"]["args"] = ARGS
    doc["spec"]["engine"].pop("train_batch_size", None)
    return json.dumps(doc)


def serve_doc(job_id: str) -> str:
    doc = yaml.safe_load((ROOT / "examples" / "gpt" / "serve.yaml").read_text())
    doc["metadata"].update(name="tiny-serve", project="test")
    doc["spec"]["model"].update(job=job_id, args=ARGS)
    doc["spec"].update(maxOutTokens=32, maxBatchSize=4)
    return yaml.safe_dump(doc)


def reference_tokens(ckpt: Path) -> list[int]:
    """Greedy tokens of init_inference on the trained checkpoint, in this process."""
    from deepfleet.engine.inference.engine import init_inference
    from examples.gpt.factories import build

    engine = init_inference(build(**ARGS).model, dtype="fp32", checkpoint=str(ckpt), max_batch_size=1,
                            max_out_tokens=32)
    out = engine.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def test_a_serving_job_serves_a_trained_checkpoint_until_cancelled(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    c = Controller(db_url, data, workdir=ROOT, heartbeat_interval=1.0)
    try:
        trained = c.client.submit(train_doc(), content_type="application/json")
        done = wait_phase(c.client, trained["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout=240)
        assert done["phase"] == "SUCCEEDED", c.client.logs(trained["id"], tail=30)
        expected = reference_tokens(checkpoint_dir(data, trained["id"], "ck"))

        served = c.client.submit(serve_doc(trained["id"]))
        job = wait_phase(c.client, served["id"], {"RUNNING", "FAILED", "SUCCEEDED"}, timeout=240)
        assert job["phase"] == "RUNNING", c.client.logs(served["id"], tail=30)
        endpoint = job["endpoint"]
        assert endpoint.startswith("http://127.0.0.1:") and endpoint in job["message"]
        assert any(e["type"] == "Running" and endpoint in e["message"] for e in c.client.events(served["id"]))
        # Its own area holds a copy of the training job's newest complete checkpoint.
        copied = checkpoint_dir(data, served["id"], SERVED_CHECKPOINT_DIR)
        tag = (checkpoint_dir(data, trained["id"], "ck") / "latest").read_text().strip()
        assert (copied / "latest").read_text().strip() == tag and (copied / tag / "COMPLETE").is_file()

        body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
        r = httpx.post(endpoint + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == NEW
        assert answer["choices"][0]["text"] == bytes(expected).decode("utf-8", errors="replace")
        with httpx.stream("POST", endpoint + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            chunks = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        assert "".join(json.loads(ch)["choices"][0]["text"] for ch in chunks[:-1]) == answer["choices"][0]["text"]
        assert httpx.post(endpoint + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}).status_code == 400

        run = f"df-tiny-serve-{served['id'][:8]}-a0"
        pids = _marked(run)
        assert pids
        environ = Path(f"/proc/{max(pids)}/environ").read_bytes().split(b"\0")
        names = {item.split(b"=", 1)[0].decode() for item in environ if item}
        assert "DEEPFLEET_ADMIN_TOKEN" not in names and "DEEPFLEET_SECRET" not in names and "DEEPFLEET_TOKEN" in names

        c.client.cancel(served["id"])
        cancelled = wait_phase(c.client, served["id"], {"CANCELLED"}, timeout=60)
        assert cancelled["endpoint"] is None
        assert _marked(run) == []
        with pytest.raises(httpx.HTTPError):
            httpx.post(endpoint + "/v1/completions", json=body, timeout=5)
    finally:
        c.stop()
