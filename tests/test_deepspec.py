"""DeepSpec-format export and import (drafters/deepspec.py): the round trip keeps every draft logit, and the written
layout matches a specification of the reference's checkpoints, stated here in our own words.

The specification was read from deepseek-ai/DeepSpec (snapshot afdfa7c): `deepspec/modeling/dspark/qwen3/config.py`
and `modeling.py`, `deepspec/modeling/dspark/{common,markov_head}.py`, `deepspec/modeling/eagle3/qwen3/config.py`
and `modeling.py`, `deepspec/trainer/ckpt_manager.py` (transformers `save_pretrained`: config.json + safetensors).
Tiny seeded random Qwen3 (and Llama) hosts, fp32 on the CPU.
"""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

from conftest import tiny_model
from drafters import load_drafter
from drafters.checkpoint import CheckpointError, read_config
from drafters.deepspec import export_deepspec
from drafters.dspark import DSparkConfig, DSparkDrafter, dflash_config
from drafters.eagle3 import Eagle3Config, Eagle3Drafter
from dspark.engine.host import Host
from dspark.engine.protocol import DraftState
from dspark.engine.sampling import SamplingConfig

LAYERS, VOCAB, HIDDEN = 6, 128, 64  # host: 6 layers, 4 heads of 16, 2 KV heads
MASK_ID = VOCAB - 1
SMALL = dict(num_layers=2, rank=16, block_size=4, feature_layers=(0, 2, 4))
VARIANTS = {
    "dspark-markov": lambda host: DSparkDrafter(host, DSparkConfig(head="markov", **SMALL)),
    "dspark-gated": lambda host: DSparkDrafter(host, DSparkConfig(head="gated", **SMALL)),
    "dspark-rnn": lambda host: DSparkDrafter(host, DSparkConfig(head="rnn", **SMALL)),
    "dspark-markov-noconf": lambda host: DSparkDrafter(host, DSparkConfig(head="markov", confidence=False, **SMALL)),
    "dspark-frozen-mask": lambda host: DSparkDrafter(host, DSparkConfig(head="rnn", mask_token_id=MASK_ID, **SMALL)),
    "dflash": lambda host: DSparkDrafter(host, dflash_config(**SMALL)),
    "dflash-frozen-mask": lambda host: DSparkDrafter(host, dflash_config(mask_token_id=MASK_ID, **SMALL)),
    "eagle3": lambda host: Eagle3Drafter(host, Eagle3Config(feature_layers=(1, 2, 3))),
    "eagle3-five": lambda host: Eagle3Drafter(host, Eagle3Config(feature_layers=(0, 1, 2, 3, 4))),
}


@pytest.fixture(scope="module")
def qwen3_host() -> Host:
    return Host(tiny_model("qwen3", vocab=VOCAB, hidden=HIDDEN, layers=LAYERS), name="tiny-qwen3")


def randomized(drafter):
    """`drafter` with every parameter random (norm weights too, so a misplaced norm cannot hide)."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 1.0)
    return drafter


def make(name: str, host, seed: int = 0):
    torch.manual_seed(seed)
    return randomized(VARIANTS[name](host))


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
                    cfg.num_layers, cfg.block_size, MASK_ID, rank, cfg.confidence, cfg.max_anchors)
        assert config["layer_types"] == ["full_attention"] * cfg.num_layers
        head_type = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}.get(cfg.head)
        assert config.get("markov_head_type") == head_type
        assert config.get("confidence_head_with_markov") == (rank > 0 if cfg.confidence else None)
        spec = dspark_spec(layers=cfg.num_layers, taps=len(cfg.feature_layers), rank=rank, head_type=head_type,
                           confidence=cfg.confidence, with_markov=rank > 0, **dims)
        # the mask slot is the embedding of mask_token_id: our learned vector, or the target's own row when the
        # drafter was trained with the host's frozen mask row; every other row is the target's
        mask = qwen3_host.embed_tokens.weight[MASK_ID] if cfg.mask_token_id is not None else drafter.mask_embedding
        assert torch.equal(tensors["embed_tokens.weight"][MASK_ID], mask.detach())
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


def without_our_extras(directory) -> None:
    """Make an export look like a checkpoint the reference wrote: no "dspark" key."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    del config["dspark"]
    path.write_text(json.dumps(config))


def test_reference_trained_checkpoint_loads_with_the_frozen_mask_row_and_variant_defaults(qwen3_host, tmp_path):
    """The reference embeds the mask slots with its frozen copy of the target's row mask_token_id: imported with
    mask_token_id set (no learned vector), the loss settings at the variant's defaults."""
    drafter = make("dflash-frozen-mask", qwen3_host)
    drafter.config.ce_weight = 0.5  # a training-only setting the reference's config cannot carry
    export_deepspec(drafter, qwen3_host, tmp_path / "ds")
    without_our_extras(tmp_path / "ds")
    back = load_drafter(tmp_path / "ds", qwen3_host)
    assert back.config.head == "none" and back.config.ce_weight == dflash_config().ce_weight
    assert back.config.mask_token_id == MASK_ID and "mask_embedding" not in back.state_dict()
    for a, b in zip(draft_logits(drafter, qwen3_host), draft_logits(back, qwen3_host), strict=True):
        assert torch.equal(a, b)
    # a DeepSpec-format checkpoint whose mask row is not the target's (not the reference's frozen row) is refused
    export_deepspec(make("dflash", qwen3_host), qwen3_host, tmp_path / "learned", mask_token_id=MASK_ID)
    without_our_extras(tmp_path / "learned")
    with pytest.raises(CheckpointError, match=f"mask embedding \\(row {MASK_ID}"):
        load_drafter(tmp_path / "learned", qwen3_host)


def test_frozen_mask_row_is_the_hosts_embedding_and_stays_lossless(qwen3_host):
    from dspark.engine.decode import generate

    drafter = make("dspark-frozen-mask", qwen3_host)
    assert "mask_embedding" not in dict(drafter.named_parameters())
    block = drafter._block_input(torch.tensor([5, 9]))  # (2, block_size, H)
    assert torch.equal(block[:, 1:], qwen3_host.embed_tokens.weight[MASK_ID].expand(2, SMALL["block_size"] - 1, HIDDEN))
    prompts = [[3, 17, 99, 4, 50, 7], [42, 42, 8]]
    speculative = generate(qwen3_host, prompts, drafter=drafter, draft_length=4, max_new_tokens=10)
    assert speculative.token_ids == generate(qwen3_host, prompts, drafter=None, max_new_tokens=10).token_ids
    with pytest.raises(ValueError, match="trained with mask_token_id"):
        export_deepspec(drafter, qwen3_host, "unused", mask_token_id=3)
    with pytest.raises(ValueError, match="outside the host's vocabulary"):
        DSparkDrafter(qwen3_host, DSparkConfig(mask_token_id=VOCAB, **SMALL))


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
    reduced = Eagle3Drafter(qwen3_host, Eagle3Config(draft_vocab=qwen3_host.vocab_size // 2))
    with pytest.raises(ValueError, match="draft vocabulary"):  # the reference's EAGLE-3 has the whole vocabulary
        export_deepspec(reduced, qwen3_host, tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")


# ---- the CLI and the engine tables ----------------------------------------------------------------------------------

def test_cli_export_then_generate_with_the_export(tmp_path, capsys):
    """`dspark export` reads the host the checkpoint records; the export drops into generate with the same drafts,
    and the drafter's STS calibration travels with it (ours and SGLang's file)."""
    from dspark.api import generate, load_host
    from dspark.cli import main
    from verifiers.calibration import STSCalibrator

    host = load_host("random:tiny-qwen3", device="cpu")
    torch.manual_seed(0)
    drafter = randomized(DSparkDrafter(host, DSparkConfig(head="markov", num_layers=2, rank=16, block_size=4,
                                                          feature_layers=(0, 1, 2))))
    drafter.save_pretrained(tmp_path / "ours")
    calibration = STSCalibrator(temperatures=[1.5, 2.0, 0.5, 1.0], fit_size=[40, 30, 20, 10])
    calibration.save(tmp_path / "ours" / "calibration.json")
    rc = main(["export", "--drafter-path", str(tmp_path / "ours"), "--format", "deepspec",
               "--output", str(tmp_path / "ds"), "--mask-token-id", str(host.vocab_size - 1)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    sts = json.loads((tmp_path / "ds" / "sglang_sts.json").read_text())
    assert sts["temperatures"] == [1.5, 2.0, 0.5, 1.0] and sts["num_samples"] == 40
    prompts = [[3, 17, 99, 4, 250, 7, 3, 17], [42, 42, 8]]
    runs = [generate(host, prompts=prompts, drafter_path=path, draft_length=4, max_new_tokens=12,
                     verifier="threshold", threshold=0.3)
            for path in (tmp_path / "ours", tmp_path / "ds")]
    plain = generate(host, prompts=prompts, max_new_tokens=12)
    assert runs[0].token_ids == runs[1].token_ids == plain.token_ids
    for column in ("verified", "accepted"):  # the same drafts, confidences and calibration, round by round
        assert torch.equal(runs[0].result.log.column(column), runs[1].result.log.column(column))


def test_sglang_tables(tmp_path, capsys):
    from dspark.cli import main
    from verifiers.calibration import STSCalibrator
    from verifiers.cost_model import CostModel
    from verifiers.engine_tables import sglang_sps_table, sglang_sts_calibration

    cost = CostModel(tokens=[1, 4, 16], sps=[100.0, 90.0, 40.0])
    assert sglang_sps_table(cost) == {"sample_batch_tokens": [1, 4, 16], "sample_steps_per_sec": [100.0, 90.0, 40.0],
                                      "max_batch_tokens": 16}
    assert sglang_sts_calibration(STSCalibrator(temperatures=[2.0, 1.0]), dataset="x") == {
        "temperatures": [2.0, 1.0], "dataset": "x", "num_samples": 0}
    rc = main(["profile", "--host", "random:tiny-llama", "--device", "cpu", "--out", str(tmp_path / "cost.json"),
               "--batch-sizes", "1", "2", "--tokens-per-request", "1", "2", "--repeats", "1", "--warmup", "0",
               "--sglang-sps-table", str(tmp_path / "sps.json")])
    assert rc == 0, capsys.readouterr().err
    ours = json.loads((tmp_path / "cost.json").read_text())
    table = json.loads((tmp_path / "sps.json").read_text())
    assert table == {"sample_batch_tokens": ours["tokens"], "sample_steps_per_sec": ours["sps"],
                     "max_batch_tokens": ours["tokens"][-1]}


# ---- the reference's own classes (opt-in: DEEPSPEC_SRC = a checkout of deepseek-ai/DeepSpec) -----------------------

@pytest.mark.skipif(not os.environ.get("DEEPSPEC_SRC"), reason="set DEEPSPEC_SRC to a deepseek-ai/DeepSpec checkout")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_reference_classes_reproduce_our_draft_logits(name, qwen3_host, tmp_path, monkeypatch):
    """The reference's Qwen3DSparkModel / Qwen3Eagle3Model, loaded from our export, give our draft logits on its own
    decode path (context features from transformers' hidden_states, a DynamicCache, the block or the steps)."""
    monkeypatch.syspath_prepend(os.environ["DEEPSPEC_SRC"])
    from transformers import DynamicCache

    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model

    drafter = make(name, qwen3_host)
    export_deepspec(drafter, qwen3_host, tmp_path / "ds", mask_token_id=MASK_ID)
    eagle = name.startswith("eagle3")
    ref = (Qwen3Eagle3Model if eagle else Qwen3DSparkModel).from_pretrained(
        tmp_path / "ds", attn_implementation="sdpa", dtype=torch.float32).eval()
    prompt = torch.randint(0, MASK_ID, (1, 10), generator=torch.Generator().manual_seed(2))  # anchor at 9
    C, K = 9, 4
    with torch.no_grad():
        hidden = qwen3_host.model(input_ids=prompt[:, :C], output_hidden_states=True).hidden_states
        context = extract_context_feature(hidden, ref.target_layer_ids)  # (1, C, F)
        cache = DynamicCache()
        if eagle:
            h = ref.extend_draft_cache(hidden_states=context, input_ids=prompt[:, 1:], past_key_values=cache,
                                       position_ids=torch.arange(C)[None])
            logits, tokens = [], []
            for k in range(K):
                logits.append(ref.compute_logits(h)[:, -1])
                tokens.append(logits[-1].argmax(-1, keepdim=True))
                h = ref(hidden_states=h, input_ids=tokens[-1], position_ids=torch.tensor([[C + k]]),
                        past_key_values=cache, use_cache=True)
            ref_logits, tokens, ref_conf = torch.stack(logits, 1)[0], torch.cat(tokens, 1), None
        else:
            block = torch.full((1, K), MASK_ID)
            block[0, 0] = prompt[0, C]
            h = ref._forward_backbone(target_hidden_states=context, noise_embedding=ref.embed_tokens(block),
                                      position_ids=torch.arange(C + K)[None], attention_mask=None,
                                      past_key_values=cache, use_cache=True, is_causal=False)
            tokens, ref_logits = ref.sample_draft_tokens(ref.compute_logits(h), first_prev_token_ids=block[:, 0],
                                                         temperature=0.0, hidden_states=h)
            ref_logits = ref_logits[0]
            ref_conf = ref.predict_confidence_step(h, prev_token_ids=torch.cat([block[:, :1], tokens[:, :-1]], 1))
        # ours, teacher-forced on the reference's greedy drafts
        ids = torch.cat([prompt, tokens], 1)
        docs = torch.zeros_like(ids)
        features = qwen3_host.forward(ids, document_ids=docs, taps=drafter.feature_layers).features
        if eagle:
            ours = torch.stack([step[0, C - 1] for step in drafter.ttt_logits(ids, features, docs)][:K])
            conf = None
        else:
            out = drafter.block_logits(input_ids=ids, features=features, document_ids=docs,
                                       anchors=torch.tensor([[C]]))
            ours, conf = out.q_logits[0, 0], out.conf_logits
    torch.testing.assert_close(ours, ref_logits, rtol=1e-4, atol=1e-4)
    assert (conf is None) == (ref_conf is None)
    if conf is not None:
        torch.testing.assert_close(conf[0, 0], ref_conf[0], rtol=1e-4, atol=1e-4)
