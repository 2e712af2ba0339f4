"""Tensor parallelism (engine/inference/tensor_parallel.py) on 2 gloo ranks: greedy generation with
TP=2 is token-identical to Hugging Face generate for every architecture, and to the example GPT's
own decoding; TP=2 composes with int8 weights; a tp_size that does not divide the heads is refused."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

pytest.importorskip("transformers")

NEW = 8
# Two gloo ranks build and decode five models: ~40 s of CPU, more on a shared 2-core box.
pytestmark = pytest.mark.slow


def _tp_generate(rank: int, world: int) -> dict:
    from deepfleet.engine import comm, init_inference
    from deepfleet.engine.inference.tensor_parallel import RowParallel
    from tests.engine.inference.models import HF_ARCHS, example_gpt, hf_model, left_padded, prompts

    ids, mask = left_padded(prompts(3))
    out = {}
    for arch in (*HF_ARCHS, "example-gpt"):
        model = example_gpt() if arch == "example-gpt" else hf_model(arch)
        engine = init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2}, max_out_tokens=64)
        assert isinstance(engine.module.layers[0].o, RowParallel)
        assert engine.cache.layers[0][0].shape[1] * 2 == engine.module.layers[0].n_kv_heads  # half the heads
        comm.reset_counters()
        out[arch] = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
        out[arch + "/all_reduces"] = comm.counters()["all_reduce"].count
    q8 = init_inference(hf_model("llama"), dtype=torch.int8, tensor_parallel={"tp_size": 2})
    out["llama-int8"] = q8.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    try:
        init_inference(example_gpt(), dtype=torch.float32, tensor_parallel={"tp_size": 3})
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.fixture(scope="module")
def tp_results():
    return spawn(_tp_generate, 2)


def test_tp2_greedy_is_token_identical_to_hf_generate(tp_results):
    from tests.engine.inference.models import HF_ARCHS, hf_model, left_padded, prompts

    ids, mask = left_padded(prompts(3))
    for arch in HF_ARCHS:
        ref = hf_model(arch).generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        for rank in (0, 1):
            assert torch.equal(tp_results[rank][arch], ref), (arch, rank)
        # one all-reduce per row-parallel projection (2 per layer, 2 layers) per forward
        assert tp_results[0][arch + "/all_reduces"] % 4 == 0 and tp_results[0][arch + "/all_reduces"] > 0


def test_tp2_example_gpt_and_int8(tp_results):
    from deepfleet.engine import init_inference
    from tests.engine.inference.models import example_gpt, hf_model, left_padded, prompts

    ids, mask = left_padded(prompts(3))
    single = init_inference(example_gpt(), dtype=torch.float32).generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(tp_results[0]["example-gpt"], single)
    q8 = init_inference(hf_model("llama"), dtype=torch.int8).generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                                      pad_token_id=0)
    assert tp_results[0]["llama-int8"].shape == q8.shape
    agree = (tp_results[0]["llama-int8"] == q8).float().mean()
    assert agree > 0.8  # int8 per-shard scales equal whole-row scales for column shards; row shards differ
    assert tp_results[0]["error"].startswith("tensor_parallel.tp_size: 3 must divide layer 0's 4 attention heads")
