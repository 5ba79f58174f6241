"""DeepSpec-format checkpoints: export our DSpark / DFlash / EAGLE-3 drafters in the layout of the DSpark paper's
reference implementation (deepseek-ai/DeepSpec), and read its checkpoints as ours. docs/DEEPSPEC.md has the
layout, the reference files it was read from, and where behaviour differs.

A DeepSpec checkpoint directory is what transformers' `save_pretrained` writes for the reference's draft model:
config.json (a copy of the target's config plus the drafter's fields, `architectures` naming the class) and
safetensors weights, including a copy of the target's token embedding and LM head. Detection is by config.json:
an "architectures" entry ending in "DSparkModel" or "Eagle3Model" and no "format_version" (ours has one).

Export (`export_deepspec`): parameter names are renamed (RENAMES below), the fc columns are reordered so the
tapped layers appear in increasing order (the reference requires strictly increasing `target_layer_ids`), and the
host's embedding and LM head are written next to them. Our learned mask-slot embedding becomes the embedding row of
`mask_token_id` (the reference embeds the mask token with its embedding table).
A drafter whose config has `mask_token_id` (the mask slots are the host's frozen embedding of that token, as in the
reference) is written with the host's embedding unchanged.
Import (`checkpoint_config` + `our_tensors`, called by drafters.checkpoint): the same renames backwards. A checkpoint
the reference wrote (no "dspark" key) gets `mask_token_id` (its frozen row must be the host's); our export of a
learned mask reads the vector back from row `mask_token_id`. The embedding and LM head copies are checked against
the host's (a drafter here borrows the host's own, so a checkpoint made for another host is refused).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from drafters.checkpoint import (CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, FOREIGN_LAYOUTS, FORMAT_VERSION,
                                 CheckpointError, ForeignLayout, _write_weights)

#: our head name -> the reference's `markov_head_type` (head "none" = `markov_rank` 0)
MARKOV_HEAD_TYPES = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
#: host model_type -> class-name prefix. Qwen3 is the reference's own; the others follow the same layout under the
#: same naming rule (the reference has no Llama-family class; docs/DEEPSPEC.md)
FAMILY = {"qwen3": "Qwen3", "llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
SUFFIX = {"dspark": "DSparkModel", "eagle3": "Eagle3Model"}
#: the frozen target pieces the reference keeps in its checkpoints
EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
#: our parameter name -> the reference's, first matching pattern wins
RENAMES = {
    "dspark": [
        (r"^backbone\.layers\.(\d+)\.((?:q|k|v|o)_proj|q_norm|k_norm)\.", r"layers.\1.self_attn.\2."),
        (r"^backbone\.", ""),  # layers.{i}.{input,post_attention}_layernorm / mlp.*, and the final norm
        (r"^context_norm\.", "hidden_norm."),
        (r"^W1\.", "markov_head.markov_w1."),
        (r"^W2\.", "markov_head.markov_w2."),
        (r"^gate\.", "markov_head.gate_proj."),
        (r"^rnn\.", "markov_head.joint_proj."),
        (r"^confidence_head\.", "confidence_head.proj."),
    ],
    "eagle3": [
        (r"^layer\.((?:q|k|v|o)_proj|q_norm|k_norm)\.", r"layers.0.self_attn.\1."),
        (r"^layer\.embed_norm\.", "layers.0.input_layernorm."),
        (r"^layer\.", "layers.0."),  # hidden_norm, post_attention_layernorm, mlp.*
    ],
}
#: our DSpark config fields the reference's config.json has no place for (training-loss settings, and whether the
#: mask embedding is learned: mask_token_id None); export keeps them under the extra key "dspark" so that
#: export -> import gives back the same config
TRAINING_ONLY = {"dspark": ("decay", "ce_weight", "tv_weight", "conf_weight", "rank", "mask_token_id"), "eagle3": ()}


def reference_name(kind: str, ours: str) -> str:
    """The reference's parameter name for our parameter `ours` of a `kind` drafter ("dspark" or "eagle3")."""
    for pattern, replacement in RENAMES[kind]:
        if re.match(pattern, ours):
            return re.sub(pattern, replacement, ours)
    return ours  # fc.weight, norm.weight (EAGLE-3) keep their names


def is_deepspec(config: dict) -> bool:
    """Whether a parsed config.json is a DeepSpec checkpoint's (not one of ours)."""
    names = config.get("architectures") or []
    return "format_version" not in config and any(str(n).endswith(tuple(SUFFIX.values())) for n in names)


def _kind(config: dict) -> str:
    name = next(str(n) for n in config["architectures"] if str(n).endswith(tuple(SUFFIX.values())))
    return "dspark" if name.endswith(SUFFIX["dspark"]) else "eagle3"


def _require(config: dict, keys, *, source: str) -> None:
    missing = [k for k in keys if k not in config]
    if missing:
        raise CheckpointError(f"{source}: DeepSpec config.json lacks {missing}")


def checkpoint_config(raw: dict, *, source: str) -> dict:
    """A DeepSpec config.json as our checkpoint config ({"format_version", "kind", "config", "host"}), with the raw
    config kept under "deepspec" for `our_tensors`."""
    kind = _kind(raw)
    _require(raw, ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_target_layers",
                   "target_layer_ids"), source=source)
    taps = [int(i) for i in raw["target_layer_ids"]]
    if any(i < 0 for i in taps):
        raise CheckpointError(f"{source}: target_layer_ids {taps} tap the embedding output (-1), which dspark's host "
                              "adapter does not capture; only decoder-layer outputs are supported")
    if taps != sorted(set(taps)):
        raise CheckpointError(f"{source}: target_layer_ids {taps} must be strictly increasing")
    if int(raw["num_target_layers"]) - 1 in taps:
        raise CheckpointError(f"{source}: target_layer_ids {taps} tap the target's last layer, whose hidden state "
                              "the reference reads after the final norm (transformers' last hidden_states entry) and "
                              "dspark reads before it; not supported (the reference's evaluator refuses it too)")
    extra = (raw.get("dspark") or {}).get("config", {})
    host = {"host_vocab_size": int(raw["vocab_size"]), "host_hidden_size": int(raw["hidden_size"]),
            "host_num_layers": int(raw["num_target_layers"]), "host_model_type": raw["model_type"],
            "host_name": extra.get("host_name") or raw.get("target_model_name_or_path")}
    if kind == "dspark":
        _require(raw, ("block_size", "mask_token_id", "markov_rank", "enable_confidence_head"), source=source)
        rank = int(raw["markov_rank"])
        head = "none" if rank == 0 else None
        if rank > 0:
            _require(raw, ("markov_head_type",), source=source)
            by_type = {v: k for k, v in MARKOV_HEAD_TYPES.items()}
            head = by_type.get(str(raw["markov_head_type"]).lower())
            if head is None:
                raise CheckpointError(f"{source}: unknown markov_head_type {raw['markov_head_type']!r}; known: "
                                      f"{sorted(by_type)}")
        confidence = bool(raw["enable_confidence_head"])
        if confidence and head != "none" and not raw.get("confidence_head_with_markov", False):
            raise CheckpointError(f"{source}: a confidence head that ignores the Markov embedding next to a Markov "
                                  "head (confidence_head_with_markov false) has no dspark equivalent: dspark's "
                                  "confidence head reads [h_k, W1[x_(k-1)]] whenever there is a head")
        # training-only settings: ours when we exported it, else the defaults of the variant (DFlash: L = L_ce)
        from drafters.dspark import DSparkConfig, dflash_config

        defaults = dataclasses.asdict(dflash_config() if head == "none" else DSparkConfig())
        config = {k: extra.get(k, defaults[k]) for k in TRAINING_ONLY["dspark"]}
        # the reference embeds the mask slots with its frozen copy of the target's row mask_token_id
        config["mask_token_id"] = extra.get("mask_token_id") if "dspark" in raw else int(raw["mask_token_id"])
        config.update(feature_layers=taps, num_layers=int(raw["num_hidden_layers"]), block_size=int(raw["block_size"]),
                      head=head, confidence=confidence,
                      max_anchors=int(raw.get("num_anchors", defaults["max_anchors"])))
        if rank > 0:
            config["rank"] = rank
    else:
        _require(raw, ("ttt_length",), source=source)
        layers = int(raw.get("draft_num_hidden_layers", raw["num_hidden_layers"]))
        if layers != 1:
            raise CheckpointError(f"{source}: an EAGLE-3 drafter of {layers} layers; dspark's EAGLE-3 has one")
        config = {"feature_layers": taps, "ttt_length": int(raw["ttt_length"]),
                  "step_decay": float(raw.get("step_loss_decay", 0.8))}
    config.update(host)
    fingerprint = {"vocab_size": host["host_vocab_size"], "hidden_size": host["host_hidden_size"],
                   "num_layers": host["host_num_layers"], "model_type": host["host_model_type"],
                   "feature_layers": taps, "name": host["host_name"]}
    return {"format_version": FORMAT_VERSION, "kind": kind, "config": config, "host": fingerprint, "deepspec": raw}


def _check_copy(name: str, saved: torch.Tensor, host_weight: torch.Tensor, *, source: str,
                skip_row: int | None = None) -> None:
    """Refuse a checkpoint whose frozen copy `name` is not the host's (up to bf16 rounding)."""
    want = host_weight.detach().to("cpu", torch.float32)
    have = saved.to(torch.float32)
    if have.shape != want.shape:
        raise CheckpointError(f"{source}: {name} has shape {tuple(have.shape)}, the host's {tuple(want.shape)}")
    if skip_row is not None:
        keep = torch.ones(have.shape[0], dtype=torch.bool)
        keep[skip_row] = False
        have, want = have[keep], want[keep]
    # why relative: a bf16 checkpoint of the same weights differs by rounding (< 2^-8 relative) only
    error = float((have - want).abs().max()) if have.numel() else 0.0
    if error > 1e-2 * max(float(want.abs().max()), 1e-6):
        raise CheckpointError(f"{source}: its {name} is not the host's (max difference {error:.3g}); the drafter was "
                              "trained for another target model")


def our_tensors(drafter, tensors: dict[str, torch.Tensor], raw: dict, host, *, source: str) -> dict[str, torch.Tensor]:
    """The reference's state dict `tensors` renamed to `drafter`'s parameter names (raw: its config.json)."""
    kind = drafter.kind
    embed = tensors.pop(EMBED, None)
    lm_head = tensors.pop(LM_HEAD, None)
    if embed is None or lm_head is None:
        raise CheckpointError(f"{source}: a DeepSpec checkpoint holds {EMBED} and {LM_HEAD}; missing "
                              f"{[n for n, t in ((EMBED, embed), (LM_HEAD, lm_head)) if t is None]}")
    mask_id = int(raw["mask_token_id"]) if kind == "dspark" else None
    if mask_id is not None and not 0 <= mask_id < embed.shape[0]:
        raise CheckpointError(f"{source}: mask_token_id {mask_id} is outside the embedding ({embed.shape[0]} rows)")
    _check_copy(EMBED, embed, host.embed_tokens.weight, source=source, skip_row=mask_id)
    learned = "mask_embedding" in drafter.state_dict()
    if mask_id is not None and not learned:  # the mask slots are the host's row: the checkpoint's must be it
        _check_copy(f"mask embedding (row {mask_id} of {EMBED})", embed[mask_id:mask_id + 1],
                    host.embed_tokens.weight[mask_id:mask_id + 1], source=source)
    _check_copy(LM_HEAD, lm_head, host.lm_head.weight, source=source)
    out = {}
    for ours in drafter.state_dict():
        if ours == "mask_embedding":
            out[ours] = embed[mask_id].clone()
            continue
        theirs = reference_name(kind, ours)
        if theirs in tensors:
            out[ours] = tensors.pop(theirs)
    out.update(tensors)  # what is left is unexpected: from_pretrained names it
    return out


def _family(host) -> str:
    model_type = host.config.model_type
    if model_type not in FAMILY:
        raise ValueError(f"no DeepSpec-style class name for host model_type {model_type!r}; known: {sorted(FAMILY)}")
    return FAMILY[model_type]


def default_mask_token_id(host) -> int:
    """The first embedding row past the tokenizer's vocabulary (151669 for Qwen3, as the reference's configs use)."""
    tokenizer = host.tokenizer
    if tokenizer is None or len(tokenizer) >= host.vocab_size:
        raise ValueError(f"host '{host.name}' has no embedding row past its tokenizer's vocabulary to hold the mask "
                         "embedding; pass --mask-token-id (that token's row is replaced by the mask embedding, so "
                         "serving engines embed that token as the mask)")
    return len(tokenizer)


def deepspec_config(drafter, host, *, mask_token_id: int | None, dtype: torch.dtype) -> dict:
    """config.json of the DeepSpec export of `drafter`: the host's config plus the reference's drafter fields."""
    cfg = drafter.config
    taps = sorted(cfg.feature_layers)
    if host.num_layers - 1 in taps:
        raise ValueError(f"the drafter taps the host's last layer ({host.num_layers - 1}); the reference reads that "
                         "layer after the final norm and dspark before it, so the export would not draft the same")
    out = host.config.to_dict()
    out.pop("_name_or_path", None)
    kind = drafter.kind
    out.update(architectures=[_family(host) + SUFFIX[kind]], num_target_layers=host.num_layers,
               target_layer_ids=taps, tie_word_embeddings=False, attention_bias=False,
               dtype=str(dtype).removeprefix("torch."))
    if kind == "dspark":
        out.update(num_hidden_layers=cfg.num_layers, layer_types=["full_attention"] * cfg.num_layers,
                   block_size=cfg.block_size, mask_token_id=mask_token_id, num_anchors=cfg.max_anchors,
                   enable_confidence_head=cfg.confidence, markov_rank=0 if cfg.head == "none" else cfg.rank)
        if cfg.confidence:
            out["confidence_head_with_markov"] = cfg.head != "none"
        if cfg.head != "none":
            out["markov_head_type"] = MARKOV_HEAD_TYPES[cfg.head]
    else:
        out.update(num_hidden_layers=1, draft_num_hidden_layers=1, layer_types=["full_attention"],
                   ttt_length=cfg.ttt_length, step_loss_decay=cfg.step_decay,
                   target_model_name_or_path=cfg.host_name or host.name)
    out["dspark"] = {"kind": kind, "config": {k: getattr(cfg, k) for k in TRAINING_ONLY[kind]}
                     | {"host_name": cfg.host_name}}
    return out


def deepspec_state_dict(drafter, host, *, mask_token_id: int | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The reference's state dict of `drafter`: renamed parameters, fc columns in increasing tap order, and the
    host's embedding (mask row = our mask embedding) and LM head."""
    kind, taps = drafter.kind, list(drafter.config.feature_layers)
    out = {}
    for ours, t in drafter.state_dict().items():
        if ours == "mask_embedding":
            continue
        out[reference_name(kind, ours)] = t
    H = host.hidden_size
    blocks = out["fc.weight"].split(H, dim=1)  # one (H, H) block per tap, in our tap order
    out["fc.weight"] = torch.cat([blocks[taps.index(i)] for i in sorted(taps)], dim=1)
    embed = host.embed_tokens.weight.detach().clone()
    if kind == "dspark" and drafter.config.mask_token_id is None:  # the learned vector goes into its row
        if not 0 <= mask_token_id < embed.shape[0]:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the host's vocabulary "
                             f"(0..{embed.shape[0] - 1})")
        embed[mask_token_id] = drafter.mask_embedding.detach().to(embed.dtype)
    out[EMBED] = embed
    out[LM_HEAD] = host.lm_head.weight.detach()
    # why clone to CPU: safetensors refuses views and shared storage (a tied LM head shares the embedding's)
    return {k: v.detach().to("cpu", dtype, copy=True).contiguous() for k, v in out.items()}


def export_deepspec(drafter, host, directory: str | os.PathLike, *, mask_token_id: int | None = None,
                    dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `drafter` (DSpark, DFlash or EAGLE-3, built for `host`) as a DeepSpec checkpoint to `directory`
    (replaced atomically). mask_token_id: the embedding row that holds the mask embedding (DSpark/DFlash only;
    default `default_mask_token_id(host)`)."""
    if drafter.kind not in SUFFIX:
        raise ValueError(f"a '{drafter.kind}' drafter has no DeepSpec layout; exportable kinds: {sorted(SUFFIX)}")
    if getattr(drafter.config, "draft_vocab", 0):
        raise ValueError(f"an EAGLE-3 drafter with a draft vocabulary (draft_vocab={drafter.config.draft_vocab}) has "
                         "no DeepSpec layout: the reference's EAGLE-3 drafts over the host's whole vocabulary")
    own = drafter.config.mask_token_id if drafter.kind == "dspark" else None
    if own is not None:  # the drafter embeds the mask as the host's row of its own mask_token_id
        if mask_token_id not in (None, own):
            raise ValueError(f"the drafter was trained with mask_token_id={own}; --mask-token-id {mask_token_id} "
                             "would change its drafts")
        mask_token_id = own
    elif drafter.kind == "dspark" and mask_token_id is None:
        mask_token_id = default_mask_token_id(host)
    config = deepspec_config(drafter, host, mask_token_id=mask_token_id, dtype=dtype)
    tensors = deepspec_state_dict(drafter, host, mask_token_id=mask_token_id, dtype=dtype)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot export to {directory}: it exists and is not a directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = directory.parent / f".{directory.name}.tmp-{tag}", directory.parent / f".{directory.name}.old-{tag}"
    tmp.mkdir()
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        _write_weights(tensors, tmp, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists():
        os.rename(directory, old)  # why two renames: as save_pretrained, a crash never leaves half a checkpoint
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


# every `--drafter-path` reads the reference's checkpoints: read_config / from_pretrained look here
FOREIGN_LAYOUTS["deepspec"] = ForeignLayout(detect=is_deepspec, to_config=checkpoint_config, to_tensors=our_tensors)
