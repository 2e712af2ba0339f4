"""init_inference on GPT-2, Llama, OPT and the example GPT: same logits and greedy tokens as the source
model, batched mixed lengths equal one by one, continuous batching, sampling, bad arguments."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine import init_inference
from deepfleet.engine.compression.generate import greedy_generate
from deepfleet.engine.inference.decoder import MatmulLinear
from deepfleet.engine.inference.sampling import Sampling
from tests.engine.inference.models import HF_ARCHS, example_gpt, hf_model, left_padded, prompts

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_greedy_generation_is_token_identical_to_hf_generate(arch):
    model = hf_model(arch)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64)
    ids = torch.tensor(prompts(3, low=6, high=7))  # equal lengths: no padding on the HF side
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(engine.generate(ids, max_new_tokens=12, pad_token_id=0), ref)


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_left_padded_batch_equals_hf_generate_and_one_by_one(arch):
    model = hf_model(arch)
    rows = prompts(4)
    ids, mask = left_padded(rows)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64, max_batch_size=4)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    for i, row in enumerate(rows):
        single = engine.generate(torch.tensor([row]), max_new_tokens=8, pad_token_id=0)
        new = single[0, len(row):]
        assert torch.equal(out[i, ids.shape[1]:ids.shape[1] + len(new)], new)


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_forward_returns_the_models_logits(arch):
    model = hf_model(arch)
    engine = init_inference(model, dtype=torch.float32)
    ids = torch.tensor(prompts(2, low=7, high=8))
    torch.testing.assert_close(engine(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_forward_with_a_padding_mask_matches_hf_forward(arch):
    model = hf_model(arch)
    engine = init_inference(model, dtype=torch.float32)
    ids, mask = left_padded(prompts(3))
    real = mask.bool()
    got, ref = engine(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    got = engine(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[real], model(ids, attention_mask=mask, position_ids=pos).logits[real],
                               atol=1e-5, rtol=1e-5)


def test_example_gpt_matches_its_own_forward_and_greedy_decoding():
    model = example_gpt()
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64)
    ids = torch.tensor(prompts(3, low=5, high=6))
    torch.testing.assert_close(engine(ids), model(ids), atol=1e-5, rtol=1e-5)
    ref = greedy_generate(model, ids, max_new_tokens=10, max_context=64)
    assert torch.equal(engine.generate(ids, max_new_tokens=10), ref)


def test_more_prompts_than_slots_and_mixed_lengths_equal_one_by_one():
    model = example_gpt()
    rows = prompts(7)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=32, max_batch_size=3)
    batched = [engine.submit(r, max_new_tokens=6) for r in rows]
    while not all(r.done for r in batched):
        engine.step()
    for row, request in zip(rows, batched, strict=True):
        alone = greedy_generate(model, torch.tensor([row]), max_new_tokens=6, max_context=64)
        assert request.tokens == alone[0, len(row):].tolist()


def test_requests_joining_between_decode_steps_get_their_own_tokens():
    model = hf_model("llama")
    rows = prompts(3)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64, max_batch_size=4)
    first = engine.submit(rows[0], max_new_tokens=10)
    engine.step()
    engine.step()
    second = engine.submit(rows[1], max_new_tokens=10)
    engine.step()
    third = engine.submit(rows[2], max_new_tokens=4)
    while not all(r.done for r in (first, second, third)):
        engine.step()
    for row, request in zip(rows, (first, second, third), strict=True):
        ref = model.generate(torch.tensor([row]), max_new_tokens=request.max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        assert request.tokens == ref[0, len(row):].tolist()
    assert engine.cache.free == engine.cache.slots  # every slot came back


def test_eos_stops_a_row_and_pads_it_like_hf():
    model = hf_model("opt")  # eos 2 is in the vocabulary, so some rows stop early
    rows = prompts(6, seed=3)
    ids, mask = left_padded(rows, pad=1)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=20), ref)


def test_sampling_is_reproducible_with_a_generator_and_top_k_1_is_greedy():
    model = example_gpt()
    row = prompts(1)[0]
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64)

    def sample(seed, **kw):
        r = engine.submit(row, max_new_tokens=12, sampling=Sampling(do_sample=True, **kw),
                          generator=torch.Generator().manual_seed(seed))
        while not r.done:
            engine.step()
        return r.tokens

    assert sample(5, temperature=1.5) == sample(5, temperature=1.5)
    assert sample(5, temperature=1.5) != sample(6, temperature=1.5)
    greedy = greedy_generate(model, torch.tensor([row]), max_new_tokens=12, max_context=64)[0, len(row):].tolist()
    assert sample(7, top_k=1) == greedy
    assert sample(8, top_p=1e-6) == greedy  # top-p keeps at least the most likely token


def test_kernel_inject_routes_through_deepfleet_kernels_with_the_same_tokens():
    model = hf_model("llama")
    ids = torch.tensor(prompts(2, low=6, high=7))
    plain = init_inference(model, dtype=torch.float32).generate(ids, max_new_tokens=8)
    fused = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert all(m.fused and m.qkv is not None and m.gate_up is not None for m in fused.module.layers)
    # and every fp32 projection and the untied head read their weights transposed (MatmulLinear)
    assert all(type(getattr(m, name)) is MatmulLinear for m in fused.module.layers for name in ("qkv", "o", "gate_up",
                                                                                              "down"))
    assert type(fused.module.head) is MatmulLinear
    assert torch.equal(fused.generate(ids, max_new_tokens=8), plain)
    q8 = init_inference(model, dtype=torch.int8, replace_with_kernel_inject=True)  # fused, then quantized
    assert type(q8.module.layers[0].qkv).__name__ == "Int8Linear"
    assert q8.generate(ids, max_new_tokens=8).shape == plain.shape
    bf16 = init_inference(model, dtype=torch.bfloat16, replace_with_kernel_inject=True)  # casts `model` too
    assert type(bf16.module.layers[0].o) is torch.nn.Linear and type(bf16.module.head) is torch.nn.Linear


def test_kernel_inject_runs_the_triton_kernels_when_the_dispatcher_selects_them():
    pytest.importorskip("triton")
    from deepfleet.kernels._dispatch import force_impl, interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it outside GPU runs)")
    model = hf_model("llama")
    ids = torch.tensor(prompts(2, low=4, high=5))
    plain = init_inference(model, dtype=torch.float32).generate(ids, max_new_tokens=3)
    fused = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    with force_impl("triton"):  # rms_norm, rope and swiglu run as Triton kernels (interpreted on CPU)
        assert torch.equal(fused.generate(ids, max_new_tokens=3), plain)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bogus": 1}, "bogus: is not an init_inference setting"),
    ({"dtype": "fp8"}, "dtype: "),
    ({"quant": {"activation": {"enabled": True}}}, "quant.activation.enabled"),
    ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size"),
    ({"enable_cuda_graph": True}, "enable_cuda_graph"),
])
def test_bad_settings_are_one_line_errors_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as err:
        init_inference(example_gpt(), **kwargs)
    assert "\n" not in str(err.value)


def test_unsupported_model_and_too_long_requests_are_refused():
    with pytest.raises(ValueError, match="model architecture 'Linear' is not supported"):
        init_inference(torch.nn.Linear(2, 2))
    engine = init_inference(example_gpt(), dtype=torch.float32, max_out_tokens=16)
    with pytest.raises(ValueError, match="max_out_tokens"):
        engine.submit([3] * 10, max_new_tokens=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([500], max_new_tokens=1)
    with pytest.raises(TypeError, match="'num_beam'"):
        engine.generate(torch.tensor([[3, 4]]), num_beam=2)
