"""Shared fixtures: tiny randomly initialised hosts (seconds on a CPU), and the real SmolLM2 host for `slow` tests."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark.engine.runtime import tune_cpu_allocator
from dspark.engine.host import Host

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(min(2, torch.get_num_threads()))
tune_cpu_allocator()  # as the `dspark` commands do: large CPU tensors reuse freed memory instead of re-faulting it

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str | None = None):
    """A script of the repository that is no package module (benchmarks/) as a fresh module."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(kind: str = "llama", *, vocab: int = 128, hidden: int = 64, layers: int = 4, seed: int = 0):
    """A seeded random causal LM of the given family, fp32, eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    else:
        raise ValueError(kind)
    # why: random init gives near-uniform logits and argmax near-ties; a larger output scale makes the tiny host
    # peaked like a real LM so greedy comparisons are not decided by float noise
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        if kind == "qwen2":  # why: transformers initialises biases to zero; real Qwen2 q/k/v biases are not
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_host() -> Host:
    return Host(tiny_model("llama"), name="tiny-llama")


@pytest.fixture(scope="session")
def micro_host() -> Host:
    """A tiny-vocabulary host (V = 8) for statistical tests of the sampler."""
    model = tiny_model("llama", vocab=8, hidden=32, layers=2, seed=1)
    with torch.no_grad():
        model.lm_head.weight.div_(8.0)  # keep the distributions spread for chi-square tests
    return Host(model, name="micro")


@pytest.fixture(scope="session")
def smollm2_host() -> Host:
    import dspark

    return dspark.load_host("smollm2")


def with_draft_price(cost, drafter, K: int, seconds: float):
    """`cost` (a hand-made CostModel) completed with `drafter`'s propose step at K drafts, `seconds` at every batch
    size, as `dspark profile --drafter-path` would record it; without one the schedulers warn that they price the
    drafter's step as free."""
    from verifiers.cost_model import draft_key

    cost.draft[draft_key(drafter, K)] = {"batch_sizes": [1], "seconds": [seconds], "observe_seconds": [0.0]}
    return cost


def random_prompts(lengths, vocab: int, seed: int = 0, repeat: bool = True) -> list[list[int]]:
    """Prompts of the given lengths; repeated halves give the n-gram drafter something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        half = torch.randint(0, vocab, (max(1, n // 2),), generator=g).tolist()
        out.append((half + half)[:n] if repeat else torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, the setting restored after. why: a 64-wide host's matmuls are
    microseconds; on a shared machine two intra-op threads mostly wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
