"""dspark.training.regenerate: host responses to dataset prompts as JSONL, resumable without loss or duplicates.

The host is a tiny random Llama with a character-level ChatML tokenizer built here (`chat_tokenizer`), so the
real chat-template path runs in a second on the CPU; tests/test_train.py reuses it.
"""
from __future__ import annotations

import json
import string

import pytest
from conftest import tiny_model
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dspark.engine.host import Host
from dspark.training.regenerate import RegenerateConfig, completed_ids, main_regenerate, regenerate

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character plus <unk>, <|im_start|>, <|im_end|> (eos): 100 ids."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    return tokenizer


def chat_host(seed: int = 0) -> Host:
    """A tiny random host (V = 128) that has a chat tokenizer."""
    return Host(tiny_model("llama", vocab=128, seed=seed), chat_tokenizer(), name="tiny-chat")


def write_conversations(path, n: int, seed: int = 0) -> str:
    """n short chats with ids; some with a system turn, some multi-turn (only the first user turn is a prompt)."""
    words = ["alpha", "beta", "gamma", "delta", "code", "math", "why", "how", "list", "sort"]
    with open(path, "w") as fh:
        for i in range(n):
            question = " ".join(words[(i * 3 + j + seed) % len(words)] for j in range(2 + i % 4)) + "?"
            turns = [{"from": "human", "value": question}, {"from": "gpt", "value": f"answer {i}: " + question[::-1]}]
            if i % 3 == 0:
                turns = [{"from": "system", "value": "be brief"}] + turns
            if i % 2 == 0:
                turns += [{"from": "human", "value": "more"}, {"from": "gpt", "value": "no"}]
            fh.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def host() -> Host:
    return chat_host()


def config(tmp_path, source, name="out.jsonl", **overrides) -> RegenerateConfig:
    settings = dict(output=str(tmp_path / name), data=source, split="all", max_new_tokens=12, temperature=1.0,
                    top_k=20, batch_size=4, seed=3)
    return RegenerateConfig(**{**settings, **overrides})


def test_writes_one_record_per_prompt(tmp_path, host):
    source = write_conversations(tmp_path / "chats.jsonl", 6)
    path = regenerate(config(tmp_path, source), host=host)
    records = read_jsonl(path)
    assert [r["id"] for r in records] == [f"c{i}" for i in range(6)]
    for i, record in enumerate(records):
        turns = record["conversations"]
        roles = [t["role"] for t in turns]
        assert roles == (["system"] if i % 3 == 0 else []) + ["user", "assistant"]  # prompt = system + first user
        assert set(record) == {"id", "conversations"} and "<|im_end|>" not in turns[-1]["content"]
    # what it wrote is a training source again
    from dspark.training.data import load_conversations

    assert len(load_conversations(str(path), split="all")) >= 1


def test_resume_after_kill_drops_truncated_line_and_duplicates_nothing(tmp_path, host):
    source = write_conversations(tmp_path / "chats.jsonl", 7)
    full = read_jsonl(regenerate(config(tmp_path, source, "full.jsonl"), host=host))
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])  # killed mid-write of record 4
    assert completed_ids(partial) == {"c0", "c1", "c2"}
    assert partial.read_text() == "".join(lines[:3])  # the cut line is gone from the file
    resumed = read_jsonl(regenerate(config(tmp_path, source, "partial.jsonl"), host=host))
    assert [r["id"] for r in resumed] == [r["id"] for r in full]  # nothing lost, nothing twice
    # per-id seeds and batch-invariant sampling: the resumed responses are the uninterrupted ones
    assert resumed == full
    again = read_jsonl(regenerate(config(tmp_path, source, "partial.jsonl"), host=host))
    assert again == full  # a finished file is left as it is


def test_corrupt_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "conversations": []}\nnot json\n{"id": "b", "conversations": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        completed_ids(path)


def test_limit_greedy_and_long_prompts_skipped(tmp_path, host):
    source = write_conversations(tmp_path / "chats.jsonl", 6)
    path = regenerate(config(tmp_path, source, limit=4, temperature=0.0, max_prompt_length=40), host=host)
    ids = [r["id"] for r in read_jsonl(path)]
    assert 0 < len(ids) < 4  # the longer prompts (system turn + 4-5 words) exceed 40 characters


def test_cli_with_a_saved_host_directory(tmp_path, host):
    model_dir = tmp_path / "host"
    host.model.save_pretrained(model_dir)
    host.tokenizer.save_pretrained(model_dir)
    source = write_conversations(tmp_path / "chats.jsonl", 3)
    out = tmp_path / "cli.jsonl"
    (tmp_path / "regen.yaml").write_text(f"data: {source}\nsplit: all\nmax_new_tokens: 5\ndevice: cpu\n")
    main_regenerate(["--config", str(tmp_path / "regen.yaml"), "--host", str(model_dir), "--output", str(out),
                     "--temperature", "0"])
    assert [r["id"] for r in read_jsonl(out)] == ["c0", "c1", "c2"]
