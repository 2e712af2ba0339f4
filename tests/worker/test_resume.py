"""A checkpoint the backend mounted read-only (Kubernetes: the source job's claim directory; Azure ML: the
source's checkpoint input), as the worker meets it: a real checkpoint saved by the engine, its files and
directories made read-only. Serving loads it from there (`worker.serve.build_engine`) and writes nothing
into it; a training job's worker copies it into its own checkpoint dir (`worker.resume.seed_from`) with
writable modes, leaves the source as it was, keeps its own newer checkpoints on a later attempt, and
replaces a copy that was cut short; and the real worker, given `--resume-dir`, trains on from that
checkpoint's step in its own directory. `deepfleet-worker --checkpoint-dir/--resume-dir` set both paths."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepfleet.engine.checkpoint.layout import COMPLETE, find_latest_complete, read_latest
from deepfleet.worker.resume import seed_from
from deepfleet.worker.serve import build_engine
from deepfleet.worker.spec import WorkerSpec
from tests.spawn import spawn
from tests.worker.run_worker import run_worker

ROOT = Path(__file__).resolve().parents[2]
ARGS = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "num_samples": 16}
IDS = torch.tensor([[3, 9, 27, 17, 8, 40, 1, 5]])
CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "seed": 7}


def _train_and_save(rank: int, world: int, root: str) -> torch.Tensor:
    """Two optimizer steps of the example GPT through the real engine, saved under `root`; returns the
    trained model's logits on IDS."""
    import deepfleet.engine as deepfleet
    from examples.gpt.factories import build

    job = build(**ARGS)
    engine, _, loader, _ = deepfleet.initialize(model=job.model, config=CONFIG, training_data=job.training_data)
    for batch, _ in zip(loader, range(2), strict=False):
        engine.backward(engine(batch))
        engine.step()
    engine.save_checkpoint(root)
    with torch.no_grad():
        return engine.module.gpt(IDS)


def _tree(root: Path) -> dict[str, tuple[int, str, float]]:
    """Every entry under `root`: mode, sha256 of a file's bytes, modification time."""
    out = {}
    for path in sorted([root, *root.rglob("*")]):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (st.st_mode, digest, st.st_mtime)
    return out


def _read_only(root: Path) -> None:
    for path in sorted([root, *root.rglob("*")], reverse=True):
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture(scope="module")
def mounted(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """(a read-only checkpoint root as a backend mounts it, the trained logits)."""
    root = tmp_path_factory.mktemp("source") / "checkpoints"
    logits = spawn(_train_and_save, 1, str(root))[0]
    _read_only(root)
    yield root, logits
    for path in [root, *root.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)  # so pytest can remove it


def _serving_spec(checkpoint_dir: Path) -> WorkerSpec:
    return WorkerSpec.model_validate({
        "job_id": "serve1", "platform": "kubernetes",
        "entrypoint": {"factory": "examples.gpt.factories:build", "args": ARGS},
        "checkpoint": {"dir": str(checkpoint_dir), "resume_from": "0123456789abcdef"},
        "serve": {"dtype": "fp32", "max_out_tokens": 16},
    })


def test_serving_loads_a_read_only_checkpoint_and_writes_nothing_into_it(mounted) -> None:
    root, trained = mounted
    assert not os.access(root, os.W_OK) or os.geteuid() == 0  # root ignores modes: the tree check below decides
    before = _tree(root)
    engine = build_engine(_serving_spec(root))
    torch.testing.assert_close(engine(IDS), trained, atol=1e-5, rtol=1e-5)
    assert _tree(root) == before  # no file added, changed, touched or re-moded


def test_a_training_job_starts_from_a_copy_and_leaves_the_source_as_it_was(mounted, tmp_path: Path) -> None:
    root, _ = mounted
    before = _tree(root)
    own = tmp_path / "own"
    tag = seed_from(root, into=own)
    assert tag == find_latest_complete(root) and read_latest(own) == tag
    assert _tree(root) == before
    copied = {p.relative_to(own / tag): p.read_bytes() for p in (own / tag).rglob("*") if p.is_file()}
    assert copied == {p.relative_to(root / tag): p.read_bytes() for p in (root / tag).rglob("*") if p.is_file()}
    assert all(p.stat().st_mode & stat.S_IWUSR for p in [own, *own.rglob("*")])  # retention may delete them
    assert not [p.name for p in own.iterdir() if p.name.startswith(".")]  # no staging directory left
    assert seed_from(root, into=own) is None  # its own checkpoint now: a later attempt resumes from that


def test_a_copy_cut_short_is_replaced_and_an_empty_source_copies_nothing(mounted, tmp_path: Path) -> None:
    root, _ = mounted
    tag = find_latest_complete(root)
    own = tmp_path / "own"
    (own / tag).mkdir(parents=True)
    (own / tag / "manifest.json").write_text("{}")  # no COMPLETE: never loaded, so replaced
    assert seed_from(root, into=own) == tag and (own / tag / COMPLETE).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert seed_from(empty, into=tmp_path / "fresh") is None and not (tmp_path / "fresh").exists()
    with pytest.raises(FileNotFoundError, match="resume_dir"):
        seed_from(tmp_path / "not-mounted", into=tmp_path / "fresh")


def _cli(*args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPFLEET_", "AZUREML_", "JOB_COMPLETION"))}
    return subprocess.run([sys.executable, "-m", "deepfleet.worker.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=base)


def test_the_cli_takes_the_checkpoint_paths_the_backend_mounted() -> None:
    spec = {"job_id": "j", "entrypoint": {"script": "train.py"}, "checkpoint": {"dir": "served", "resume_from": "src"}}
    proc = _cli("--check", "--spec", json.dumps(spec), "--checkpoint-dir", "/mnt/out", "--resume-dir", "/mnt/in")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(", checkpoints in /mnt/out, starts from /mnt/in")
    proc = _cli("--check", "--spec", json.dumps({"job_id": "j", "entrypoint": {"script": "train.py"}}),
                "--resume-dir", "/mnt/in")
    assert proc.returncode == 64 and proc.stderr.strip().splitlines() == [
        "deepfleet-worker: --checkpoint-dir/--resume-dir: the spec has no checkpoint section; drop the option or "
        "add checkpoint to the spec"]


def test_the_worker_trains_on_from_the_mounted_checkpoint_in_its_own_directory(mounted, tmp_path: Path) -> None:
    root, _ = mounted
    before = _tree(root)
    own = tmp_path / "own"
    spec = {"job_id": "resumed", "entrypoint": {"factory": "examples.gpt.factories:build", "args": ARGS},
            "engine_config": CONFIG, "max_steps": 3, "log_every_steps": 1,
            "checkpoint": {"dir": "unused", "resume_from": "0123456789abcdef"},
            "rendezvous": {"port": 0, "last_call_timeout_s": 2, "join_timeout_s": 60},
            "restart": {"max_restarts": 0}, "monitor_interval_s": 0.2}
    env = {"DEEPFLEET_NODE_RANK": "0", "DEEPFLEET_NNODES": "1", "DEEPFLEET_MASTER_ADDR": "127.0.0.1"}
    code, log = run_worker(spec, timeout=150, wait_s=30, extra_env=env,
                           args=["--checkpoint-dir", str(own), "--resume-dir", str(root)])
    assert code == 0, log
    assert "starting from checkpoint global_step2 of job 0123456789abcdef" in log
    assert "starting at step 2/3 from checkpoint global_step2" in log, log
    assert read_latest(own) == "global_step3" and _tree(root) == before


def test_nodes_sharing_the_checkpoint_dir_seed_it_once_between_them(mounted, tmp_path: Path) -> None:
    """Every node of a job runs the copy into the one shared directory at the same time: each gets the
    tag, the directory holds one complete copy, and no staging directory is left."""
    from concurrent.futures import ProcessPoolExecutor

    root, _ = mounted
    own = tmp_path / "shared"
    with ProcessPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(seed_from, root, into=own) for _ in range(3)]
        tags = [f.result(timeout=120) for f in futures]
    tag = find_latest_complete(root)  # a node that comes after a finished copy has nothing to do (None)
    assert set(tags) <= {tag, None} and tag in tags and read_latest(own) == tag
    assert sorted(p.name for p in own.iterdir()) == sorted([tag, "latest"])
    assert {p.relative_to(own / tag): p.read_bytes() for p in (own / tag).rglob("*") if p.is_file()} == \
        {p.relative_to(root / tag): p.read_bytes() for p in (root / tag).rglob("*") if p.is_file()}
