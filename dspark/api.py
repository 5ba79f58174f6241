"""The toolkit's Python entry points: `load_host`, `resolve_drafter`, `resolve_verifier` and a text-level
`generate`. The CLI, the transformers drop-in and the experiment runners all resolve names through here, so a
drafter or verifier is chosen the same way everywhere.

    import dspark
    host = dspark.load_host("smollm2")
    out = dspark.generate(host, "ngram", ["Write a haiku about caches."], max_new_tokens=64)
    print(out.texts[0], out.stats["tau"])
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dspark.engine.decode import GenerationResult
from dspark.engine.decode import generate as decode_generate
from dspark.engine.host import Host
from dspark.engine.sampling import SamplingConfig

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


def set_deterministic(enabled: bool = True) -> None:
    """Deterministic mode (docs/RELIABILITY.md): the same inputs, seeds, batch composition, device and software
    give bitwise-identical outputs, and an op without a deterministic kernel raises instead of varying.

    Sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless already set; cuBLAS reads it when CUDA starts, so call this
    before the host is loaded), torch.use_deterministic_algorithms, cudnn deterministic without autotuning, and
    turns TF32 off (fp32 matmuls and convolutions in full precision). `enabled=False` restores torch's defaults.
    Sampling noise needs none of this: it is counter-based (dspark.engine.sampling), never a stateful generator.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not enabled  # torch's default is True for convolutions
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default is False for matmuls
    torch.set_float32_matmul_precision("highest")


def tune_cpu_allocator() -> bool:
    """Keep freed tensor memory in the process instead of handing it back to the OS (glibc only; a no-op that
    returns False elsewhere or when DSPARK_MALLOC_TUNING=0).

    Why by hand: glibc serves every block over a few MiB with a fresh mmap and unmaps it on free, so each training
    step on a CPU re-faults hundreds of MB of logits and host distributions (benchmarks/cpu_allocator.py: the
    quickstart's training step 3.97 -> 3.15 s on 2 cores, peak RSS 2.6 -> 3.4 GiB, identical losses). PyTorch's
    CPU tuning guide prescribes jemalloc / tcmalloc through LD_PRELOAD, which must happen before the process
    starts; mallopt(3) reaches the same effect from inside it. Process-wide: the `dspark` commands and the test
    suite call it; library users opt in. Results are unchanged (allocation placement only)."""
    import ctypes
    import ctypes.util

    if os.environ.get("DSPARK_MALLOC_TUNING", "1") == "0" or not hasattr(os, "confstr"):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except (OSError, ValueError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    # no mmap for large blocks (they come from the heap and are reused), and never trim the heap top back
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def load_host(name_or_path: str = "smollm2", *, dtype: str | torch.dtype = "auto",
              device: str | torch.device = "auto") -> Host:
    """The host model `name_or_path` (see dspark.engine.models: "smollm2", a local directory, a cached hub id or
    "random:<shape>"), wrapped for the decode loop. `.model` is the transformers model, `.tokenizer` its
    tokenizer (None for random hosts)."""
    from dspark.engine.models import load_model_and_tokenizer

    device = resolve_device(device)
    model, tokenizer = load_model_and_tokenizer(name_or_path, dtype=resolve_dtype(dtype, device), device=device)
    return Host(model, tokenizer, name=name_or_path)


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """A drafter checkpoint directory: `path` itself when it holds config.json, else the newest `checkpoint-*`
    inside it (a `dspark train --output` directory), else `path` (loading then says what is missing)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    found = sorted(p for p in path.glob("checkpoint-*") if (p / "config.json").is_file())
    return found[-1] if found else path


def resolve_drafter(host: Host, drafter=None, *, drafter_path: str | os.PathLike | None = None, **overrides):
    """A drafter object from what a user typed: None / "none" (plain decoding: returns None), a Drafter
    object, a registered name (random weights unless `drafter_path` is given), or a checkpoint directory."""
    from drafters import DRAFTERS, Drafter, build_drafter, load_drafter

    if isinstance(drafter, Drafter):
        if drafter_path is not None:
            raise ValueError("pass either a drafter object or drafter_path, not both")
        return drafter
    if drafter in (None, "none"):
        if drafter_path is None:
            return None
        if drafter == "none":
            raise ValueError("--drafter none is plain decoding; it takes no --drafter-path")
        return load_drafter(checkpoint_dir(drafter_path), host)
    if not isinstance(drafter, (str, os.PathLike)):
        raise TypeError(f"drafter must be a Drafter, a registered name or a checkpoint directory, got "
                        f"{type(drafter).__name__}")
    if str(drafter) in DRAFTERS:
        checkpoint = None if drafter_path is None or str(drafter) == "small-lm" else checkpoint_dir(drafter_path)
        return build_drafter(str(drafter), host, checkpoint=checkpoint or drafter_path, **overrides)
    if Path(drafter).is_dir():
        if drafter_path is not None:
            raise ValueError(f"drafter {drafter!r} is already a checkpoint directory; drop drafter_path")
        return load_drafter(checkpoint_dir(drafter), host)
    raise ValueError(f"unknown drafter {str(drafter)!r}: not a registered name ({', '.join(sorted(DRAFTERS))}, "
                     "none) nor an existing checkpoint directory")


CALIBRATION_FILE = "calibration.json"  # STS temperatures saved next to a drafter checkpoint by `dspark calibrate`


def resolve_verifier(host: Host, verifier=None, *, draft_length: int = 7, drafter_path=None,
                     threshold: float | None = None, cost_table=None, calibration=None):
    """A verifier object from a name ("full", "threshold", "scheduler", "lagged") or an object. Calibration
    defaults to the drafter checkpoint's own calibration.json for the policies that read confidences."""
    from verifiers import Verifier, build_verifier

    if isinstance(verifier, Verifier):
        return verifier
    name = verifier or "full"
    if calibration is None and name != "full" and drafter_path is not None:
        saved = checkpoint_dir(drafter_path) / CALIBRATION_FILE
        calibration = saved if saved.is_file() else None
    return build_verifier(name, threshold=threshold, cost_table=cost_table, calibration=calibration,
                          expect_host=host.name, expect_device=host.device, positions=draft_length)


def encode_prompts(host: Host, prompts, *, chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt: a string (rendered with the chat template when the tokenizer has one and
    `chat`), a list of {"role", "content"} messages, or a list of token ids (taken as is)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            out.append(list(prompt))
            continue
        if host.tokenizer is None:
            raise ValueError(f"prompt {i} is text but host {host.name!r} has no tokenizer; pass token ids")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
        if chat and host.tokenizer.chat_template is not None:
            from dspark.engine.models import render_chat

            # the template holds the bos token; tokenising its text once matches dspark.training.data's training rows
            ids = host.tokenizer(render_chat(host.tokenizer, messages), add_special_tokens=False)["input_ids"]
        else:
            ids = host.tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
        out.append(list(ids))
    return out


@dataclass
class Generation:
    """Decoded text next to the token-level result (its `.log` feeds dspark.metrics)."""

    texts: list[str]
    result: GenerationResult

    @property
    def token_ids(self) -> list[list[int]]:
        return self.result.token_ids

    @property
    def stats(self) -> dict:
        return self.result.stats


def generate(host: Host, drafter=None, prompts: Sequence = (), *, verifier=None, draft_length: int = 7,
             max_new_tokens: int | Sequence[int] = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, batch_size: int | None = None, chat: bool = True, threshold: float | None = None,
             cost_table=None, calibration=None, drafter_path=None, stop_token_ids=None,
             progress: bool = False, concurrency: int | None = None) -> Generation:
    """Decode `prompts` with `host`, speculatively when `drafter` is given (object, name or directory); in static
    batches of `batch_size`, or continuously with `concurrency` requests in flight (dspark.engine)."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    ids = encode_prompts(host, prompts, chat=chat)
    if drafter_path is None and isinstance(drafter, (str, os.PathLike)) and Path(drafter).is_dir():
        drafter_path, drafter = drafter, None
    drafter = resolve_drafter(host, drafter, drafter_path=drafter_path)
    verifier = resolve_verifier(host, verifier, draft_length=draft_length, drafter_path=drafter_path,
                                threshold=threshold, cost_table=cost_table, calibration=calibration)
    result = decode_generate(host, ids, drafter=drafter, verifier=verifier, draft_length=draft_length,
                             max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, batch_size=batch_size,
                             concurrency=concurrency,
                             stop_token_ids=stop_token_ids, progress=progress)
    texts = ([host.tokenizer.decode(t, skip_special_tokens=True) for t in result.token_ids]
             if host.tokenizer is not None else [" ".join(map(str, t)) for t in result.token_ids])
    return Generation(texts=texts, result=result)
