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

from dspark.engine.results import GenerationResult
from dspark.engine.decode import generate as decode_generate
from dspark.engine.host import Host
from dspark.engine.models import load_host, resolve_device, resolve_dtype  # noqa: F401 (public API)
from dspark.engine.runtime import set_deterministic, tune_cpu_allocator  # noqa: F401 (public API)
from dspark.engine.sampling import SamplingConfig


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """A drafter checkpoint directory: `path` itself when it holds config.json, else the newest `checkpoint-*`
    inside it (a `dspark train --output` directory), else `path` (loading then says what is missing)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    found = sorted(p for p in path.glob("checkpoint-*") if (p / "config.json").is_file())
    return found[-1] if found else path


def drafter_directory(drafter) -> Path | None:
    """The checkpoint directory `drafter` names when it is one, else None. A registered name always means the
    registered drafter, even where a folder of that name exists (the repository's own `dspark/` package folder
    when run from its root): a checkpoint folder of such a name is passed as drafter_path (`--drafter-path`)."""
    from drafters import DRAFTERS

    if not isinstance(drafter, (str, os.PathLike)) or str(drafter) in DRAFTERS or drafter == "none":
        return None
    return Path(drafter) if Path(drafter).is_dir() else None


def resolve_drafter(host: Host, drafter=None, *, drafter_path: str | os.PathLike | None = None, dtype: str = "host",
                    **overrides):
    """A drafter object from what a user typed: None / "none" (plain decoding: returns None), a Drafter
    object, a registered name (random weights unless `drafter_path` is given), or a checkpoint directory (a
    registered name wins over a folder of the same name: see `drafter_directory`). A drafter built or loaded here
    decodes in the host's dtype (`drafters.for_inference`), or with dtype="float32" in its float32 master weights
    (the weights as trained, not rounded to the host's dtype); a Drafter object passed in is used as it is."""
    from drafters import Drafter, for_inference

    if dtype not in ("host", "float32"):
        raise ValueError(f"drafter dtype must be 'host' or 'float32', got {dtype!r}")
    if isinstance(drafter, Drafter):
        if drafter_path is not None:
            raise ValueError("pass either a drafter object or drafter_path, not both")
        return drafter
    built = _resolve_built(host, drafter, drafter_path, **overrides)
    return built if built is None or dtype == "float32" else for_inference(built, host)


def _resolve_built(host: Host, drafter, drafter_path, **overrides):
    """resolve_drafter's name / path cases: the drafter as built or loaded (float32 master weights), or None."""
    from drafters import DRAFTERS, build_drafter, load_drafter

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
    if drafter_directory(drafter) is not None:
        if drafter_path is not None:
            raise ValueError(f"drafter {drafter!r} is already a checkpoint directory; drop drafter_path")
        return load_drafter(checkpoint_dir(drafter), host)
    raise ValueError(f"unknown drafter {str(drafter)!r}: not a registered name ({', '.join(sorted(DRAFTERS))}, "
                     "none) nor an existing checkpoint directory")


CALIBRATION_FILE = "calibration.json"  # STS temperatures saved next to a drafter checkpoint by `dspark calibrate`


def saved_calibration(drafter_path) -> Path | None:
    """The STS calibration saved next to the drafter checkpoint at `drafter_path` (None: no path, or none saved)."""
    if drafter_path is None:
        return None
    saved = checkpoint_dir(drafter_path) / CALIBRATION_FILE
    return saved if saved.is_file() else None


def resolve_verifier(host: Host, verifier=None, *, draft_length: int = 7, drafter_path=None,
                     threshold: float | None = None, cost_table=None, calibration=None, draft_gate: bool = True):
    """A verifier object from a name ("full", "threshold", "scheduler", "lagged") or an object. Calibration
    defaults to the drafter checkpoint's own calibration.json for the policies that read confidences."""
    from verifiers import Verifier, build_verifier

    if isinstance(verifier, Verifier):
        return verifier
    name = verifier or "full"
    if calibration is None and name != "full":
        calibration = saved_calibration(drafter_path)
    return build_verifier(name, threshold=threshold, cost_table=cost_table, calibration=calibration,
                          expect_host=host.name, expect_device=host.device, positions=draft_length,
                          draft_gate=draft_gate)


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
             progress: bool = False, concurrency: int | None = None, draft_gate: bool = True,
             drafter_dtype: str = "host") -> Generation:
    """Decode `prompts` with `host`, speculatively when `drafter` is given (object, name or directory); in static
    batches of `batch_size`, or continuously with `concurrency` requests in flight (dspark.engine). drafter_dtype:
    see `resolve_drafter`'s dtype."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    ids = encode_prompts(host, prompts, chat=chat)
    if drafter_path is None and drafter_directory(drafter) is not None:
        drafter_path, drafter = drafter, None
    drafter = resolve_drafter(host, drafter, drafter_path=drafter_path, dtype=drafter_dtype)
    verifier = resolve_verifier(host, verifier, draft_length=draft_length, drafter_path=drafter_path,
                                threshold=threshold, cost_table=cost_table, calibration=calibration,
                                draft_gate=draft_gate)
    result = decode_generate(host, ids, drafter=drafter, verifier=verifier, draft_length=draft_length,
                             max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, batch_size=batch_size,
                             concurrency=concurrency,
                             stop_token_ids=stop_token_ids, progress=progress)
    texts = ([host.tokenizer.decode(t, skip_special_tokens=True) for t in result.token_ids]
             if host.tokenizer is not None else [" ".join(map(str, t)) for t in result.token_ids])
    return Generation(texts=texts, result=result)
