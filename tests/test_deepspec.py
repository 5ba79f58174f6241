"""DeepSpec-format export and import (drafters/deepspec.py): the round trip keeps every draft logit, and the written
layout matches a specification of the reference's checkpoints, stated here in our own words.

The specification was read from deepseek-ai/DeepSpec (snapshot afdfa7c): `deepspec/modeling/dspark/qwen3/config.py`
and `modeling.py`, `deepspec/modeling/dspark/{common,markov_head}.py`, `deepspec/modeling/eagle3/qwen3/config.py`
and `modeling.py`, `deepspec/trainer/ckpt_manager.py` (transformers `save_pretrained`: config.json + safetensors).
Tiny seeded random Qwen3 (and Llama) hosts, fp32 on the CPU.
"""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from conftest import tiny_model
from drafters import load_drafter
from drafters.base import DraftState
from drafters.checkpoint import CheckpointError, read_config
from drafters.deepspec import export_deepspec
from drafters.dspark import DSparkConfig, DSparkDrafter, dflash_config
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from dspark.host import Host
from dspark.sampling import SamplingConfig

LAYERS, VOCAB, HIDDEN = 6, 128, 64  # host: 6 layers, 4 heads of 16, 2 KV heads
MASK_ID = VOCAB - 1
SMALL = dict(num_layers=2, rank=16, gamma=4, feature_layers=(0, 2, 4))
VARIANTS = {
    "dspark-markov": lambda host: DSparkDrafter(host, DSparkConfig(head="markov", **SMALL)),
    "dspark-gated": lambda host: DSparkDrafter(host, DSparkConfig(head="gated", **SMALL)),
    "dspark-rnn": lambda host: DSparkDrafter(host, DSparkConfig(head="rnn", **SMALL)),
    "dspark-markov-noconf": lambda host: DSparkDrafter(host, DSparkConfig(head="markov", confidence=False, **SMALL)),
    "dflash": lambda host: DSparkDrafter(host, dflash_config(**SMALL)),
    "eagle3": lambda host: Eagle3Drafter(host, Eagle3Config(feature_layers=(1, 2, 3))),
    "eagle3-five": lambda host: Eagle3Drafter(host, Eagle3Config(feature_layers=(0, 1, 2, 3, 4))),
}


@pytest.fixture(scope="module")
def qwen3_host() -> Host:
    return Host(tiny_model("qwen3", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS), name="tiny-qwen3")


def make(name: str, host, seed: int = 0):
    """A drafter with every parameter random (norm weights too, so a misplaced norm cannot hide)."""
    torch.manual_seed(seed)
    drafter = VARIANTS[name](host)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    return drafter


def draft_logits(drafter, host, seed: int = 1) -> list[torch.Tensor]:
    """Teacher-forced draft logits (and confidence logits) on a random two-document batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (2, 24), generator=g)  # (B, T), no real token is the mask id
    docs = torch.zeros(2, 24, dtype=torch.long)
    docs[1, 12:] = 1
    features = host.forward(ids, document_ids=docs, taps=drafter.feature_layers).features
    with torch.no_grad():
        if drafter.kind == "eagle3":
            return list(drafter.ttt_logits(ids, features, docs))
        anchors = torch.tensor([[0, 5, 9, 15], [2, 7, 13, 18]])  # (B, A)
        out = drafter.block_logits(input_ids=ids, features=features, document_ids=docs, anchors=anchors)
        return [out.q_logits] + ([out.conf_logits] if out.conf_logits is not None else [])


def proposals(drafter, host, K: int = 3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy draft tokens and confidences after a prefill of a random prompt, as the decode loop runs them."""
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, MASK_ID, (1, 16), generator=g)  # (1, Tmax): a prompt of 9 and the anchor at 9
    cache = host.new_cache(1, 16)
    out = host.step(cache, seq[:, :9], torch.tensor([9]), taps=drafter.feature_layers)
    drafter.begin(host=host, batch_size=1, max_len=16)
    state = DraftState(seq=seq, seq_len=torch.tensor([10]), seeds=torch.zeros(1, dtype=torch.long),
                       rounds=torch.zeros(1, dtype=torch.long), sampling=SamplingConfig(temperature=0.0))
    drafter.observe(features=out.features, start=torch.tensor([0]), n_valid=torch.tensor([9]), state=state)
    p = drafter.propose(state, K)
    return p.tokens, p.confidence


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_import_gives_identical_draft_logits(name, qwen3_host, tmp_path):
    drafter = make(name, qwen3_host)
    export_deepspec(drafter, qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    back = load_drafter(tmp_path / "ds", qwen3_host)
    assert type(back) is type(drafter) and back.config == drafter.config
    for a, b in zip(draft_logits(drafter, qwen3_host), draft_logits(back, qwen3_host), strict=True):
        assert torch.equal(a, b)
    tokens, conf = proposals(drafter, qwen3_host)
    tokens_back, conf_back = proposals(back, qwen3_host)
    assert torch.equal(tokens, tokens_back)
    assert (conf is None and conf_back is None) or torch.equal(conf, conf_back)


def test_unsorted_taps_are_written_in_increasing_order(qwen3_host, tmp_path):
    """The reference needs increasing target_layer_ids: fc's column blocks are reordered with them."""
    torch.manual_seed(0)
    drafter = make("dspark-markov", qwen3_host)
    shuffled = DSparkDrafter(qwen3_host, DSparkConfig(head="markov", **{**SMALL, "feature_layers": (4, 0, 2)}))
    state = drafter.state_dict()
    H = HIDDEN
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([fc[:, 2 * H:], fc[:, :H], fc[:, H:2 * H]], dim=1)  # blocks of taps 4, 0, 2
    shuffled.load_state_dict(state)
    export_deepspec(shuffled, qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["target_layer_ids"] == [0, 2, 4]
    back = load_drafter(tmp_path / "ds", qwen3_host)
    for a, b in zip(draft_logits(shuffled, qwen3_host), draft_logits(back, qwen3_host), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


# ---- the reference's layout, as a specification -------------------------------------------------------------------
# Qwen3DSparkModel (DSpark and DFlash): N decoder layers whose attention projects the block (queries, keys, values)
# and the fused target context (keys, values) with the same q/k/v projections; per-head RMSNorm of q and k; the
# layer's two RMSNorms and gated MLP as in Qwen3; a final RMSNorm "norm"; "fc" fusing the m tapped target layers
# (no bias) followed by the RMSNorm "hidden_norm"; its own copies of the target's token embedding and LM head; a
# Markov head "markov_head" (markov_w1 an embedding V x r, markov_w2 a bias-free linear r -> V; the gated head adds
# gate_proj: [h, w1] (H + r) -> r with bias; the RNN head adds joint_proj: [s, w1, h] (2r + H) -> 3r with bias); a
# confidence head "confidence_head.proj": linear (H [+ r when it reads the Markov embedding]) -> 1 with bias.


def dspark_spec(*, V, H, I, heads, kv_heads, D, layers, taps, rank, head_type, confidence, with_markov):
    """Reference parameter name -> shape for a Qwen3DSparkModel."""
    spec = {"embed_tokens.weight": (V, H), "norm.weight": (H,), "fc.weight": (H, taps * H),
            "hidden_norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(layers):
        p = f"layers.{i}."
        spec |= {p + "self_attn.q_proj.weight": (heads * D, H), p + "self_attn.k_proj.weight": (kv_heads * D, H),
                 p + "self_attn.v_proj.weight": (kv_heads * D, H), p + "self_attn.o_proj.weight": (H, heads * D),
                 p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                 p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                 p + "mlp.down_proj.weight": (H, I),
                 p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if rank:
        spec |= {"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)}
        if head_type == "gated":
            spec |= {"markov_head.gate_proj.weight": (rank, H + rank), "markov_head.gate_proj.bias": (rank,)}
        if head_type == "rnn":
            spec |= {"markov_head.joint_proj.weight": (3 * rank, 2 * rank + H),
                     "markov_head.joint_proj.bias": (3 * rank,)}
    if confidence:
        spec |= {"confidence_head.proj.weight": (1, H + (rank if with_markov else 0)),
                 "confidence_head.proj.bias": (1,)}
    return spec


# Qwen3Eagle3Model: "fc" fusing the tapped layers; one decoder layer whose attention reads [input_layernorm(token
# embedding), hidden_norm(feature)] (2H wide) with per-head q/k norms; post_attention_layernorm and MLP; final
# "norm"; its own embedding and LM head copies.
def eagle3_spec(*, V, H, I, heads, kv_heads, D, taps):
    p = "layers.0."
    return {"embed_tokens.weight": (V, H), "fc.weight": (H, taps * H), "norm.weight": (H,), "lm_head.weight": (V, H),
            p + "self_attn.q_proj.weight": (heads * D, 2 * H), p + "self_attn.k_proj.weight": (kv_heads * D, 2 * H),
            p + "self_attn.v_proj.weight": (kv_heads * D, 2 * H), p + "self_attn.o_proj.weight": (H, heads * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
            p + "hidden_norm.weight": (H,), p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,)}


# config.json: the target's config with these fields set (build_draft_config in the two config.py files)
DSPARK_FIELDS = {"architectures", "num_target_layers", "num_hidden_layers", "block_size", "tie_word_embeddings",
                 "layer_types", "mask_token_id", "target_layer_ids", "num_anchors", "enable_confidence_head",
                 "markov_rank"}  # + confidence_head_with_markov when the confidence head is on, + markov_head_type
EAGLE3_FIELDS = {"architectures", "num_target_layers", "num_hidden_layers", "layer_types", "target_model_name_or_path",
                 "target_layer_ids", "ttt_length", "step_loss_decay", "draft_num_hidden_layers", "tie_word_embeddings"}
TARGET_FIELDS = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "hidden_act"}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_matches_the_reference_layout(name, qwen3_host, tmp_path):
    drafter = make(name, qwen3_host)
    export_deepspec(drafter, qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    tensors = safetensors.torch.load_file(str(tmp_path / "ds" / "model.safetensors"))
    dims = dict(V=VOCAB, H=HIDDEN, I=2 * HIDDEN, heads=4, kv_heads=2, D=HIDDEN // 4)
    cfg = drafter.config
    assert TARGET_FIELDS <= set(config) and config["model_type"] == "qwen3"
    assert config["num_target_layers"] == LAYERS and config["target_layer_ids"] == list(cfg.feature_layers)
    assert config["tie_word_embeddings"] is False
    if name.startswith("eagle3"):
        assert config["architectures"] == ["Qwen3Eagle3Model"] and EAGLE3_FIELDS <= set(config)
        assert config["num_hidden_layers"] == config["draft_num_hidden_layers"] == 1
        assert (config["ttt_length"], config["step_loss_decay"]) == (cfg.ttt_length, cfg.step_decay)
        spec = eagle3_spec(taps=len(cfg.feature_layers), **dims)
    else:
        assert config["architectures"] == ["Qwen3DSparkModel"] and DSPARK_FIELDS <= set(config)
        rank = 0 if cfg.head == "none" else cfg.rank
        assert (config["num_hidden_layers"], config["block_size"], config["mask_token_id"], config["markov_rank"],
                config["enable_confidence_head"], config["num_anchors"]) == (
                    cfg.num_layers, cfg.gamma, MASK_ID, rank, cfg.confidence, cfg.max_anchors)
        assert config["layer_types"] == ["full_attention"] * cfg.num_layers
        head_type = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}.get(cfg.head)
        assert config.get("markov_head_type") == head_type
        assert config.get("confidence_head_with_markov") == (rank > 0 if cfg.confidence else None)
        spec = dspark_spec(layers=cfg.num_layers, taps=len(cfg.feature_layers), rank=rank, head_type=head_type,
                           confidence=cfg.confidence, with_markov=rank > 0, **dims)
        # the mask slot is the embedding of mask_token_id; every other row is the target's
        assert torch.equal(tensors["embed_tokens.weight"][MASK_ID], drafter.mask_embedding.detach())
        assert torch.equal(tensors["embed_tokens.weight"][:MASK_ID], qwen3_host.embed_tokens.weight[:MASK_ID])
    assert {k: tuple(v.shape) for k, v in tensors.items()} == spec
    assert torch.equal(tensors["lm_head.weight"], qwen3_host.lm_head.weight)


def test_llama_host_exports_the_same_layout_without_qk_norms(tmp_path):
    host = Host(tiny_model("llama", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS), name="tiny-llama")
    drafter = DSparkDrafter(host, DSparkConfig(head="markov", **SMALL))
    export_deepspec(drafter, host, tmp_path / "ds", mask_token_id=MASK_ID)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    tensors = safetensors.torch.load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert config["architectures"] == ["LlamaDSparkModel"]
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any("q_norm" in k for k in tensors)
    back = load_drafter(tmp_path / "ds", host)
    for a, b in zip(draft_logits(drafter, host), draft_logits(back, host), strict=True):
        assert torch.equal(a, b)


def test_read_config_translates_a_deepspec_config(qwen3_host, tmp_path):
    export_deepspec(make("dflash", qwen3_host), qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    saved = read_config(tmp_path / "ds")
    assert saved["kind"] == "dspark" and saved["config"]["head"] == "none" and saved["config"]["confidence"] is False


def test_reference_trained_checkpoint_without_our_extras_loads_with_variant_defaults(qwen3_host, tmp_path):
    """A checkpoint written by the reference has no "dspark" key: the loss settings fall back to the defaults."""
    export_deepspec(make("dflash", qwen3_host), qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    path = tmp_path / "ds" / "config.json"
    config = json.loads(path.read_text())
    del config["dspark"]
    path.write_text(json.dumps(config))
    back = load_drafter(tmp_path / "ds", qwen3_host)
    assert back.config.head == "none" and back.config.ce_weight == dflash_config().ce_weight


def test_import_refuses_another_targets_embedding(qwen3_host, tmp_path):
    export_deepspec(make("dspark-markov", qwen3_host), qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    other = Host(tiny_model("qwen3", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, seed=5), name="other")
    with pytest.raises(CheckpointError, match="embed_tokens.weight is not the host's"):
        load_drafter(tmp_path / "ds", other)


def test_import_refuses_what_dspark_cannot_express(qwen3_host, tmp_path):
    export_deepspec(make("dspark-markov", qwen3_host), qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    path = tmp_path / "ds" / "config.json"
    original = json.loads(path.read_text())
    cases = {"confidence_head_with_markov": (False, "ignores the Markov embedding"),
             "target_layer_ids": ([-1, 2, 4], "embedding output"),
             "markov_head_type": ("lstm", "unknown markov_head_type")}
    for key, (value, message) in cases.items():
        path.write_text(json.dumps({**original, key: value}))
        with pytest.raises(CheckpointError, match=message):
            load_drafter(tmp_path / "ds", qwen3_host)


def test_export_refuses_a_tap_of_the_last_layer_and_needs_a_mask_row(qwen3_host, tmp_path):
    drafter = DSparkDrafter(qwen3_host, DSparkConfig(head="markov", **{**SMALL, "feature_layers": (1, LAYERS - 1)}))
    with pytest.raises(ValueError, match="last layer"):
        export_deepspec(drafter, qwen3_host, tmp_path / "a", mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match="--mask-token-id"):  # a random host has no tokenizer, so no spare row
        export_deepspec(make("dflash", qwen3_host), qwen3_host, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
