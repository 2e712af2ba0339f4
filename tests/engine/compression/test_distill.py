"""Distillation losses against their formulas, and the hidden-state map of layer reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepfleet.engine.compression.distill import Distiller, hidden_mse_loss, logit_kd_loss
from examples.gpt.model import GPTConfig, TinyGPT


def test_logit_loss_is_scaled_kl_of_softened_distributions() -> None:
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    temp = 2.0
    p = F.softmax(t / temp, -1)
    ref = (p * (p.log() - F.log_softmax(s / temp, -1))).sum(-1).mean() * temp**2
    torch.testing.assert_close(logit_kd_loss(s, t, temperature=temp), ref)
    assert float(logit_kd_loss(t, t)) < 1e-6


def test_hidden_loss_is_mean_mse_over_pairs() -> None:
    a, b = [torch.randn(2, 4), torch.randn(2, 4)], [torch.randn(2, 4), torch.randn(2, 4)]
    ref = (F.mse_loss(a[0], b[0]) + F.mse_loss(a[1], b[1])) / 2
    torch.testing.assert_close(hidden_mse_loss(a, b), ref)


def test_distiller_maps_student_layers_to_teacher_layers() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4)
    teacher = TinyGPT(cfg)
    student = TinyGPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2))
    d = Distiller(student, teacher, module_name_prefix="blocks", teacher_layer=[1, 3], hidden_weight=0.5)
    ids = torch.randint(0, 32, (2, 8))
    t_logits = d.teacher_forward(ids)
    s_logits = student(ids)
    # reference: run the layers by hand
    with torch.no_grad():
        x = teacher.tok(ids) + teacher.pos(torch.arange(8))
        th = []
        for blk in teacher.blocks:
            x = blk(x)
            th.append(x)
    y = student.tok(ids) + student.pos(torch.arange(8))
    sh = []
    for blk in student.blocks:
        y = blk(y)
        sh.append(y)
    ref = logit_kd_loss(s_logits, t_logits) + 0.5 * hidden_mse_loss(sh, [th[1], th[3]])
    loss = d.loss(s_logits, t_logits)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert student.blocks[0].fc.weight.grad is not None
    assert all(p.grad is None for p in teacher.parameters())
