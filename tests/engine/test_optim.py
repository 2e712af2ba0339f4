"""deepfleet.engine.optim: DeepSpeed's optimizer semantics, and Lamb/Lion against per-element formulas."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from deepfleet.engine.config import load_config
from deepfleet.engine.optim import FusedAdamW, Lamb, Lion, build_optimizer
from deepfleet.kernels._dispatch import force_impl

torch.set_num_threads(1)


def _optimizer_config(section: dict):
    return load_config({"train_batch_size": 1, "optimizer": section}).optimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (7,), (2, 1, 3)]  # odd shapes, one of them 3-D
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]


# --------------------------------------------------------------------------- naive references


def _naive_lamb(weights, grads_per_step, *, lr, b1, b2, eps, wd, bias_correction=True, eps_inside_sqrt=False,
                max_coeff=10.0, min_coeff=0.01):
    ws = [w.flatten().tolist() for w in weights]
    ms = [[0.0] * len(w) for w in ws]
    vs = [[0.0] * len(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for w, m, v, g in zip(ws, ms, vs, [g.flatten().tolist() for g in grads], strict=True):
            u = []
            for i in range(len(w)):
                m[i] = b1 * m[i] + (1 - b1) * g[i]
                v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
                mh = m[i] / (1 - b1**t) if bias_correction else m[i]
                vh = v[i] / (1 - b2**t) if bias_correction else v[i]
                den = math.sqrt(vh + eps) if eps_inside_sqrt else math.sqrt(vh) + eps
                u.append(mh / den + wd * w[i])
            w_norm = math.sqrt(sum(x * x for x in w))
            u_norm = math.sqrt(sum(x * x for x in u))
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            ratio = min(max(ratio, min_coeff), max_coeff)
            for i in range(len(w)):
                w[i] -= lr * ratio * u[i]
    return ws


def _naive_lion(weights, grads_per_step, *, lr, b1, b2, wd):
    ws = [w.flatten().tolist() for w in weights]
    ms = [[0.0] * len(w) for w in ws]
    for grads in grads_per_step:
        for w, m, g in zip(ws, ms, [g.flatten().tolist() for g in grads], strict=True):
            for i in range(len(w)):
                c = b1 * m[i] + (1 - b1) * g[i]
                sign = (c > 0) - (c < 0)
                w[i] = w[i] - lr * (sign + wd * w[i])
                m[i] = b2 * m[i] + (1 - b2) * g[i]
    return ws


def _run(opt: torch.optim.Optimizer, params, steps: int) -> list[list[float]]:
    for step in range(steps):
        for p, g in zip(params, _grads(step, params), strict=True):
            p.grad = g
        opt.step()
    return [p.detach().flatten().tolist() for p in params]


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        dict(lr=0.01, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01, eps_inside_sqrt=True, bias_correction=False),
        dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_coeff=0.3, min_coeff=0.2),
    ],
)
def test_lamb_matches_per_element_formula(kwargs: dict, foreach: bool) -> None:
    params = _params()
    initial = [p.detach().clone() for p in params]
    got = _run(Lamb(params, foreach=foreach, **kwargs), params, steps=4)
    b1, b2 = kwargs["betas"]
    want = _naive_lamb(initial, [_grads(s, params) for s in range(4)], lr=kwargs["lr"], b1=b1, b2=b2,
                       eps=kwargs["eps"], wd=kwargs["weight_decay"],
                       bias_correction=kwargs.get("bias_correction", True),
                       eps_inside_sqrt=kwargs.get("eps_inside_sqrt", False),
                       max_coeff=kwargs.get("max_coeff", 10.0), min_coeff=kwargs.get("min_coeff", 0.01))
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-10, abs=1e-12)


def test_lamb_trust_ratio_is_one_for_zero_weights() -> None:
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0], dtype=torch.float64)
    Lamb([p], lr=0.1, min_coeff=0.01, max_coeff=10.0).step()
    # first step, bias-corrected: update = g / (|g| + eps) ~ sign(g); ratio 1 because ||w|| = 0
    assert p.detach().tolist() == pytest.approx([-0.1, 0.1, -0.1, 0.1], rel=1e-6)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("kwargs", [dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.0),
                                    dict(lr=0.003, betas=(0.95, 0.98), weight_decay=0.5)])
def test_lion_matches_per_element_formula(kwargs: dict, foreach: bool) -> None:
    params = _params(1)
    initial = [p.detach().clone() for p in params]
    got = _run(Lion(params, foreach=foreach, **kwargs), params, steps=5)
    b1, b2 = kwargs["betas"]
    want = _naive_lion(initial, [_grads(s, params) for s in range(5)], lr=kwargs["lr"], b1=b1, b2=b2,
                       wd=kwargs["weight_decay"])
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("cls", [Lamb, Lion])
def test_state_dict_round_trip_continues_identically(cls) -> None:
    params_a, params_b = _params(2), _params(2)
    opt_a = cls(params_a, lr=0.01, weight_decay=0.1)
    _run(opt_a, params_a, steps=3)
    saved = copy.deepcopy(opt_a.state_dict())  # as if written to disk: no tensors shared with opt_a
    with torch.no_grad():
        for a, b in zip(params_a, params_b, strict=True):
            b.copy_(a)
    opt_b = cls(params_b, lr=0.5)  # wrong hyper-parameters on purpose: load_state_dict restores them
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 0.01
    assert float(opt_b.state[params_b[0]]["step"]) == 3.0
    for step in (3, 4):
        for opt, params in ((opt_a, params_a), (opt_b, params_b)):
            for p, g in zip(params, _grads(step, params), strict=True):
                p.grad = g
            opt.step()
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a, b)


def test_deepspeed_adam_is_decoupled_by_default_and_coupled_with_adam_w_mode_false() -> None:
    lr, wd, eps = 0.1, 0.5, 1e-8
    w0, g = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([0.5, 0.25], dtype=torch.float64)

    def one_step(section: dict) -> torch.Tensor:
        p = torch.nn.Parameter(w0.clone())
        opt = build_optimizer([p], _optimizer_config(section))
        p.grad = g.clone()
        opt.step()
        return p.detach()

    params = {"lr": lr, "weight_decay": wd, "eps": eps}
    # After one bias-corrected step m_hat = g and v_hat = g^2, so the Adam direction is g / (|g| + eps).
    decoupled = w0 * (1 - lr * wd) - lr * g / (g.abs() + eps)
    coupled_grad = g + wd * w0
    coupled = w0 - lr * coupled_grad / (coupled_grad.abs() + eps)
    assert torch.allclose(one_step({"type": "Adam", "params": params}), decoupled)
    assert torch.allclose(one_step({"type": "AdamW", "params": params}), decoupled)
    assert torch.allclose(one_step({"type": "adam", "params": {**params, "adam_w_mode": False}}), coupled)
    assert torch.allclose(one_step({"type": "Adam", "params": {**params, "torch_adam": True}}), decoupled)


def test_build_optimizer_classes_defaults_and_foreach() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = build_optimizer(p, _optimizer_config({"type": "Adam"}))
    assert type(adam) is FusedAdamW and adam.defaults["weight_decay"] == 0.0
    amsgrad = build_optimizer(p, _optimizer_config({"type": "Adam", "params": {"amsgrad": True}}))
    assert type(amsgrad) is torch.optim.AdamW and amsgrad.defaults["foreach"]
    torch_adamw = build_optimizer(p, _optimizer_config({"type": "AdamW", "params": {"torch_adam": True}}))
    assert type(torch_adamw) is torch.optim.AdamW and torch_adamw.defaults["fused"]
    assert torch_adamw.defaults["weight_decay"] == 0.01  # torch AdamW's default, as DeepSpeed gets it
    plain = build_optimizer(p, _optimizer_config({"type": "Adam", "params": {"adam_w_mode": False}}))
    assert type(plain) is torch.optim.Adam
    sgd = build_optimizer(p, _optimizer_config({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9,
                                                                             "nesterov": True}}))
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    adagrad = build_optimizer(p, _optimizer_config({"type": "Adagrad"}))
    assert type(adagrad) is torch.optim.Adagrad and adagrad.defaults["lr"] == 0.01 and adagrad.defaults["foreach"]
    assert type(build_optimizer(p, _optimizer_config({"type": "LAMB"}))) is Lamb
    lion = build_optimizer(p, _optimizer_config({"type": "lion"}))
    assert type(lion) is Lion and lion.defaults["betas"] == (0.9, 0.999) and lion.defaults["lr"] == 1e-3


@pytest.mark.parametrize("kind", ["Adam", "SGD", "Adagrad", "Lamb", "Lion"])
def test_param_groups_keep_their_overrides(kind: str) -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [a], "weight_decay": 0.0, "name": "no_decay"}, {"params": [b], "lr": 0.5}]
    opt = build_optimizer(groups, _optimizer_config({"type": kind, "params": {"lr": 0.01, "weight_decay": 0.1}}))
    first, second = opt.param_groups
    assert (first["weight_decay"], first["lr"], first["name"]) == (0.0, 0.01, "no_decay")
    assert (second["weight_decay"], second["lr"]) == (0.1, 0.5)


def test_groups_with_different_lrs_step_by_their_own_lr() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([{"params": [a]}, {"params": [b], "lr": 0.5}],
                          _optimizer_config({"type": "Lion", "params": {"lr": 0.1}}))
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    assert a.tolist() == pytest.approx([-0.1, -0.1]) and b.tolist() == pytest.approx([-0.5, -0.5])


def _sharded_vs_full(rank: int, world_size: int) -> dict[str, float]:
    """Per optimizer, max |difference| between stepping DTensor Shard(0) parameters and the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for cls in (Lamb, Lion):
        full = _params(3)  # shapes (3, 5), (7,), (2, 1, 3): uneven shards on 2 ranks
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in full]
        opt_full = cls(full, lr=0.01, weight_decay=0.1)
        opt_sharded = cls(sharded, lr=0.01, weight_decay=0.1)
        for step in range(3):
            for p, d, g in zip(full, sharded, _grads(step, full), strict=True):
                p.grad = g.clone()
                d.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt_full.step()
            opt_sharded.step()
        out[cls.__name__] = max(float((p.detach() - d.detach().full_tensor()).abs().max())
                                for p, d in zip(full, sharded, strict=True))
    return out


@pytest.mark.slow
def test_dtensor_shards_step_like_the_full_parameter() -> None:
    from tests.spawn import spawn

    # ZeRO-3 hands DTensor shards to the optimizer: Lamb's trust ratio must use whole-parameter norms.
    results = spawn(_sharded_vs_full, 2, timeout=180)
    assert results == [{"Lamb": pytest.approx(0.0, abs=1e-12), "Lion": pytest.approx(0.0, abs=1e-12)}] * 2



@pytest.mark.gpu
def test_lamb_and_lion_on_cuda_match_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for cls in (Lamb, Lion):
        cpu = _params(4)
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        opt_cpu, opt_gpu = cls(cpu, lr=0.01, weight_decay=0.1), cls(gpu, lr=0.01, weight_decay=0.1)
        for step in range(3):
            for c, g, grad in zip(cpu, gpu, _grads(step, cpu), strict=True):
                c.grad, g.grad = grad, grad.cuda()
            opt_cpu.step()
            opt_gpu.step()
        for c, g in zip(cpu, gpu, strict=True):
            torch.testing.assert_close(g.detach().cpu(), c.detach(), rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- FusedAdamW (the kernel path)


def _adamw_pair(dtype: torch.dtype, impl: str):
    a = [p.detach().to(dtype).requires_grad_() for p in _params(5)]
    b = [p.detach().clone().requires_grad_() for p in a]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05, "weight_decay": 0.0}]  # noqa: E731
    fused = FusedAdamW(groups(a), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ref = torch.optim.AdamW(groups(b), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=True)
    for step in range(5):
        grads = _grads(step, a)
        for i, (pa, pb, g) in enumerate(zip(a, b, grads, strict=True)):
            skip = step == 2 and i == 1  # a parameter without a gradient skips a step (its count lags)
            pa.grad = None if skip else g.to(dtype)
            pb.grad = None if skip else g.to(dtype)
        with force_impl(impl):
            fused.step()
        ref.step()
    return a, b, fused, ref


@pytest.mark.parametrize("impl", ["auto", "torch"])  # torch's fused CPU kernel, and the reference
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_fused_adamw_matches_torch_adamw(impl: str, dtype: torch.dtype, atol: float) -> None:
    a, b, fused, ref = _adamw_pair(dtype, impl)
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0)
    assert [float(fused.state[p]["step"]) for p in a] == [5.0, 4.0, 5.0]
    for pa, pb in zip(a, b, strict=True):  # torch's state names and values: checkpoints interchange
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[pa][key], ref.state[pb][key], atol=atol, rtol=0)


def test_fused_adamw_continues_from_a_torch_adamw_state_dict() -> None:
    a, b, _, ref = _adamw_pair(torch.float64, "auto")
    resumed = FusedAdamW([{"params": a[:2]}, {"params": a[2:]}])
    resumed.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a checkpoint: nothing shared
    assert resumed.param_groups[1]["lr"] == 0.05
    grads = _grads(9, a)
    for pa, pb, g in zip(a, b, grads, strict=True):
        pa.grad, pb.grad = g.clone(), g.clone()
    resumed.step()
    ref.step()
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-12, rtol=0)


def _engine_adamw(rank: int, world_size: int, stage: int) -> dict:
    """Three steps of the tiny GPT at `stage`: the config's AdamW (FusedAdamW) vs torch.optim.AdamW."""
    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    data = SyntheticTokens(num_samples=32, seq_len=16, vocab_size=64)
    hp = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    finals, kinds = [], []
    for source in ("config", "torch"):
        torch.manual_seed(0)
        model = GPTWithLoss(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
        if source == "config":
            config["optimizer"] = {"type": "AdamW", "params": hp}
            kw = {}
        else:
            kw = {"optimizer": lambda g: torch.optim.AdamW(g, lr=hp["lr"], betas=(0.9, 0.95), eps=hp["eps"],
                                                           weight_decay=hp["weight_decay"])}
        engine, optimizer, loader, _ = deepspeed.initialize(model=model, config=config, training_data=data, **kw)
        for _, batch in zip(range(3), loader, strict=False):
            engine.backward(engine(batch))
            engine.step()
        kinds.append(type(optimizer).__name__)
        state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        kinds.append(type(state["exp_avg"]).__name__)
        finals.append({k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
                       for k, v in engine.sharding.state_dict()["model"].items()})
    diff = max(float((finals[0][k] - finals[1][k]).abs().max()) for k in finals[0])
    return {"diff": diff, "kinds": kinds}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_config_adamw_takes_the_fused_kernel_and_matches_torch_at_stage(stage: int) -> None:
    from tests.spawn import spawn

    for result in spawn(_engine_adamw, 2, stage, timeout=240):
        local = "DTensor" if stage == 3 else "Tensor"
        assert result["kinds"] == ["FusedAdamW", local, "AdamW", local]
        # the parity tolerance of test_zero_stages.py: a tenth of one AdamW step at lr 1e-3 (AdamW divides
        # by sqrt(v), so rounding-order differences near zero gradients grow to that size)
        assert result["diff"] < 1e-4, result


@pytest.mark.parametrize("section", [{"type": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.1}},
                                     {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}])
def test_torch_adam_on_its_fused_path_equals_the_foreach_path(section: dict) -> None:
    torch.manual_seed(0)
    shapes = [(7, 3), (5,), (2, 2, 2)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = build_optimizer([{"params": a[:2]}, {"params": a[2:]}], _optimizer_config(section))
    assert opt.defaults["fused"]
    cls = torch.optim.AdamW if section["type"] == "AdamW" else torch.optim.Adam
    ref = cls([{"params": b[:2]}, {"params": b[2:]}], lr=opt.defaults["lr"], betas=opt.defaults["betas"],
              eps=opt.defaults["eps"], weight_decay=0.1, foreach=True)
    for _ in range(5):
        for pa, pb in zip(a, b, strict=True):
            g = torch.randn(pa.shape)
            pa.grad, pb.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(opt.state[pa]["exp_avg_sq"], ref.state[pb]["exp_avg_sq"], atol=1e-7, rtol=1e-6)


def test_torch_adam_leaves_a_params_iterator_to_the_optimizer() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = build_optimizer([{"params": iter(params)}], _optimizer_config({"type": "AdamW", "params": {"torch_adam": True}}))
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
