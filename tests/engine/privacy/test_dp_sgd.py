"""DP-SGD (engine/privacy.py): per-sample gradients against a per-example loop, the accountant against an
independent RDP computation, a 2-rank run against single-process DP-SGD at ZeRO 0-2, and config errors."""

from __future__ import annotations

import math
import types

import pytest
import torch

from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.privacy import DPSGD, build_privacy
from tests.engine.privacy.dp_runs import (
    CLIP,
    SIGMA,
    global_batches,
    make_model,
    per_example_grads,
    reference_dp_sgd,
    train_rank,
)
from tests.spawn import spawn

pytest.importorskip("opacus")


def _section(**kw: object) -> types.SimpleNamespace:
    base = {"max_grad_norm": CLIP, "delta": 1e-5, "secure_rng": False, "seed": 0, "accountant": "rdp",
            "noise_multiplier": SIGMA}
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_clipped_per_sample_sum_equals_per_example_loop(clip: float) -> None:
    model = make_model()
    dp = DPSGD(model, object(), section=_section(max_grad_norm=clip), sample_rate=0.01, batch_size=4,
               gradient_accumulation_steps=1, group=None, dp_size=1, reduce_here=False)
    batch = global_batches()[0]  # 8 examples
    with dp.backward_context():
        model(batch).backward()
    dp.after_backward()
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for example in per_example_grads(model, batch):
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in example))
        factor = min(1.0, clip / (norm + 1e-6))
        for e, g in zip(expected, example, strict=True):
            e.add_(g, alpha=factor)
    if clip < 1:
        assert dp.last_clipped_fraction == 1.0  # every example was clipped
    for s, e in zip(dp._sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # the unclipped gradient is dropped


def _rdp_integer_orders(q: float, sigma: float, steps: int, delta: float) -> float:
    """Epsilon from the RDP of the sampled Gaussian mechanism at integer orders (Mironov, Talwar, Zhang
    2019, the binomial expansion for integer alpha), converted as in Balle et al. 2020 (Opacus' rule)."""
    best = math.inf
    for alpha in range(2, 256):
        log_terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
                     + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma ** 2)
                     for k in range(alpha + 1)]
        top = max(log_terms)
        rdp = steps * (top + math.log(sum(math.exp(t - top) for t in log_terms))) / (alpha - 1)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize(("q", "sigma", "steps"), [(256 / 60000, 1.1, 14000), (0.01, 1.0, 1000), (0.05, 2.0, 300)])
def test_accountant_epsilon_matches_independent_rdp(q: float, sigma: float, steps: int) -> None:
    dp = DPSGD(make_model(), object(), section=_section(noise_multiplier=sigma), sample_rate=q, batch_size=4,
               gradient_accumulation_steps=1, group=None, dp_size=1, reduce_here=False)
    assert dp.epsilon() == 0.0
    dp.steps = steps
    dp.accountant.history = [(sigma, q, steps)]
    ours = _rdp_integer_orders(q, sigma, steps, 1e-5)
    # Opacus' orders include fractional ones between the integers, so its minimum can only be lower
    assert ours * 0.97 <= dp.epsilon() <= ours + 1e-9


def test_target_epsilon_derives_a_noise_multiplier_that_meets_it() -> None:
    dp = DPSGD(make_model(), object(), section=_section(noise_multiplier=None, target_epsilon=3.0, epochs=2.0),
               sample_rate=0.01, batch_size=4, gradient_accumulation_steps=1, group=None, dp_size=1,
               reduce_here=False)
    dp.steps = 200
    dp.accountant.history = [(dp.noise_multiplier, 0.01, 200)]
    assert 2.8 < dp.epsilon() <= 3.0
    resumed = DPSGD(make_model(), object(), section=_section(), sample_rate=0.01, batch_size=4,
                    gradient_accumulation_steps=1, group=None, dp_size=1, reduce_here=False)
    resumed.load_state_dict(dp.state_dict())  # what a checkpoint carries (engine/checkpoint/api.py)
    assert resumed.steps == 200 and resumed.epsilon() == dp.epsilon()


@pytest.mark.slow  # three 2-rank engines and one single-rank engine: ~35 s on two cores
def test_two_ranks_match_single_process_dp_sgd_at_zero_0_1_2(tmp_path) -> None:
    ranks = spawn(train_rank, 2, [0, 1, 2], timeout=120)
    single = spawn(train_rank, 1, [0], str(tmp_path), timeout=120)[0][0]
    assert single["resumed_epsilon"] == single["epsilon"]  # the accountant's history is checkpointed
    reference = reference_dp_sgd()
    for p, r in zip(single["params"], reference, strict=True):  # the engine at one rank = DP-SGD written out
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    for stage in (0, 1, 2):
        for rank in (0, 1):
            run = ranks[rank][stage]
            for p, r in zip(run["params"], single["params"], strict=True):
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            eps, delta = run["epsilon"]
            assert delta == 1e-5 and eps > 0
            assert run["metric_epsilon"][-1] == eps and run["metric_epsilon"][0] < eps


def _cfg(dp: dict, **extra: object):
    return load_config({"train_batch_size": 4, "deepfleet_differential_privacy": dp, **extra})


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"deepfleet_differential_privacy\.noise_multiplier: unset"):
        _cfg({"enabled": True})
    with pytest.raises(ConfigError, match=r"deepfleet_differential_privacy\.noise_mult: unknown key; did you mean "
                                          r"deepfleet_differential_privacy\.noise_multiplier"):
        _cfg({"enabled": True, "noise_mult": 1.0})
    with pytest.raises(ConfigError, match=r"deepfleet_differential_privacy\.epochs: unset"):
        _cfg({"enabled": True, "target_epsilon": 3.0})
    with pytest.raises(ConfigError, match=r"deepfleet_differential_privacy\.accountant: 'gdp' is not allowed"):
        _cfg({"enabled": True, "noise_multiplier": 1.0, "accountant": "gdp"})
    with pytest.raises(ConfigError, match=r"deepfleet_differential_privacy\.max_grad_norm: must be > 0"):
        _cfg({"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 0})
    on = {"enabled": True, "noise_multiplier": 1.0, "sample_rate": 0.1}
    for extra, message in [({"zero_optimization": {"stage": 3}}, "not supported at zero_optimization.stage 3"),
                           ({"fp16": {"enabled": True}}, "not supported with fp16"),
                           ({"gradient_clipping": 1.0}, "gradient_clipping is set")]:
        with pytest.raises(ValueError, match=rf"deepfleet_differential_privacy\.enabled: {message}"):
            build_privacy(_cfg(on, **extra), make_model(), object(), group=None, dp_size=1, dataset_size=None)
    with pytest.raises(ValueError, match=r"deepfleet_differential_privacy\.sample_rate: unset and no dataset size"):
        build_privacy(_cfg({"enabled": True, "noise_multiplier": 1.0}), make_model(), object(), group=None,
                      dp_size=1, dataset_size=None)
    assert build_privacy(_cfg({}), make_model(), object(), group=None, dp_size=1, dataset_size=None) is None
    dp = build_privacy(_cfg({"enabled": True, "noise_multiplier": 1.0}), make_model(), object(), group=None,
                       dp_size=1, dataset_size=400)
    assert dp is not None and dp.sample_rate == 4 / 400


def test_the_example_gpt_as_shipped_has_per_sample_gradients_for_every_parameter() -> None:
    """examples/gpt feeds its position embedding batched positions, so DP-SGD needs nothing frozen: the
    clipped per-sample sum over every parameter (the position table included) equals a per-example loop."""
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    params = list(model.parameters())
    assert all(p.requires_grad for p in params)
    dp = DPSGD(model, object(), section=_section(max_grad_norm=0.5), sample_rate=0.01, batch_size=4,
               gradient_accumulation_steps=1, group=None, dp_size=1, reduce_here=False)
    data = SyntheticTokens(num_samples=4, seq_len=8, vocab_size=32)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    with dp.backward_context():
        model(batch).backward()
    dp.after_backward()
    expected = [torch.zeros_like(p) for p in params]
    for i in range(4):
        model.zero_grad()
        with DPSGD.backward_context():
            model({k: v[i:i + 1] for k, v in batch.items()}).backward()
        grads = [p.grad.detach().clone() for p in params]
        factor = min(1.0, 0.5 / (math.sqrt(sum(float(g.pow(2).sum()) for g in grads)) + 1e-6))
        for e, g in zip(expected, grads, strict=True):
            e.add_(g, alpha=factor)
    assert dp._sums[1] is not None and dp._sums[1].shape == model.gpt.pos.weight.shape  # the position table
    for s, e in zip(dp._sums, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-4, atol=1e-6)
