"""`InferenceEngine.compile()`: the static-shape decode step and the dynamic-shape packed prefill under
torch.compile give the same greedy tokens as HF `generate` (left-padded mixed lengths, kernel inject on
and off), requests that join between steps and use fewer rows than the cache has slots get their own
tokens, the step compiles once per row bucket (no recompiles from each batch size or position), and the
prefill takes any mix of prompts in two graphs."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from deepfleet.engine import init_inference
from deepfleet.engine.inference.compiled import row_bucket
from tests.engine.inference.models import hf_model, left_padded, prompts

pytest.importorskip("transformers")
# Each case compiles a decode step with inductor: 20-60 s of CPU on a shared 2-core box.
pytestmark = [pytest.mark.slow,
              # torch's inductor imports torch.utils.mkldnn, which defines TorchScript modules (torch's warning).
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]


def test_row_buckets_are_powers_of_two_capped_at_the_slots() -> None:
    assert [row_bucket(n, slots=6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "kernel-inject"])
def test_compiled_decode_is_token_identical_to_hf_generate(inject: bool) -> None:
    torch._dynamo.reset()
    counters.clear()
    model = hf_model("llama")
    rows = prompts(4)
    ids, mask = left_padded(rows)
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=48, max_batch_size=6,
                            replace_with_kernel_inject=inject)
    engine.compile()
    assert engine.is_compiled
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    # Fewer running rows than slots, joining between steps: each gets its own HF tokens.
    first = engine.submit(rows[0], max_new_tokens=6)
    engine.step()
    second = engine.submit(rows[1], max_new_tokens=9)
    while not (first.done and second.done):
        engine.step()
    for row, request in zip(rows[:2], (first, second), strict=True):
        alone = model.generate(torch.tensor([row]), max_new_tokens=request.max_new_tokens, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        assert request.tokens == alone[0, len(row):].tolist()
    # Decode: rows 0..3 (the padded batch of 4), then 0..1 (one or two running), keys up to every live
    # length: one graph per row bucket, none recompiled. Prefill: one graph for 4 prompts, one for 1.
    assert counters["stats"]["unique_graphs"] <= 3 + 2


def test_compiled_prefill_takes_any_mix_of_prompts_in_two_graphs() -> None:
    torch._dynamo.reset()
    counters.clear()
    model = hf_model("llama")
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=48, max_batch_size=6,
                            replace_with_kernel_inject=True)
    engine.compile()
    # One new token: the prefill alone makes it. Prompt counts 1..6, lengths 1..11, rows in any slots.
    for seed, n in [(1, 4), (2, 3), (3, 1), (4, 6), (5, 1), (6, 2)]:
        rows = prompts(n, seed=seed, low=1, high=12)
        ids, mask = left_padded(rows)
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref), (seed, n)
    assert counters["stats"]["unique_graphs"] == 2  # several prompts, and a single one (size 1 specializes)
