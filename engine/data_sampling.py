"""Curriculum data sampling, DeepSpeed's `data_efficiency.data_sampling`: an offline data analyzer that
indexes every sample by its difficulty metrics, and a sampler that draws each global batch only from the
samples the curriculum allows at the current step.

- `DataAnalyzer` (DeepSpeed's name and arguments): maps `metric_functions` over a dataset (split over
  `num_workers` processes by `worker_id`, and within one into `num_threads` ranges, run in turn) and
  reduces the pieces into, per metric under `<save_path>/<metric>/`: `<metric>_sample_to_metric` (one
  row per sample), `<metric>_index_to_sample` (one row of sample indices per distinct value, ascending),
  `<metric>_index_to_metric` (those values), `<metric>_index_to_sample_percentile_merged` (the sample
  indices of each percentile of the sorted order); `accumulate_value_over_samples` metrics give
  `<metric>_metric_value`. The files are `engine/indexed_dataset.py`'s format, which is DeepSpeed's.
- `CurriculumDataSampler` (also importable as `DeepSpeedDataSampler`): at each optimizer step every
  metric's schedule (`engine/curriculum.py`'s `CurriculumScheduler`) gives a difficulty; when one
  changes, the newly allowed samples (allowed now, not allowed before) become a new cluster. A global
  batch of `train_batch_size` samples is drawn from the clusters in proportion to their sizes, each
  cluster consumed in a shuffled order (reshuffled when used up), and each micro-batch's
  `micro x dp` samples are split over the data-parallel ranks. Every rank computes the same global batch
  from the same files and seed, so no rank waits on another and nothing is broadcast; the random draws
  are seeded by (seed, step) and (seed, cluster, reshuffle), so the whole state is a few integers and a
  resume (at any world size with the same global batch) continues with the same batches.
- `CurriculumDataLoader`: the loader `initialize(training_data=...)` returns when the curriculum is on,
  with `post_process_func(batch, sampler_state)` (`engine.set_data_post_process_func`) and a checkpoint
  position that is the last batch handed out (worker prefetch does not move it).

Written here because torch has no curriculum sampler and no reader of the analyzer's index format.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, Subset

from deepfleet.engine.config_data_efficiency import DataEfficiencyConfig, DataSamplingConfig
from deepfleet.engine.curriculum import CurriculumScheduler
from deepfleet.engine.dataloader import timed_batches
from deepfleet.engine.indexed_dataset import IndexedRows, smallest_int_dtype, write_rows

log = logging.getLogger(__name__)

SINGLE_VALUE = "single_value_per_sample"
ACCUMULATE = "accumulate_value_over_samples"


# ------------------------------------------------------------------------------------------ analyzer

def _split(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(start, end, num=parts + 1, dtype=np.int64)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


def _as_numpy(values: Any, metric: str) -> np.ndarray:
    if torch.is_tensor(values):
        values = values.detach().cpu().numpy()
    if not isinstance(values, np.ndarray):
        raise TypeError(f"metric_functions[{metric!r}]: returned {type(values).__name__}; return a tensor or "
                        "numpy array (one value per sample for single_value_per_sample)")
    if values.dtype.kind not in "iub":
        raise TypeError(f"metric_functions[{metric!r}]: returned {values.dtype} values; the index stores integers, "
                        "so return an integer tensor (scale or bucket the metric)")
    return values


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        return torch.empty(0, dtype=dtype).numpy().dtype
    return np.dtype(dtype)


class DataAnalyzer:
    """See the module docstring; the arguments are DeepSpeed's."""

    def __init__(self, dataset: Dataset, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable[[Any], Any]] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] = (), save_path: str = "./",
                 collate_fn: Callable | None = None, custom_map_init: Callable | None = None,
                 custom_map_update: Callable | None = None, custom_map_finalize: Callable | None = None,
                 custom_reduce: Callable | None = None, sample_indices: Sequence[int] | None = None) -> None:
        lengths = {len(metric_names), len(metric_functions), len(metric_types), len(metric_dtypes)}
        if len(lengths) != 1:
            raise ValueError("metric_names, metric_functions, metric_types, metric_dtypes: give one entry per metric "
                             f"(got {len(metric_names)}, {len(metric_functions)}, {len(metric_types)}, "
                             f"{len(metric_dtypes)})")
        bad = [t for t in metric_types if t not in (SINGLE_VALUE, ACCUMULATE)]
        if bad:
            raise ValueError(f"metric_types: {bad} unknown; use {SINGLE_VALUE!r} or {ACCUMULATE!r}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id: {worker_id} outside 0..{num_workers - 1} (num_workers)")
        if num_threads < 1 or batch_size < 1:
            raise ValueError("num_threads, batch_size: must be at least 1")
        self.dataset = dataset
        self.num_workers, self.worker_id, self.num_threads = num_workers, worker_id, num_threads
        self.num_threads_reduce = num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), [_np_dtype(d) for d in metric_dtypes]
        self.save_path = str(save_path)
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices

    def _piece_dir(self, metric: str, worker: int, thread: int) -> Path:
        return Path(self.save_path) / metric / f"worker{worker}_thread{thread}"

    # map ---------------------------------------------------------------------------------------
    def init_metric_results(self, thread_id: int, metric_names: Sequence[str], metric_types: Sequence[str],
                            metric_dtypes: Sequence[Any], save_path: str, worker_id: int) -> list[dict[str, Any]]:
        results = []
        for name, kind in zip(metric_names, metric_types, strict=True):
            self._piece_dir(name, worker_id, thread_id).mkdir(parents=True, exist_ok=True)
            results.append({"values": [], "samples": []} if kind == SINGLE_VALUE else {"value": None})
        return results

    def update_metric_results(self, data: Any, metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                              metric_functions: Sequence[Callable], metric_results: list[dict[str, Any]],
                              batch_start_idx: int = 0) -> None:
        for name, kind, fn, result in zip(self.metric_names, metric_types, metric_functions, metric_results,
                                          strict=True):
            values = _as_numpy(fn(data), name)
            if kind == SINGLE_VALUE:
                values = values.reshape(len(values), -1)
                if values.shape[1] != 1:
                    raise ValueError(f"metric_functions[{name!r}]: returned {values.shape[1]} values per sample; "
                                     "single_value_per_sample needs one")
                for row in range(len(values)):
                    result["values"].append(int(values[row, 0]))
                    result["samples"].append(self._sample_id(data, batch_start_idx, row))
            else:
                total = values.astype(np.int64).reshape(-1)
                result["value"] = total if result["value"] is None else result["value"] + total

    def _sample_id(self, data: Any, batch_start_idx: int, row: int) -> int:
        if isinstance(data, dict) and "index" in data:  # the dataset names its samples (Megatron style)
            return int(np.asarray(data["index"][row]).reshape(-1)[0])
        position = batch_start_idx + row
        return int(self.sample_indices[position]) if self.sample_indices is not None else position

    def finalize_metric_results(self, metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                                metric_results: list[dict[str, Any]], *, thread_id: int = 0) -> None:
        for name, kind, result in zip(self.metric_names, metric_types, metric_results, strict=True):
            piece = self._piece_dir(name, self.worker_id, thread_id)
            if kind == SINGLE_VALUE:
                values, samples = np.asarray(result["values"], np.int64), np.asarray(result["samples"], np.int64)
                write_rows(piece / f"{name}_sample_to_metric", [values], np.int64)
                write_rows(piece / f"{name}_sample_index", [samples], np.int64)
            elif result["value"] is not None:
                write_rows(piece / f"{name}_metric_value", [result["value"]], np.int64)

    def _map_thread(self, thread_id: int, start: int, end: int) -> None:
        subset = Subset(self.dataset, list(range(start, end)))
        batches = BatchSampler(SequentialSampler(subset), batch_size=self.batch_size, drop_last=False)
        loader = DataLoader(subset, batch_sampler=batches, num_workers=0, collate_fn=self.collate_fn)
        if self.custom_map_init is not None:
            results = self.custom_map_init(thread_id, self.metric_names, self.metric_types, self.metric_dtypes,
                                           self.save_path, self.worker_id)
        else:
            results = self.init_metric_results(thread_id, self.metric_names, self.metric_types, self.metric_dtypes,
                                               self.save_path, self.worker_id)
        done = 0
        for data in loader:
            update = self.custom_map_update or self.update_metric_results
            update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results, start + done)
            done += _batch_len(data)
        if self.custom_map_finalize is not None:
            self.custom_map_finalize(self.metric_types, self.metric_dtypes, results)
        else:
            self.finalize_metric_results(self.metric_types, self.metric_dtypes, results, thread_id=thread_id)
        log.info("data analyzer: worker %d thread %d mapped samples %d..%d", self.worker_id, thread_id, start, end)

    def run_map(self) -> None:
        """This worker's share of the dataset, thread range by thread range."""
        n = len(self.dataset)  # type: ignore[arg-type]
        w_start, w_end = _split(0, n, self.num_workers)[self.worker_id]
        threads = _split(w_start, w_end, self.num_threads)
        for t in self.specific_threads or range(self.num_threads):
            self._map_thread(t, *threads[t])

    # reduce ------------------------------------------------------------------------------------
    def run_reduce(self) -> None:
        """Merge every worker's and thread's pieces into the index files (run once, after all maps)."""
        if self.custom_reduce is not None:
            self.custom_reduce(self.dataset, self.metric_names, self.metric_types, self.save_path,
                               self.num_workers, self.num_threads, self.num_threads_reduce)
            return
        total = len(self.dataset)  # type: ignore[arg-type]
        for name, kind, dtype in zip(self.metric_names, self.metric_types, self.metric_dtypes, strict=True):
            out = Path(self.save_path) / name
            pieces = [self._piece_dir(name, w, t) for w in range(self.num_workers) for t in range(self.num_threads)]
            if kind == ACCUMULATE:
                parts = [IndexedRows(p / f"{name}_metric_value")[0] for p in pieces
                         if (p / f"{name}_metric_value.idx").is_file()]
                if not parts:
                    raise FileNotFoundError(f"{out}: no map output for {name!r}; run run_map on every worker first")
                value = np.sum([part.astype(np.int64) for part in parts], axis=0)
                write_rows(out / f"{name}_metric_value", [value], smallest_int_dtype(int(value.min()),
                                                                                     int(value.max())))
                continue
            missing = [str(p) for p in pieces if not (p / f"{name}_sample_to_metric.idx").is_file()]
            if missing:
                raise FileNotFoundError(f"{missing[0]}: map output missing ({len(missing)} of {len(pieces)} "
                                        "pieces); run run_map on every worker first")
            values = np.concatenate([IndexedRows(p / f"{name}_sample_to_metric")[0] for p in pieces])
            samples = np.concatenate([IndexedRows(p / f"{name}_sample_index")[0] for p in pieces])
            if len(values) != total:
                raise ValueError(f"{name}: map output holds {len(values)} samples, the dataset {total}; "
                                 "re-run run_map on every worker")
            self._write_index(out, name, values, samples, dtype, total)

    @staticmethod
    def _write_index(out: Path, name: str, values: np.ndarray, samples: np.ndarray, dtype: np.dtype,
                     total: int) -> None:
        value_dtype = smallest_int_dtype(int(values.min()), int(values.max())) if len(values) else np.dtype(dtype)
        sample_dtype = smallest_int_dtype(0, max(total - 1, 0))
        by_sample = np.empty(total, dtype=np.int64)
        by_sample[samples] = values
        write_rows(out / f"{name}_sample_to_metric", ([v] for v in by_sample), value_dtype)
        order = np.lexsort((samples, values))  # by value, then sample index
        sorted_values, sorted_samples = values[order], samples[order]
        distinct, starts = np.unique(sorted_values, return_index=True)
        rows = np.split(sorted_samples, starts[1:])
        write_rows(out / f"{name}_index_to_sample", rows, sample_dtype)
        write_rows(out / f"{name}_index_to_metric", ([v] for v in distinct), value_dtype)
        edges = [round(total * p / 100) for p in range(101)]
        write_rows(out / f"{name}_index_to_sample_percentile_merged",
                   (sorted_samples[edges[p]:edges[p + 1]] for p in range(100)), sample_dtype)
        log.info("data analyzer: %s has %d distinct values in %d..%d", name, len(distinct),
                 int(distinct[0]) if len(distinct) else 0, int(distinct[-1]) if len(distinct) else 0)

    def run_map_reduce(self, comm_group: Any = None) -> None:
        """Map this worker's share; with torch.distributed initialized, wait for every worker, reduce on
        worker 0, and wait again, so every caller returns with the index written."""
        self.run_map()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            torch.distributed.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if distributed:
            torch.distributed.barrier(group=comm_group)


def _batch_len(data: Any) -> int:
    if torch.is_tensor(data) or isinstance(data, np.ndarray):
        return len(data)
    if isinstance(data, dict):
        return _batch_len(next(iter(data.values())))
    if isinstance(data, (list, tuple)) and data and (torch.is_tensor(data[0]) or isinstance(data[0], (list, tuple))):
        return _batch_len(data[0])
    return len(data)


# ------------------------------------------------------------------------------------------- sampler

class _Metric:
    """One curriculum metric: its schedule and the samples each difficulty allows."""

    def __init__(self, name: str, cfg: Any, total: int) -> None:
        self.name, self.cfg, self.total = name, cfg, total
        self.scheduler = CurriculumScheduler(cfg)
        self.gating = cfg.clustering_type == "schedule_based"
        self._rows: IndexedRows | None = None
        self._values: np.ndarray | None = None

    def _index(self) -> tuple[IndexedRows, np.ndarray | None]:
        if self._rows is None:
            self._rows = IndexedRows(self.cfg.index_to_sample_path)
            if self.cfg.difficulty_type == "value":
                metric = IndexedRows(self.cfg.index_to_metric_path)
                if len(metric) != len(self._rows):
                    raise ValueError(f"curriculum_metrics.{self.name}: index_to_metric has {len(metric)} rows, "
                                     f"index_to_sample {len(self._rows)}; give files from one analyzer run")
                self._values = np.asarray([int(metric[i][0]) for i in range(len(metric))], dtype=np.int64)
        return self._rows, self._values

    def allowed(self, difficulty: int | None) -> np.ndarray | None:
        """The sample indices allowed at `difficulty` (None: not yet any); None also for a metric that
        does not gate (every sample)."""
        if not self.gating:
            return None
        if difficulty is None:
            return np.zeros(0, dtype=np.int64)
        rows, values = self._index()
        if self.cfg.difficulty_type == "value":
            keep = [int(i) for i in np.flatnonzero(values <= difficulty)]
            parts = [np.asarray(rows[i], dtype=np.int64) for i in keep]
        else:  # the easiest difficulty/max_difficulty share of the value-sorted order (all of it at the max)
            size = int(rows.sizes.sum())
            end = size if difficulty >= self.cfg.max_difficulty else size * difficulty // int(self.cfg.max_difficulty)
            parts, taken = [], 0
            for i in range(len(rows)):
                if taken >= end:
                    break
                row = np.asarray(rows[i], dtype=np.int64)
                parts.append(row[: end - taken])
                taken += len(parts[-1])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class CurriculumDataSampler:
    """The batch sampler of the curriculum loader (see the module docstring). DeepSpeed's positional
    arguments: a data-efficiency config (DeepSpeed's dict or ours), the samples of one epoch, the micro-batch
    size, this rank's data-parallel rank and size, the data-parallel group (unused: nothing is broadcast),
    gradient accumulation steps and the global rank (rank 0 writes the cluster files)."""

    def __init__(self, data_efficiency_config: Any, one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any = None,
                 gradient_accumulation_steps: int = 1, global_rank: int = 0, drop_last: bool = True) -> None:
        cfg = data_efficiency_config
        if isinstance(cfg, dict):
            cfg = DataEfficiencyConfig.model_validate(
                {k: v for k, v in cfg.items() if k in ("enabled", "seed", "data_sampling")})
        if isinstance(cfg, DataEfficiencyConfig):
            self.seed, sampling = int(cfg.seed), cfg.data_sampling
        else:
            raise TypeError("data_efficiency_config: give the data_efficiency section (a dict or DataEfficiencyConfig)")
        self.sampling: DataSamplingConfig = sampling
        curriculum = sampling.curriculum_learning
        if not curriculum.enabled:
            raise ValueError("data_sampling.curriculum_learning.enabled: false; the curriculum sampler needs it on")
        if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} of {data_parallel_size}, micro batch "
                             f"{micro_batch_size}: the rank must lie below the size, the batch be positive")
        if one_epoch_total_samples < 1:
            raise ValueError("training_data: empty; the curriculum needs samples")
        self.one_epoch_total_samples = int(one_epoch_total_samples)
        self.total_samples = self.one_epoch_total_samples * int(sampling.num_epochs)
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, data_parallel_rank, data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank, self.drop_last = global_rank, drop_last
        self.cluster_path = Path(curriculum.data_cluster_path)
        self.metrics = {name: _Metric(name, m, self.one_epoch_total_samples)
                        for name, m in curriculum.curriculum_metrics.items()}
        self.index_dtype = smallest_int_dtype(0, max(self.one_epoch_total_samples - 1, 0))
        # the state (all of it restorable from state_dict)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.cluster_difficulties: list[dict[str, int]] = []  # the difficulties each cluster was made at
        self.cluster_positions: list[int] = []
        self.cluster_reshuffles: list[int] = []
        self._members: list[np.ndarray] = []  # each cluster's samples, sorted
        self._clusters: list[np.ndarray] = []  # the same in the current shuffled order
        self._states: deque[dict[str, Any]] = deque()  # the state after each batch yielded (for the loader)
        if self.global_rank == 0:
            self.cluster_path.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable[[int], int]]) -> None:
        """`{metric: fn(step) -> difficulty}` for metrics whose `schedule_type` is custom."""
        unknown = sorted(set(schedule_func_dict) - set(self.metrics))
        if unknown:
            raise ValueError(f"set_custom_curriculum_learning_schedule: {unknown} are not curriculum_metrics "
                             f"({sorted(self.metrics)})")
        for name, fn in schedule_func_dict.items():
            self.metrics[name].scheduler.set_custom_get_difficulty(fn)

    # clusters ----------------------------------------------------------------------------------
    def _allowed(self, difficulties: dict[str, int] | None) -> np.ndarray:
        """The samples every gating metric allows (every sample if none gates; none before the first step)."""
        if difficulties is None:
            return np.zeros(0, dtype=np.int64)
        result: np.ndarray | None = None
        for name, metric in self.metrics.items():
            allowed = metric.allowed(difficulties[name])
            if allowed is not None:
                result = allowed if result is None else np.intersect1d(result, allowed, assume_unique=True)
        return np.arange(self.one_epoch_total_samples, dtype=np.int64) if result is None else np.unique(result)

    def _cluster_name(self, difficulties: dict[str, int]) -> str:
        return "cluster" + "".join(f"_{name}{difficulties[name]}" for name in self.metrics)

    def _new_cluster(self, difficulties: dict[str, int], before: dict[str, int] | None) -> None:
        """A cluster of the samples `difficulties` allow that `before` (the last check's; None: none yet) did not."""
        members = np.setdiff1d(self._allowed(difficulties), self._allowed(before), assume_unique=True)
        if len(members) == 0:
            log.info("curriculum: difficulties %s allow no new samples; no cluster added", difficulties)
            return
        self.cluster_difficulties.append(dict(difficulties))
        self.cluster_positions.append(0)
        self.cluster_reshuffles.append(0)
        self._members.append(members)
        self._clusters.append(self._shuffle(len(self._members) - 1))
        log.info("curriculum: difficulties %s add a cluster of %d samples", difficulties, len(members))

    def _shuffle(self, index: int) -> np.ndarray:
        """Cluster `index` in the order of its current reshuffle (a function of seed, index, reshuffle)."""
        members = self._members[index]
        rng = np.random.default_rng([self.seed, 0, index, self.cluster_reshuffles[index]])
        order = members[rng.permutation(len(members))]
        if self.global_rank == 0:
            write_rows(self.cluster_path / self._cluster_name(self.cluster_difficulties[index]), [order],
                       self.index_dtype)
        return order

    def _rebuild_clusters(self) -> None:
        """The clusters of the restored state, from the index files (nothing of them is in the state)."""
        self._members, self._clusters = [], []
        previous: dict[str, int] | None = None
        for index, difficulties in enumerate(self.cluster_difficulties):
            self._members.append(np.setdiff1d(self._allowed(difficulties), self._allowed(previous), assume_unique=True))
            self._clusters.append(self._shuffle(index))
            previous = difficulties

    def _take(self, index: int, count: int) -> list[int]:
        start = self.cluster_positions[index]
        taken = self._clusters[index][start:start + count].tolist()
        self.cluster_positions[index] += len(taken)
        while len(taken) < count:  # used up: reshuffle and go on from its start
            self.cluster_reshuffles[index] += 1
            self._clusters[index] = self._shuffle(index)
            more = self._clusters[index][: count - len(taken)].tolist()
            self.cluster_positions[index] = len(more)
            taken += more
        return taken

    def get_next_global_batch(self) -> None:
        self.curriculum_step += 1
        difficulties = {name: int(m.scheduler.update_difficulty(self.curriculum_step))
                        for name, m in self.metrics.items()}
        # Every metric has a difficulty once a check has run (a curriculum has at least one metric).
        before = self.current_difficulties or None
        if difficulties != self.current_difficulties or before is None:
            self.current_difficulties = difficulties
            self._new_cluster(difficulties, before)
        if not self._clusters:
            raise ValueError(
                f"curriculum_metrics: no sample is allowed at difficulties {difficulties} (step "
                f"{self.curriculum_step}); lower min_difficulty or check the analyzer's index files")
        rng = np.random.default_rng([self.seed, 1, self.curriculum_step])
        sizes = np.asarray([len(c) for c in self._clusters], dtype=np.float64)
        counts = np.bincount(rng.choice(len(sizes), self.global_batch_size, replace=True, p=sizes / sizes.sum()),
                             minlength=len(sizes))
        batch: list[int] = []
        for index, count in enumerate(counts):
            if count:
                batch += self._take(index, int(count))
        self.batch = [batch[i] for i in rng.permutation(len(batch))]

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's slice of a micro-batch chunk of `batch_len` samples (default micro x dp)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        return (round(self.dp_rank * batch_len / self.dp_size), round((self.dp_rank + 1) * batch_len / self.dp_size))

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples < self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            chunk = self.batch[: self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
            if len(chunk) == self.micro_batch_times_data_parallel_size or (chunk and not self.drop_last):
                start, end = self.get_start_end_idx(len(chunk))
                self.consumed_samples += len(chunk)
                self._states.append(self.state_dict())
                yield chunk[start:end]

    # state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's keys where they mean the same (`batch`, `consumed_samples`, `curriculum_step`,
        `current_difficulties`, `data_cluster_paths`, `data_cluster_current_position`), and what rebuilds
        the clusters here."""
        return {
            "batch": list(self.batch), "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
            "data_cluster_paths": [self._cluster_name(d) for d in self.cluster_difficulties],
            "data_cluster_current_position": list(self.cluster_positions),
            "cluster_difficulties": [dict(d) for d in self.cluster_difficulties],
            "cluster_reshuffles": list(self.cluster_reshuffles), "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"data_efficiency.seed: the checkpoint's curriculum used seed {state['seed']}, this "
                             f"run {self.seed}; resume with the same seed")
        self.batch = [int(i) for i in state["batch"]]
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = {k: int(v) for k, v in state["current_difficulties"].items()}
        self.cluster_difficulties = [{k: int(v) for k, v in d.items()} for d in state["cluster_difficulties"]]
        self.cluster_positions = [int(p) for p in state["data_cluster_current_position"]]
        self.cluster_reshuffles = [int(r) for r in state["cluster_reshuffles"]]
        unknown = sorted({k for d in self.cluster_difficulties for k in d} - set(self.metrics))
        if unknown:
            raise ValueError(f"curriculum_metrics: the checkpoint's curriculum has metrics {unknown} this config "
                             "lacks; resume with the same curriculum_metrics")
        self._rebuild_clusters()
        # a restored scheduler continues from its difficulty (update_difficulty holds once at max)
        for name, metric in self.metrics.items():
            if name in self.current_difficulties:
                metric.scheduler.current_difficulty = self.current_difficulties[name]
        self._states.clear()


DeepSpeedDataSampler = CurriculumDataSampler  # DeepSpeed's name


class CurriculumDataLoader(DataLoader):
    """The training loader under the curriculum: batches from `CurriculumDataSampler`; `post_process_func`
    (`engine.set_data_post_process_func`) is called as `fn(batch, sampler.state_dict())` on each batch.
    One iteration runs until the sampler's `num_epochs` worth of samples; iterating again continues from
    the last batch handed out."""

    def __init__(self, dataset: Dataset, *, sampler: CurriculumDataSampler, collate_fn: Any = None,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                         pin_memory=pin_memory)
        self.data_sampler = sampler
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        self._delivered: dict[str, Any] = sampler.state_dict()
        self.fetch_timer: Callable[[], Any] = contextlib.nullcontext

    def __len__(self) -> int:
        return self.data_sampler.total_samples // self.data_sampler.micro_batch_times_data_parallel_size

    def __iter__(self) -> Iterator[Any]:
        sampler = self.data_sampler
        sampler.load_state_dict(self._delivered)  # prefetched, undelivered batches are drawn again
        for batch in timed_batches(super().__iter__(), self.fetch_timer):
            self._delivered = sampler._states.popleft()
            if self.post_process_func is not None:
                batch = self.post_process_func(batch, self._delivered)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": dict(self._delivered)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "curriculum" not in state:
            raise ValueError("training_dataloader: the checkpoint was saved without data_sampling.curriculum_learning; "
                             "resume with the config it was saved with")
        self.data_sampler.load_state_dict(state["curriculum"])
        self._delivered = self.data_sampler.state_dict()



def build_curriculum_loader(dataset: Dataset, config: Any, *, dp_rank: int, dp_size: int, global_rank: int,
                            collate_fn: Any = None) -> CurriculumDataLoader:
    """The loader `initialize` returns when `data_efficiency.data_sampling.curriculum_learning` is on."""
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("training_data: data_sampling's curriculum needs a map-style dataset (with __len__ and "
                         "__getitem__): its index names samples by position") from None
    sampler = CurriculumDataSampler(
        config.data_efficiency, n, config.train_micro_batch_size_per_gpu, dp_rank, dp_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps, global_rank=global_rank)
    sampling = config.data_efficiency.data_sampling
    return CurriculumDataLoader(dataset, sampler=sampler, collate_fn=collate_fn, num_workers=sampling.num_workers,
                                pin_memory=sampling.pin_memory and torch.cuda.is_available())

