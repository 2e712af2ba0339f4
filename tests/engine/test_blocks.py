"""blocks(model): the transformer blocks FSDP wraps (and activation checkpointing and pipeline stages
will use), found on Hugging Face-shaped module trees, on the example GPT, and by a user's override."""

from __future__ import annotations

import pytest
from torch import nn

from deepfleet.engine.blocks import blocks
from examples.gpt.model import GPTConfig, GPTWithLoss, TinyGPT


class Layer(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts)) if experts else nn.Linear(4, 4)


class GPT2Style(nn.Module):
    """GPT-2's tree: transformer.{wte, wpe, h[i], ln_f}, lm_head."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(8, 4)
        self.transformer.h = nn.ModuleList(Layer() for _ in range(n))
        self.transformer.ln_f = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8)


class LlamaStyle(nn.Module):
    """Llama's tree: model.{embed_tokens, layers[i], norm}, lm_head; heads are a ModuleList too."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, 4)
        self.model.layers = nn.ModuleList(Layer() for _ in range(n))
        self.model.norm = nn.LayerNorm(4)
        self.heads = nn.ModuleList([nn.Linear(4, 8), nn.Linear(4, 2)])


class DecoderLayer(Layer):
    pass


class NoSplit(nn.Module):
    """A PreTrainedModel-like wrapper declaring `_no_split_modules`, with its layers under an odd name."""

    _no_split_modules = ["DecoderLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(DecoderLayer(), nn.ReLU(), DecoderLayer())
        self.pre = nn.ModuleList(Layer() for _ in range(4))  # not the blocks: the declaration wins


def test_hugging_face_shaped_models() -> None:
    gpt2, llama = GPT2Style(), LlamaStyle()
    assert blocks(gpt2) == list(gpt2.transformer.h)
    assert blocks(llama) == list(llama.model.layers)  # not the heterogeneous heads list
    no_split = NoSplit()
    assert blocks(no_split) == [no_split.body[0], no_split.body[2]]


def test_the_example_gpt_and_wrappers_of_it() -> None:
    gpt = TinyGPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=3))
    assert blocks(gpt) == list(gpt.blocks)
    wrapped = GPTWithLoss(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=2))
    assert blocks(wrapped) == list(wrapped.gpt.blocks)


def test_a_list_inside_a_block_never_splits_it() -> None:
    model = nn.Module()
    model.stack = nn.ModuleList(Layer(experts=2) for _ in range(2))  # MoE experts inside each block
    assert blocks(model) == list(model.stack)
    assert blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_overrides_by_path_or_class_names() -> None:
    llama = LlamaStyle()
    llama.deepfleet_blocks = "heads"
    assert blocks(llama) == list(llama.heads)
    gpt2 = GPT2Style()
    gpt2.deepfleet_blocks = ["LayerNorm", "Embedding"]
    assert blocks(gpt2) == [gpt2.transformer.wte, gpt2.transformer.ln_f]


@pytest.mark.parametrize(
    ("override", "message"),
    [("model.nothing", "deepfleet_blocks: 'model.nothing' is not an nn.ModuleList"),
     (["NoSuchLayer"], "no submodule has a class named"),
     (3, "expected an attribute path or a list of class names")],
)
def test_bad_overrides_name_the_attribute(override: object, message: str) -> None:
    model = LlamaStyle()
    model.deepfleet_blocks = override
    with pytest.raises(ValueError, match=message):
        blocks(model)
