"""The fused training loss (drafters/losses.py `fused_distill`) against the reference formulation it replaces, for every
trainable drafter: the same loss, metrics, acceptance and gradients of every parameter, in float32 on the CPU, with
one chunk and with many; no float32 (rows x vocabulary) tensor while it runs; and, on a GPU, its Triton kernels
against the torch ops of `chunk_terms_torch`.

A seeded random Llama host with a vocabulary much wider than its hidden size (V = 1024, H = 32), fp32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_model
from drafters import losses
from drafters.base import TrainBatch
from drafters.dspark import DSparkConfig, DSparkDrafter, dflash_config
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.mtp import MTPConfig, MTPDrafter
from dspark.engine.host import Host

B, T, V = 2, 40, 1024
SMALL = dict(num_layers=1, block_size=4, max_anchors=12)


@pytest.fixture(scope="module")
def wide_host() -> Host:
    return Host(tiny_model("llama", vocab=V, hidden=32, layers=4, seed=3), name="wide")


def draft_vocab_eagle3(host: Host) -> Eagle3Drafter:
    drafter = Eagle3Drafter(host, Eagle3Config(ttt_length=3, draft_vocab=200))
    drafter.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:200].sort().values)
    return drafter


DRAFTERS = {
    "dspark": lambda host: DSparkDrafter(host, DSparkConfig(rank=16, **SMALL)),
    "dspark-gated": lambda host: DSparkDrafter(host, DSparkConfig(rank=16, head="gated", **SMALL)),
    "dspark-rnn": lambda host: DSparkDrafter(host, DSparkConfig(rank=16, head="rnn", **SMALL)),
    "dflash": lambda host: DSparkDrafter(host, dflash_config(**SMALL)),
    "eagle3": lambda host: Eagle3Drafter(host, Eagle3Config(ttt_length=3)),
    "eagle3-draft-vocab": draft_vocab_eagle3,
    "mtp": lambda host: MTPDrafter(host, MTPConfig()),
}


def make_batch(host: Host, taps) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    document_ids = torch.zeros(B, T, dtype=torch.long)
    document_ids[1, 25:] = 1  # two packed documents in row 1
    loss_mask = (torch.rand(B, T, generator=g) < 0.8).long()
    loss_mask[:, :4] = 0
    with torch.no_grad():
        out = host.forward(ids, document_ids=document_ids, taps=taps)
    return TrainBatch(input_ids=ids, loss_mask=loss_mask, document_ids=document_ids, features=out.features,
                      host_logits=host.logits(out.hidden), anchor_seeds=torch.arange(B))


def run(drafter, batch: TrainBatch, impl: str):
    """training_loss with `impl`, then backward: (TrainOutput, {parameter name: gradient})."""
    drafter.loss_impl = impl
    drafter.zero_grad(set_to_none=True)
    out = drafter.training_loss(dataclasses.replace(batch))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", DRAFTERS)
def test_fused_loss_and_gradients_equal_the_reference(wide_host, name, monkeypatch):
    torch.manual_seed(0)
    drafter = DRAFTERS[name](wide_host)
    batch = make_batch(wide_host, tuple(drafter.feature_layers))
    want, want_grads = run(drafter, batch, "reference")
    assert set(want_grads) == {n for n, p in drafter.named_parameters() if p.requires_grad}
    for budget in (None, 3 * V):  # one chunk, and chunks of 3 rows
        if budget is not None:
            monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", budget)
        got, grads = run(drafter, batch, "fused")
        torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-5, atol=1e-6)
        assert got.metrics == pytest.approx(want.metrics, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(got.acceptance, want.acceptance, rtol=1e-5, atol=1e-6)
        assert got.weight == pytest.approx(want.weight)
        assert set(grads) == set(want_grads)
        for n, g in want_grads.items():
            # relative to the parameter's largest gradient: entries far below it are float noise in both
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                       msg=f"{name} {n} (budget {budget})")


class LargestFloat32(TorchDispatchMode):
    """Records the element count of the largest float32 tensor with a vocabulary-sized (V) dimension that any op
    allocates while active (views of its inputs are no allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and V in t.shape and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_fused_loss_holds_one_chunk_of_the_vocabulary_at_a_time(wide_host, name, monkeypatch):
    """Forward and backward of the fused loss make no float32 vocabulary-sized tensor larger than a chunk's (rows x V)
    or the largest parameter (a weight's gradient, DSpark's W2: V x r); in one chunk, the same measurement sees larger
    ones."""
    torch.manual_seed(0)
    drafter = DRAFTERS[name](wide_host)
    batch = make_batch(wide_host, tuple(drafter.feature_layers))
    weight = max(p.numel() for p in drafter.parameters())
    seen = {}
    for budget in (4 * V, losses.LOSS_CHUNK_ELEMENTS):
        monkeypatch.setattr(losses, "LOSS_CHUNK_ELEMENTS", budget)
        with LargestFloat32() as mode:
            drafter.training_loss(batch).loss.backward()
        seen[budget] = mode.largest
    assert seen[4 * V] <= max(4 * V, weight) < seen[losses.LOSS_CHUNK_ELEMENTS]


@pytest.mark.skipif(not torch.cuda.is_available() or not losses._HAS_TRITON, reason="needs a CUDA device and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["hard", "hard-bias", "soft", "draft-vocab"])
def test_triton_kernels_equal_the_torch_terms(mode, dtype):
    from drafters import loss_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    c, M, vocab = 37, 11, 5003  # a vocabulary that is no multiple of the kernels' block
    Vq = 1201 if mode == "draft-vocab" else vocab
    z = (3 * torch.randn(c, Vq, device="cuda", generator=g)).to(dtype)
    zb = torch.randn(c, Vq, device="cuda", generator=g).to(dtype) if mode == "hard-bias" else None
    hard = mode.startswith("hard")
    rows = losses.LossRows(
        host_logits=(3 * torch.randn(M, vocab, device="cuda", generator=g)).to(dtype),
        host_rows=torch.randint(0, M, (c,), device="cuda", generator=g),
        ce_coef=torch.rand(c, device="cuda", generator=g),
        tv_coef=torch.rand(c, device="cuda", generator=g) if hard else None,
        targets=torch.randint(0, vocab, (c,), device="cuda", generator=g) if hard else None,
        vocab_index=torch.randperm(vocab, device="cuda", generator=g)[:Vq].sort().values
        if mode == "draft-vocab" else None)
    results = []
    for fn in (losses.chunk_terms_torch, loss_kernels.chunk_terms):
        terms = [torch.empty(c, device="cuda") for _ in range(3)]
        grad = fn(z.clone(), zb, rows, 0, c, *terms, gradient=True)
        results.append((*terms, grad.float()))
    for name, want, got in zip(("ce", "tv", "mass", "gradient"), *results):
        # float32 sums in another order; the bf16 gradient is rounded once either way
        atol = 1e-5 if dtype == torch.float32 or name != "gradient" else 8e-3
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{mode} {dtype} {name}")
