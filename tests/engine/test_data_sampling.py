"""DeepSpeed's `data_efficiency.data_sampling`: the data analyzer's index files, the curriculum sampler's
batches (value and percentile difficulty, several metrics, single clusters, custom schedules), and the
engine's curriculum loader on 2 gloo ranks, with checkpoint resume at the same and another world size."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import deepfleet.engine as deepspeed
from deepfleet.engine.checkpoint.state import save_small
from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.data_sampling import CurriculumDataSampler, DataAnalyzer
from deepfleet.engine.indexed_dataset import IndexedRows, smallest_int_dtype, write_rows
from tests.spawn import spawn

N = 60  # samples; sample i has length i % 10 + 1 and "rarity" i % 3


class Lengths(torch.utils.data.Dataset):
    """Sample i: 12 token ids, the first `i % 10 + 1` nonzero; the id is kept in the last slot."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.zeros(13, dtype=torch.long)
        x[: i % 10 + 1] = 1 + i % 5
        x[12] = i
        return x


def seqlen(batch: torch.Tensor) -> torch.Tensor:
    return (batch[:, :12] != 0).sum(dim=1)


def rarity(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, 12] % 3


def token_counts(batch: torch.Tensor) -> torch.Tensor:  # accumulate_value_over_samples: a histogram
    return torch.bincount(batch[:, :12].reshape(-1), minlength=6)


def analyze(root: Path, *, workers: int = 2, threads: int = 2) -> Path:
    names, fns = ["seqlen", "rarity", "vocab"], [seqlen, rarity, token_counts]
    kinds = ["single_value_per_sample", "single_value_per_sample", "accumulate_value_over_samples"]
    for w in range(workers):
        DataAnalyzer(Lengths(), num_workers=workers, worker_id=w, num_threads=threads, batch_size=7,
                     metric_names=names, metric_functions=fns, metric_types=kinds,
                     metric_dtypes=[torch.long] * 3, save_path=str(root)).run_map()
    DataAnalyzer(Lengths(), num_workers=workers, num_threads=threads, metric_names=names, metric_functions=fns,
                 metric_types=kinds, metric_dtypes=[torch.long] * 3, save_path=str(root)).run_reduce()
    return root


def metric_section(root: Path, name: str, **overrides) -> dict:
    section = {"index_to_sample_path": str(root / name / f"{name}_index_to_sample"),
               "index_to_metric_path": str(root / name / f"{name}_index_to_metric"),
               "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 2,
               "max_difficulty": 10, "schedule_type": "fixed_linear",
               "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}
    return {**section, **overrides}


def data_efficiency(root: Path, metrics: dict, *, seed: int = 7) -> dict:
    return {"enabled": True, "seed": seed, "data_sampling": {
        "enabled": True, "num_epochs": 5, "num_workers": 0,
        "curriculum_learning": {"enabled": True, "data_cluster_path": str(root / "clusters"),
                                "curriculum_metrics": metrics}}}


# ------------------------------------------------------------------------------------------ index files

def test_index_files_keep_rows_and_the_memory_mapped_layout(tmp_path) -> None:
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6], [65535]]
    write_rows(tmp_path / "x", rows, np.uint16)
    read = IndexedRows(tmp_path / "x")
    assert [r.tolist() for r in read] == rows and read.dtype == np.uint16
    assert read.sizes.tolist() == [3, 0, 5, 1] and read.doc_idx.tolist() == [0, 4]
    head = (tmp_path / "x.idx").read_bytes()
    # magic, version 1, dtype code 6 (uint16), 4 rows, 2 document boundaries, then sizes/pointers/docs
    assert head[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", head[9:34]) == (1, 6, 4, 2)
    assert np.frombuffer(head[34 + 16:34 + 48], np.int64).tolist() == [0, 6, 6, 16]  # byte offsets
    assert (tmp_path / "x.bin").stat().st_size == 9 * 2
    with pytest.raises(ValueError, match="do not fit uint16"):
        write_rows(tmp_path / "y", [[70000]], np.uint16)
    with pytest.raises(ValueError, match="float32 cannot be stored"):
        write_rows(tmp_path / "y", [[1]], np.float32)
    with pytest.raises(FileNotFoundError, match="run the data analyzer first"):
        IndexedRows(tmp_path / "missing")
    assert smallest_int_dtype(0, 255) == np.uint8 and smallest_int_dtype(-1, 200) == np.int16


def test_the_analyzer_indexes_every_sample_by_value_over_workers_and_threads(tmp_path) -> None:
    root = analyze(tmp_path)
    lengths = np.asarray([i % 10 + 1 for i in range(N)])
    by_sample = IndexedRows(root / "seqlen" / "seqlen_sample_to_metric")
    assert [int(r[0]) for r in by_sample] == lengths.tolist()
    to_sample = IndexedRows(root / "seqlen" / "seqlen_index_to_sample")
    to_metric = IndexedRows(root / "seqlen" / "seqlen_index_to_metric")
    assert [int(r[0]) for r in to_metric] == list(range(1, 11))
    for row, value in zip(to_sample, range(1, 11), strict=True):
        assert row.tolist() == np.flatnonzero(lengths == value).tolist()
    percentiles = IndexedRows(root / "seqlen" / "seqlen_index_to_sample_percentile_merged")
    merged = np.concatenate([np.asarray(r) for r in percentiles])
    assert len(percentiles) == 100 and sorted(merged.tolist()) == list(range(N))
    assert lengths[merged].tolist() == sorted(lengths.tolist())  # easiest first
    vocab = IndexedRows(root / "vocab" / "vocab_metric_value")[0]
    expected = torch.bincount(torch.stack([Lengths()[i][:12] for i in range(N)]).reshape(-1), minlength=6)
    assert vocab.tolist() == expected.tolist()


def test_analyzer_mistakes_are_named(tmp_path) -> None:
    with pytest.raises(TypeError, match="returned float32 values; the index stores integers"):
        DataAnalyzer(Lengths(), metric_names=["f"], metric_functions=[lambda b: b.float().mean(1)],
                     metric_types=["single_value_per_sample"], metric_dtypes=[torch.float32],
                     save_path=str(tmp_path)).run_map()
    with pytest.raises(ValueError, match="metric_types: \\['per_sample'\\] unknown"):
        DataAnalyzer(Lengths(), metric_names=["f"], metric_functions=[seqlen], metric_types=["per_sample"],
                     metric_dtypes=[torch.long])
    DataAnalyzer(Lengths(), num_workers=2, worker_id=0, metric_names=["seqlen"], metric_functions=[seqlen],
                 metric_types=["single_value_per_sample"], metric_dtypes=[torch.long],
                 save_path=str(tmp_path)).run_map()
    with pytest.raises(FileNotFoundError, match="map output missing \\(1 of 2 pieces\\)"):
        DataAnalyzer(Lengths(), num_workers=2, metric_names=["seqlen"], metric_functions=[seqlen],
                     metric_types=["single_value_per_sample"], metric_dtypes=[torch.long],
                     save_path=str(tmp_path)).run_reduce()


# ---------------------------------------------------------------------------------------------- sampler

def sampler(root: Path, metrics: dict, *, micro: int = 2, dp: int = 1, rank: int = 0, gas: int = 2,
            seed: int = 7) -> CurriculumDataSampler:
    cfg = load_config({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                       "data_efficiency": data_efficiency(root, metrics, seed=seed)})
    return CurriculumDataSampler(cfg.data_efficiency, N, micro, rank, dp, gradient_accumulation_steps=gas,
                                 global_rank=rank)


def steps(s: CurriculumDataSampler, count: int) -> list[tuple[dict, list[int]]]:
    """`count` global batches: (difficulties, the samples), from micro-batches of one rank."""
    out, it = [], iter(s)
    per_step = s.global_batch_size // s.micro_batch_times_data_parallel_size  # micro-batches per step
    for _ in range(count):
        batch = [i for _ in range(per_step) for i in next(it)]
        out.append((dict(s.current_difficulties), batch))
    return out


def test_value_difficulty_admits_only_samples_at_or_below_it(tmp_path) -> None:
    root = analyze(tmp_path)
    s = sampler(root, {"seqlen": metric_section(root, "seqlen")})
    seen = steps(s, 12)
    # fixed_linear from 2 to 10 over 8 steps in steps of 2: floor(s/8 * 8 + 2) rounded down to even
    assert [d["seqlen"] for d, _ in seen] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10, 10, 10]
    for difficulty, batch in seen:
        assert len(batch) == 4
        assert max(i % 10 + 1 for i in batch) <= difficulty["seqlen"]
    late = [i % 10 + 1 for _, batch in seen[8:] for i in batch]
    assert max(late) > 6  # the hard samples come in once allowed
    # one cluster file per difficulty reached, written by rank 0 as index files
    names = sorted(p.stem for p in (root / "clusters").glob("cluster*.idx"))
    assert names == ["cluster_seqlen10", "cluster_seqlen2", "cluster_seqlen4", "cluster_seqlen6", "cluster_seqlen8"]
    cluster = IndexedRows(root / "clusters" / "cluster_seqlen4")[0]
    assert sorted(cluster.tolist()) == [i for i in range(N) if i % 10 + 1 in (3, 4)]


def test_percentile_difficulty_takes_the_easiest_share(tmp_path) -> None:
    root = analyze(tmp_path)
    section = metric_section(root, "seqlen", difficulty_type="percentile", min_difficulty=10, max_difficulty=100,
                             schedule_type="fixed_discrete", index_to_metric_path=None,
                             schedule_config={"difficulty": [10, 50, 100], "max_step": [3, 6]})
    seen = steps(sampler(root, {"seqlen": section}), 9)
    assert [d["seqlen"] for d, _ in seen] == [10, 10, 10, 50, 50, 50, 100, 100, 100]
    # 10%: the 6 easiest samples (length 1); 50%: the 30 easiest (lengths 1..5)
    assert all(i % 10 + 1 == 1 for _, b in seen[:3] for i in b)
    assert all(i % 10 + 1 <= 5 for _, b in seen[3:6] for i in b)


def test_several_metrics_intersect_and_single_clusters_do_not_gate(tmp_path) -> None:
    root = analyze(tmp_path)
    both = {"seqlen": metric_section(root, "seqlen"),
            "rarity": metric_section(root, "rarity", min_difficulty=0, max_difficulty=2, schedule_type="fixed_discrete",
                                     schedule_config={"difficulty": [0, 2], "max_step": [4]})}
    seen = steps(sampler(root, both), 10)
    for difficulty, batch in seen:
        assert all(i % 10 + 1 <= difficulty["seqlen"] and i % 3 <= difficulty["rarity"] for i in batch)
    assert {i % 3 for _, b in seen[:4] for i in b} == {0}
    assert {i % 3 for _, b in seen[5:] for i in b} > {0}
    ungated = {"seqlen": metric_section(root, "seqlen", clustering_type="single_cluster",
                                        index_to_sample_path=None, index_to_metric_path=None)}
    first = steps(sampler(root, ungated), 3)
    assert max(i % 10 + 1 for _, b in first for i in b) > 2  # every sample from the start


def test_custom_schedules_and_a_difficulty_that_allows_nothing(tmp_path) -> None:
    root = analyze(tmp_path)
    s = sampler(root, {"seqlen": metric_section(root, "seqlen", schedule_type="custom", schedule_config={})})
    s.set_custom_curriculum_learning_schedule({"seqlen": lambda step: 1 if step < 3 else 10})
    seen = steps(s, 4)
    assert [d["seqlen"] for d, _ in seen] == [1, 1, 10, 10]
    assert all(i % 10 == 0 for _, b in seen[:2] for i in b)
    with pytest.raises(ValueError, match="\\['length'\\] are not curriculum_metrics"):
        s.set_custom_curriculum_learning_schedule({"length": len})
    nothing = sampler(root, {"seqlen": metric_section(root, "seqlen", min_difficulty=-5, max_difficulty=0,
                                                      schedule_config={"total_curriculum_step": 8,
                                                                       "difficulty_step": 1})})
    with pytest.raises(ValueError, match="no sample is allowed at difficulties"):
        steps(nothing, 1)


def test_resume_continues_with_the_same_batches_at_any_data_parallel_size(tmp_path) -> None:
    root = analyze(tmp_path)
    metrics = {"seqlen": metric_section(root, "seqlen")}
    # the whole run on one rank (micro 4 x gas 2 = the global batch of 8)
    whole = [b for _, b in steps(sampler(root, metrics, micro=4, gas=2), 30)]  # 30 steps: clusters reshuffle
    first = sampler(root, metrics, micro=4, gas=2)
    steps(first, 11)
    save_small(tmp_path / "state.pt", first.state_dict())  # loads back with weights_only
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    # resumed on 2 ranks of micro 2: each step's two rank slices together are the one-rank batch
    halves = []
    for rank in range(2):
        s = sampler(root, metrics, micro=2, dp=2, rank=rank, gas=2)
        s.load_state_dict(state)
        halves.append([b for _, b in steps(s, 19)])
    for step in range(19):
        together = halves[0][step][:2] + halves[1][step][:2] + halves[0][step][2:] + halves[1][step][2:]
        assert together == whole[11 + step]
    other_seed = sampler(root, metrics, micro=4, gas=2, seed=8)
    with pytest.raises(ValueError, match="resume with the same seed"):
        other_seed.load_state_dict(state)


# ----------------------------------------------------------------------------------------------- config

def test_config_accepts_deepspeeds_section_and_names_what_is_missing(tmp_path) -> None:
    root = tmp_path
    cfg = load_config({"train_batch_size": 8, "data_efficiency": data_efficiency(root, {
        "seqlen": metric_section(root, "seqlen")})})
    assert cfg.data_efficiency.data_curriculum().curriculum_metrics["seqlen"].max_difficulty == 10
    with pytest.raises(ConfigError, match="index_to_metric_path: required for clustering_type schedule_based"):
        load_config({"train_batch_size": 8, "data_efficiency": data_efficiency(root, {
            "seqlen": metric_section(root, "seqlen", index_to_metric_path=None)})})
    with pytest.raises(ConfigError, match="curriculum_metrics.seqlen.difficulty_typ: unknown key; did you mean"):
        load_config({"train_batch_size": 8, "data_efficiency": data_efficiency(root, {
            "seqlen": {**metric_section(root, "seqlen"), "difficulty_typ": "value"}})})
    with pytest.raises(ConfigError, match="data_sampling.dynamic_batching: not supported yet"):
        load_config({"train_batch_size": 8, "data_efficiency": {"enabled": True, "data_sampling": {
            "enabled": True, "dynamic_batching": {"enabled": True, "max_tokens": 100}}}})
    # percentiles live in 1..100
    with pytest.raises(ConfigError, match="percentiles must lie in 1..100"):
        load_config({"train_batch_size": 8, "data_efficiency": data_efficiency(root, {
            "seqlen": metric_section(root, "seqlen", difficulty_type="percentile", max_difficulty=200)})})


# ------------------------------------------------------------------------------------------ the engine

class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(batch[:, :12]).mean(1)).pow(2).mean()


def _engine_run(rank: int, world: int, root: str, save: str, resume: bool, steps_to_run: int) -> dict:
    torch.manual_seed(0)
    root_path = Path(root)
    # micro 4 of a global batch of 8: gradient accumulation 1 on 2 ranks, 2 on one
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": data_efficiency(root_path, {"seqlen": metric_section(root_path, "seqlen")})}
    engine, _, loader, _ = deepspeed.initialize(model=Tiny(), config=config, training_data=Lengths())
    seen_states: list[int] = []

    def truncate(batch: torch.Tensor, state: dict) -> torch.Tensor:  # DeepSpeed's post-process hook
        seen_states.append(state["current_difficulties"]["seqlen"])
        return batch

    engine.set_data_post_process_func(truncate)
    if resume:
        engine.load_checkpoint(save)
    it = iter(loader)
    ids, losses = [], []
    for _ in range(steps_to_run):
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(it)
            ids.append(batch[:, 12].tolist())
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    if not resume:
        engine.save_checkpoint(save)
    return {"ids": ids, "losses": losses, "difficulties": seen_states,
            "enabled": (engine.curriculum_learning_enabled(), engine.data_sampling_enabled())}


def test_the_engine_deals_curriculum_batches_to_ranks_and_resumes(tmp_path) -> None:
    root = analyze(tmp_path / "index")
    save = str(tmp_path / "ckpt")
    first = spawn(_engine_run, 2, str(root), save, False, 3)
    assert first[0]["enabled"] == (True, True)
    for step in range(3):
        a, b = first[0]["ids"][step], first[1]["ids"][step]
        assert len(a) == len(b) == 4  # the two ranks split one global batch of 8
    # difficulties reached the post-process hook; every sample is within them
    assert first[0]["difficulties"] == first[1]["difficulties"] == [2, 4, 4]
    assert all(i % 10 + 1 <= 4 for r in first for batch in r["ids"] for i in batch)
    # the uninterrupted run on one rank, and its continuation from the 2-rank checkpoint, deal the same
    # global batches (rank 0 takes the first 4 of each 8 at world 2)
    straight = spawn(_engine_run, 1, str(root), str(tmp_path / "unused"), False, 6)[0]
    global_batches = [first[0]["ids"][s] + first[1]["ids"][s] for s in range(3)]
    straight_batches = [straight["ids"][2 * s] + straight["ids"][2 * s + 1] for s in range(6)]
    assert straight_batches[:3] == global_batches
    resumed = spawn(_engine_run, 1, str(root), save, True, 3)[0]
    assert [resumed["ids"][2 * s] + resumed["ids"][2 * s + 1] for s in range(3)] == straight_batches[3:]
    assert resumed["difficulties"] == straight["difficulties"][6:]


def test_deepspeeds_module_paths_hold_the_same_objects() -> None:
    from deepfleet.engine.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer as Analyzer
    from deepfleet.engine.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
    from deepfleet.engine.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    assert Analyzer is DataAnalyzer and DeepSpeedDataSampler is CurriculumDataSampler
    assert MMapIndexedDataset is IndexedRows
