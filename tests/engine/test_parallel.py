"""`deepfleet.engine.parallel`: degrees validated against the world size (a table of impossible ones,
each with its arithmetic and fix), the one DeviceMesh on gloo at 2 and 3 ranks, and the data-parallel
group reaching what means "data parallel": the batch arithmetic, the data loader, the strategy (its
process group, which is also clipping's), and the checkpoint manifest. A stage-0 training step's
collectives, counted by `engine.comm`, equal torch's `CommDebugMode` count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepfleet.engine.config import load_config
from deepfleet.engine.parallel import ParallelDims
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens
from tests.spawn import spawn

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "gradient_clipping": 1.0,
}


@pytest.mark.parametrize(
    ("degrees", "resolved"),
    [
        ({"world_size": 4}, {"dp_shard": 4}),
        ({"world_size": 6, "pp": 2}, {"dp_shard": 3}),
        ({"world_size": 8, "dp_replicate": 2, "tp": 2}, {"dp_shard": 2}),
        ({"world_size": 4, "dp_replicate": -1, "dp_shard": 2}, {"dp_replicate": 2}),
        ({"world_size": 4, "ep": 2}, {"dp_shard": 4, "ep": 2, "ep_sizes": (2,)}),
        ({"world_size": 4, "ep": 4, "ep_sizes": (1, 2, 4)}, {"ep": 4, "ep_sizes": (2, 4)}),  # MoE layers at several
        ({"world_size": 1}, {"dp_shard": 1}),
    ],
)
def test_degrees_resolve_the_rest_to_data_parallelism(degrees, resolved):
    dims = ParallelDims(**degrees)
    assert {k: getattr(dims, k) for k in resolved} == resolved
    assert dims.pp * dims.dp_size * dims.sp * dims.tp == dims.world_size
    assert dims.degrees()["world_size"] == dims.world_size


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        ({"world_size": 6, "pp": 4},
         "dp_shard: -1 (the rest) needs the world size 6 to be a multiple of pp 4 * dp_replicate 1 * sp 1 * tp 1 = 4;"
         " run on a multiple of 4 ranks or lower those degrees"),
        ({"world_size": 3, "dp_shard": 2},
         "pp 1 * dp_replicate 1 * dp_shard 2 * sp 1 * tp 1 = 2 != world_size 3; the degrees must multiply to the "
         "world size (set dp_shard=-1 to give data parallelism the rest)"),
        ({"world_size": 4, "dp_replicate": 3, "dp_shard": 2}, "= 6 != world_size 4"),
        ({"world_size": 4, "ep": 3}, "ep: 3 does not divide the data-parallel size 4 (dp_replicate 1 * dp_shard 4)"),
        ({"world_size": 8, "tp": 2, "ep": 8}, "ep: 8 does not divide the data-parallel size 4"),
        ({"world_size": 4, "ep": 4, "ep_sizes": (3, 4)}, "ep: 3 does not divide the data-parallel size 4"),
        ({"world_size": 4, "tp": 0}, "tp: must be a positive integer, got 0"),
        ({"world_size": 4, "pp": -1}, "pp: must be a positive integer, got -1"),
        ({"world_size": 4, "sp": 1.5}, "sp: must be a positive integer, got 1.5"),
        ({"world_size": 4, "dp_shard": -2}, "dp_shard: must be a positive integer or -1 (the rest), got -2"),
        ({"world_size": 4, "dp_replicate": -1}, "dp_replicate: -1 on both dp_replicate and dp_shard"),
        ({"world_size": 0}, "world_size: must be a positive integer, got 0"),
        ({"world_size": 4, "tp": 3, "names": {"tp": "tensor_parallel.autotp_size"}},
         "multiple of pp 1 * dp_replicate 1 * sp 1 * tp 3 = 3"),
        ({"world_size": 4, "ep": 3, "names": {"ep": "moe.ep_size"}}, "moe.ep_size: 3 does not divide"),
    ],
)
def test_impossible_degrees_are_refused_with_the_arithmetic_and_the_fix(degrees, message):
    with pytest.raises(ValueError) as info:
        ParallelDims(**degrees)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_from_config_gives_data_parallelism_every_rank_today():
    cfg = load_config(CONFIG, world_size=3)
    dims = ParallelDims.from_config(cfg, world_size=3)
    assert dims.degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 3, "ep": 1, "sp": 1, "tp": 1, "world_size": 3}


def test_batch_arithmetic_uses_the_data_parallel_size():
    cfg = load_config({**CONFIG, "train_batch_size": 8}, world_size=4, dp_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 2, 2)
    with pytest.raises(ValueError, match=r"16 != 2 \(micro\) \* 2 \(gas\) \* 2 \(data-parallel size\) = 8"):
        load_config({**CONFIG, "train_batch_size": 16}, world_size=4, dp_size=2)


def test_submesh_before_build_is_an_error():
    with pytest.raises(RuntimeError, match="build_mesh"):
        _ = ParallelDims(world_size=2).dp_group


def _train_and_save(rank: int, world: int, save_dir: str) -> dict:
    """Initialize a stage-0 engine, take two optimizer steps, count one boundary micro-step both ways,
    save a checkpoint; also build a tp=2 mesh at 2 ranks, where data parallelism is one rank wide."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import deepfleet.engine as deepspeed
    import deepfleet.engine.comm as comm

    torch.manual_seed(0)
    data = SyntheticTokens(num_samples=64, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    engine, _, loader, _ = deepspeed.initialize(model=GPTWithLoss(TINY), config=CONFIG, training_data=data)
    batches = iter(loader)
    p = engine.parallel
    out = {
        "dp": (p.dp_size, p.dp_rank),
        "degrees": p.degrees(),
        "dp_group_ranks": dist.get_process_group_ranks(p.dp_group),
        "batch": engine.train_batch_size(),
        "sampler": (loader.sampler.num_replicas, loader.sampler.rank),
        "ddp_group_is_dp": engine.sharding.module.process_group is p.dp_group,
        "mesh_names": p.mesh.mesh_dim_names,
    }
    engine.backward(engine(next(batches)))  # a non-boundary micro-step: no communication at stage 0
    engine.step()
    comm.reset_counters()
    with CommDebugMode() as mode:
        engine.backward(engine(next(batches)))
        engine.step()
    out["ours"] = {k: v.count for k, v in comm.counters().items()}
    out["ours_bytes"] = comm.counters()["all_reduce"].bytes
    out["debug"] = {str(op).split(".")[-1].split("'")[0]: c for op, c in mode.get_comm_counts().items()}
    out["grad_bytes"] = sum(q.numel() * q.element_size() for q in engine.module.parameters())
    engine.save_checkpoint(save_dir)
    if world == 2:
        dims = ParallelDims(tp=2, world_size=2)
        dims.build_mesh("cpu")
        out["tp2"] = (dims.dp_size, dims.dp_rank, dist.get_world_size(dims.dp_group),
                      dims.submesh("tp").size())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_dp_group_reaches_batch_loader_strategy_and_manifest(world, tmp_path):
    results = spawn(_train_and_save, world, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["dp"] == (world, rank)
        assert r["dp_group_ranks"] == list(range(world))
        assert r["batch"] == CONFIG["train_micro_batch_size_per_gpu"] * CONFIG["gradient_accumulation_steps"] * world
        assert r["sampler"] == (world, rank)
        assert r["ddp_group_is_dp"]
        assert r["mesh_names"] == ("pp", "dp_replicate", "dp_shard", "sp", "tp")
        # Every collective of a stage-0 boundary micro-step goes through engine.comm: DDP's bucket
        # all-reduces (its comm hook) and the overflow agreement, exactly the c10d ops torch sees.
        assert r["ours"] == {"all_reduce": r["debug"]["allreduce_"]}
        assert r["debug"].keys() == {"allreduce_"} and r["ours"]["all_reduce"] >= 2
        assert r["ours_bytes"] == r["grad_bytes"] + 4  # every fp32 gradient once, plus the overflow flag
        if world == 2:
            assert r["tp2"] == (1, 0, 1, 2)
    manifest = json.loads(next(Path(tmp_path).glob("*/manifest.json")).read_text())
    assert manifest["degrees"] == {"pp": 1, "dp_replicate": 1, "dp_shard": world, "ep": 1, "sp": 1, "tp": 1,
                                   "world_size": world}
