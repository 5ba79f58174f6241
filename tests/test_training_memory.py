"""Training memory: the EAGLE-3 and DSpark losses keep no vocabulary-sized tensor for backward,
and give the same loss, metrics and gradients as the plain formulation that did.

A seeded random Llama host with a wide vocabulary (V = 4096 against H = 32, like a real LM's V >> H), fp32 on the CPU.
"Kept for backward" is measured with torch.autograd.graph.saved_tensors_hooks: the bytes of every distinct storage
autograd saves during the forward, the model's own weights excepted.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from drafters.base import TrainBatch
from drafters.dspark import DSparkConfig, DSparkDrafter, dflash_config, sample_anchors
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from drafters.losses import confidence_bce, distill_terms, per_position_mean, position_weights, weighted_mean
from dspark.engine.host import Host

B, T, V = 2, 48, 4096


@pytest.fixture(scope="module")
def wide_host() -> Host:
    return Host(tiny_model("llama", vocab=V, hidden=32, layers=4, seed=3), name="wide")


def make_batch(host: Host, taps, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    document_ids = torch.zeros(B, T, dtype=torch.long)
    document_ids[1, 30:] = 1  # two packed documents in row 1
    loss_mask = (torch.rand(B, T, generator=g) < 0.8).long()
    loss_mask[:, :4] = 0
    with torch.no_grad():
        out = host.forward(ids, document_ids=document_ids, taps=taps)
        host_logits = host.logits(out.hidden)
    return TrainBatch(input_ids=ids, loss_mask=loss_mask, document_ids=document_ids, features=out.features,
                      host_logits=host_logits, generator=torch.Generator().manual_seed(seed))


def fresh(batch: TrainBatch) -> TrainBatch:
    """The batch with its anchor generator reset, so that every loss below samples the same anchors."""
    return dataclasses.replace(batch, generator=torch.Generator().manual_seed(0))


def saved_for_backward(fn, *modules) -> tuple[object, int, list[tuple[int, ...]]]:
    """fn(), the bytes of the distinct storages autograd saved for backward during it and the saved tensors' shapes
    (the modules' weights excepted)."""
    weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    storages: dict[int, int] = {}
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values()), shapes


# ---- the plain formulations, as the drafters computed them before the chunked, checkpointed losses -------------


def eagle3_plain_loss(drafter: Eagle3Drafter, batch: TrainBatch):
    ids, doc = batch.input_ids, batch.document_ids
    S = drafter.config.ttt_length
    mask = batch.loss_mask.bool()
    p_all = F.softmax(batch.host_logits.float(), dim=-1)
    ce, accept, valid = [], [], []
    for j, logits in enumerate(drafter.ttt_logits(ids, batch.features, doc)):
        n = T - 1 - j
        log_q = F.log_softmax(logits[:, :n], dim=-1)
        p = p_all[:, 1 + j:]
        ce.append(F.pad(-(p * log_q).sum(-1), (0, T - n)))
        with torch.no_grad():
            accept.append(F.pad(1 - 0.5 * (log_q.exp() - p).abs().sum(-1), (0, T - n)))
        valid.append(F.pad(mask[:, 2 + j:], (0, 2 + j)) & (F.pad(doc[:, 2 + j:], (0, 2 + j), value=-1) == doc))
    ce, accept, valid = torch.stack(ce, -1), torch.stack(accept, -1), torch.stack(valid, -1)
    weights = drafter.config.step_decay ** torch.arange(S, dtype=torch.float32)
    return weighted_mean(ce, weights, valid), per_position_mean(accept, valid)


def dspark_plain_loss(drafter: DSparkDrafter, batch: TrainBatch):
    cfg, block_size = drafter.config, drafter.config.block_size
    anchors, anchor_ok = sample_anchors(batch.loss_mask, batch.document_ids, max_anchors=cfg.max_anchors,
                                        generator=batch.generator)
    out = drafter.block_logits(input_ids=batch.input_ids, features=batch.features, document_ids=batch.document_ids,
                               anchors=anchors)
    A = anchors.shape[1]
    slot = anchors.unsqueeze(2) + torch.arange(block_size)
    target = slot + 1
    in_range = target < T
    slot, target = slot.clamp(max=T - 1), target.clamp(max=T - 1)
    same_doc = batch.document_ids.gather(1, target.flatten(1)).view(B, A, block_size) == \
        batch.document_ids.gather(1, anchors).unsqueeze(2)
    response = batch.loss_mask.gather(1, target.flatten(1)).view(B, A, block_size).bool()
    valid = (in_range & same_doc & response).long().cumprod(2).bool() & anchor_ok.unsqueeze(2)
    targets = batch.input_ids.gather(1, target.flatten(1)).view(B, A, block_size)
    p_logits = batch.host_logits.gather(1, slot.flatten(1).unsqueeze(2).expand(B, A * block_size, V))
    terms = distill_terms(out.q_logits, p_logits.view(B, A, block_size, V), targets)
    w = position_weights(block_size, decay=cfg.decay)
    loss = cfg.ce_weight * weighted_mean(terms.ce, w, valid) + cfg.tv_weight * weighted_mean(terms.tv, w, valid)
    if cfg.confidence:
        loss = loss + cfg.conf_weight * weighted_mean(confidence_bce(out.conf_logits, terms.accept), w, valid)
    return loss, per_position_mean(terms.accept, valid)


DRAFTERS = {
    "eagle3": (lambda host: Eagle3Drafter(host, Eagle3Config(ttt_length=4)), eagle3_plain_loss),
    "dspark-rnn": (lambda host: DSparkDrafter(host, DSparkConfig(num_layers=1, block_size=4, rank=16, head="rnn",
                                                                 feature_layers=(0, 2), max_anchors=24)),
                   dspark_plain_loss),
    "dflash": (lambda host: DSparkDrafter(host, dflash_config(num_layers=1, block_size=4, feature_layers=(0, 2),
                                                              max_anchors=24)), dspark_plain_loss),
}


def gradients(drafter, loss) -> dict[str, torch.Tensor]:
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("name", DRAFTERS)
def test_loss_keeps_no_vocabulary_sized_tensor_for_backward(wide_host, name, monkeypatch):
    build, plain = DRAFTERS[name]
    torch.manual_seed(0)
    drafter = build(wide_host)
    batch = make_batch(wide_host, tuple(drafter.feature_layers))
    vocab_tensor = B * T * V * 4  # one (B, T, V) float32 tensor: the host logits' size

    plain_out, plain_saved, plain_shapes = saved_for_backward(lambda: plain(drafter, fresh(batch)), drafter, wide_host.model)
    out, saved, shapes = saved_for_backward(lambda: drafter.training_loss(fresh(batch)), drafter, wide_host.model)
    print(f"{name}: saved for backward {plain_saved / 2**20:.2f} MiB plain, {saved / 2**20:.2f} MiB now "
          f"(one (B, T, V) tensor: {vocab_tensor / 2**20:.2f} MiB)")
    assert plain_saved > 2 * vocab_tensor and any(V in s for s in plain_shapes)  # the measurement sees them
    assert not [s for s in shapes if V in s]  # what is left is the drafter's own layer: (B, T, H), (B, heads, T, T)
    assert saved < plain_saved / 4

    # the same loss, acceptance and gradients, with one chunk and with many small ones
    torch.testing.assert_close(out.loss, plain_out[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.acceptance, plain_out[1], rtol=1e-5, atol=1e-6)
    expected = gradients(drafter, plain(drafter, fresh(batch))[0])
    for budget in (None, 16 * B * V):  # one chunk, and chunks of 16 positions / 4 DSpark blocks
        if budget is not None:
            monkeypatch.setattr("drafters.losses.LOSS_CHUNK_ELEMENTS", budget)
        got = gradients(drafter, drafter.training_loss(fresh(batch)).loss)
        assert set(got) == set(expected)
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-4, atol=1e-7, msg=f"{name} {n} (budget {budget})")


def test_loss_chunks_are_larger_on_a_gpu_within_its_memory(monkeypatch):
    """86 DSpark chunks a step at the CPU's budget made the H100 / H200 training steps 4x slower (drafters/losses.py:
    0.91-1.06 s against 0.25 s at the CUDA budget); on CUDA the budget is LOSS_CHUNK_ELEMENTS_CUDA, or 1/128 of a
    smaller card's memory, never below the CPU's."""
    from types import SimpleNamespace

    from drafters import losses

    cards = {80 * 2**30: losses.LOSS_CHUNK_ELEMENTS_CUDA, 24 * 2**30: 24 * 2**30 // 128,
             1 * 2**30: losses.LOSS_CHUNK_ELEMENTS}
    for total, expected in cards.items():
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, t=total: SimpleNamespace(total_memory=t))
        assert losses.loss_chunk_elements("cuda:0") == expected
    assert losses.loss_chunk_elements("cpu") == losses.loss_chunk_elements(None) == losses.LOSS_CHUNK_ELEMENTS
    row = 4 * 7 * 49152  # the SmolLM2 recipe's DSpark blocks: 4 rows x block_size 7 x V
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    assert -(-1024 // losses.chunk_rows(row, device="cuda")) == 6  # chunks of 1024 blocks (86 at the CPU's budget)
    assert -(-1024 // losses.chunk_rows(row)) == 86
