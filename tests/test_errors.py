"""Bad input gives a clear error naming the bad value and what is valid, and leaves no partial output behind;
NaN/Inf logits are reported with round and request, never accepted; only safetensors + JSON are ever loaded.

Errors already asserted elsewhere are listed in docs/RELIABILITY.md rather than repeated here.
"""
from __future__ import annotations

import ast
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, tiny_model, with_draft_price

from drafters import CheckpointError, build_drafter, load_drafter
import dspark
from dspark.cli import main
from dspark.engine.decode import generate
from dspark.engine.host import Host
from dspark.engine.protocol import Drafter, Proposal
from dspark.engine.sampling import SamplingConfig
from verifiers.calibration import STSCalibrator
from verifiers.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[1]


# ---- decode inputs -----------------------------------------------------------------------------------------------
def test_empty_prompt_and_no_prompts(tiny_host):
    with pytest.raises(ValueError, match="prompt 1 is empty: every prompt needs at least one token"):
        generate(tiny_host, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts given"):
        generate(tiny_host, [], max_new_tokens=2)


def test_token_ids_outside_the_vocabulary(tiny_host):
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside the host vocabulary \[0, 128\)"):
        generate(tiny_host, [[1, 128]], max_new_tokens=2)


def test_prompt_longer_than_the_context(tiny_host):
    with pytest.raises(ValueError, match="prompt 0 has 600 tokens; with max_new_tokens=1 it needs 601 positions, "
                                         "beyond the host's context of 512"):
        generate(tiny_host, [[1] * 600], max_new_tokens=1)


def test_max_new_tokens_beyond_the_context(tiny_host):
    with pytest.raises(ValueError, match="prompt 1 has 10 tokens; with max_new_tokens=503 it needs 513 positions, "
                                         "beyond the host's context of 512"):
        generate(tiny_host, [[1] * 4, [1] * 10], max_new_tokens=[4, 503])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_new_tokens_must_be_a_positive_integer(tiny_host, bad):
    with pytest.raises(ValueError, match=re.escape(f"max_new_tokens must be an integer >= 1, got {bad!r}")):
        generate(tiny_host, [[1, 2]], max_new_tokens=bad)


def test_per_request_lists_must_match_the_prompts(tiny_host):
    with pytest.raises(ValueError, match="max_new_tokens has 3 entries for 2 prompts"):
        generate(tiny_host, [[1], [2]], max_new_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="seeds has 1 entries for 2 prompts"):
        generate(tiny_host, [[1], [2]], max_new_tokens=2, seeds=[0])
    with pytest.raises(ValueError, match="batch_size must be >= 1, got -1"):
        generate(tiny_host, [[1], [2]], max_new_tokens=2, batch_size=-1)


@pytest.mark.parametrize("gamma", [0, -1, 2.5])
def test_gamma_must_be_a_positive_integer(tiny_host, gamma):
    with pytest.raises(ValueError, match=re.escape(f"draft_length (gamma) must be an integer >= 1, got {gamma!r}")):
        dspark.generate(tiny_host, "ngram", [[1, 2, 1, 2]], draft_length=gamma, max_new_tokens=2)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.01}, "top_p must be in (0, 1], got 1.01"),
])
def test_bad_sampling_settings_through_the_api(tiny_host, kwargs, message):
    """(SamplingConfig itself: tests/test_sampling.py::test_invalid_sampling_parameters.)"""
    with pytest.raises(ValueError, match=re.escape(message)):
        dspark.generate(tiny_host, "ngram", [[1, 2, 1, 2]], max_new_tokens=2, **kwargs)


# ---- drafter / host mismatch ---------------------------------------------------------------------------------------
class _Taps(Drafter):
    feature_layers = (1, 9)

    def propose(self, state, K):
        return Proposal(tokens=state.seq.new_zeros(state.seq.shape[0], K))


def test_drafter_feature_layers_the_host_lacks(tiny_host):
    with pytest.raises(ValueError, match=r"feature layers \[9\] do not exist in host 'tiny-llama' \(4 layers, "
                                         r"valid 0..3\)"):
        generate(tiny_host, [[1, 2]], drafter=_Taps(), max_new_tokens=2)


@pytest.fixture(scope="module")
def saved_mtp(tiny_host, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "mtp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_drafter("mtp", tiny_host).save_pretrained(path)
    return path


def test_checkpoint_for_a_host_of_another_shape(saved_mtp):
    """(vocab / hidden / layers for dspark: tests/test_drafters_dspark.py::test_checkpoint_refuses_another_host.)"""
    other = Host(tiny_model("llama", vocab=96), name="other")
    with pytest.raises(CheckpointError, match="was made for a host with vocab_size=128, but host 'other' has "
                                              "vocab_size=96"):
        load_drafter(saved_mtp, other)


def test_small_lm_with_another_tokenizer_of_the_same_size(tmp_path):
    from test_regenerate import chat_host, chat_tokenizer

    host = chat_host()
    other = chat_tokenizer()
    vocab = other.get_vocab()
    a, b = vocab["a"], vocab["b"]
    swapped = {**vocab, "a": b, "b": a}  # same size, two ids exchanged
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(swapped, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tiny_model("llama", vocab=128, layers=1).save_pretrained(tmp_path / "small")
    tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"small-LM drafter tokenizer at .*small differs from host 'tiny-chat''s: 2 "
                                         r"token\(s\) map to other ids .*must share the host's tokenizer"):
        build_drafter("small-lm", host, checkpoint=tmp_path / "small")
    host.tokenizer.save_pretrained(tmp_path / "small")  # the host's own tokenizer loads
    assert build_drafter("small-lm", host, checkpoint=tmp_path / "small") is not None


# ---- checkpoint files ----------------------------------------------------------------------------------------------
def _copy(src, tmp_path, name):
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def test_corrupt_checkpoint_config(saved_mtp, tiny_host, tmp_path):
    """(missing config / weights, truncated safetensors, wrong tensors: tests/test_drafters_dspark.py::
    test_checkpoint_refuses_bad_files.)"""
    bad = _copy(saved_mtp, tmp_path, "bad-json")
    (bad / "config.json").write_text('{"format_version": 1, "kind": ')
    with pytest.raises(CheckpointError, match=r"cannot parse .*bad-json/config.json"):
        load_drafter(bad, tiny_host)
    bad = _copy(saved_mtp, tmp_path, "no-keys")
    (bad / "config.json").write_text('{"kind": "mtp"}')
    with pytest.raises(CheckpointError, match=r"is not a drafter config: missing keys \['format_version', "
                                              r"'config', 'host'\]"):
        load_drafter(bad, tiny_host)
    bad = _copy(saved_mtp, tmp_path, "version")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(CheckpointError, match="has format_version 99; this version reads 1"):
        load_drafter(bad, tiny_host)
    bad = _copy(saved_mtp, tmp_path, "unknown-key")
    (bad / "config.json").write_text(json.dumps({**config, "config": {**config["config"], "depth": 3}}))
    with pytest.raises(CheckpointError, match=r"unknown MTPConfig keys \['depth'\]"):
        load_drafter(bad, tiny_host)


def test_sharded_checkpoint_with_a_missing_or_garbled_shard(tiny_host, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_drafter("mtp", tiny_host).save_pretrained(tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    bad = _copy(tmp_path / "sharded", tmp_path, "missing")
    (bad / shards[1].name).unlink()
    with pytest.raises(CheckpointError, match=f"weight shard .*{shards[1].name} listed in "
                                              "model.safetensors.index.json is missing"):
        load_drafter(bad, tiny_host)
    bad = _copy(tmp_path / "sharded", tmp_path, "garbled")
    (bad / shards[0].name).write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated safetensors file"):
        load_drafter(bad, tiny_host)
    bad = _copy(tmp_path / "sharded", tmp_path, "index")
    (bad / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse .*model.safetensors.index.json"):
        load_drafter(bad, tiny_host)


# ---- safe loading --------------------------------------------------------------------------------------------------
def _package_sources() -> list[Path]:
    files = [p for d in ("dspark", "drafters", "verifiers", "experiments") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    return files


def test_sources_never_unpickle_nor_trust_remote_code():
    """AST scan of the package: no pickle-family imports, no torch.load without weights_only=True, no torch.save,
    no numpy allow_pickle=True, no trust_remote_code=True."""
    problems = []
    for path in _package_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            problems += [f"{where}: imports {n}" for n in names if n in ("pickle", "cPickle", "dill", "joblib",
                                                                          "cloudpickle", "shelve", "marshal")]
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if func.endswith("torch.load") or func == "load" and "weights_only" in keywords:
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    problems.append(f"{where}: {func} without weights_only=True")
            if func.endswith("torch.save"):
                problems.append(f"{where}: torch.save writes a pickle")
            for key in ("trust_remote_code", "allow_pickle"):
                value = keywords.get(key)
                if value is not None and not (isinstance(value, ast.Constant) and value.value is False):
                    problems.append(f"{where}: {key}={ast.unparse(value)}")
    assert not problems, "\n".join(problems)


def _pickled_dir(path: Path, model=None) -> Path:
    path.mkdir()
    torch.save({"w": torch.zeros(2)} if model is None else model.state_dict(), path / "pytorch_model.bin")
    return path


def test_drafter_dir_with_only_pytorch_model_bin_is_refused(tiny_host, tmp_path):
    path = _pickled_dir(tmp_path / "pickled")
    message = (r"no drafter checkpoint at .*pickled: config.json is missing; it holds pytorch_model.bin: pickle "
               r"files, which dspark never loads")
    with pytest.raises(CheckpointError, match=message):
        load_drafter(path, tiny_host)
    with pytest.raises(CheckpointError, match=message):
        dspark.api.resolve_drafter(tiny_host, "dspark", drafter_path=path)
    # with a valid config.json beside it, the weights are still refused
    saved = tmp_path / "real"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_drafter("mtp", tiny_host).save_pretrained(saved)
    shutil.copy(saved / "config.json", path / "config.json")
    with pytest.raises(CheckpointError, match=r"no weights in .*expected model.safetensors or "
                                              r"model.safetensors.index.json; it holds pytorch_model.bin: pickle"):
        load_drafter(path, tiny_host)


def test_host_and_small_lm_dirs_with_only_pickled_weights_are_refused(tiny_host, tmp_path):
    model = tiny_model("llama", layers=1)
    path = _pickled_dir(tmp_path / "hf", model)
    model.config.save_pretrained(path)
    message = r"no \*.safetensors weights in .*hf: it holds pytorch_model.bin, pickle files, which are never loaded"
    with pytest.raises(ValueError, match=message):
        dspark.load_host(str(path), device="cpu")
    with pytest.raises(ValueError, match=message):
        build_drafter("small-lm", tiny_host, checkpoint=path)


# ---- verifier files ------------------------------------------------------------------------------------------------
def test_cost_table_for_another_host_or_device(tiny_host, tmp_path):
    """(CostModel.load itself: tests/test_cost_model.py::test_load_mismatch_errors.)"""
    CostModel(tokens=[1, 64], sps=[100.0, 90.0], host="smollm2", device="cpu").save(tmp_path / "h.json")
    with pytest.raises(ValueError, match="was profiled for host 'smollm2', but the host in use is 'tiny-llama'"):
        dspark.api.resolve_verifier(tiny_host, "scheduler", cost_table=tmp_path / "h.json")
    CostModel(tokens=[1, 64], sps=[100.0, 90.0], host="tiny-llama", device="cuda (NVIDIA H200)").save(
        tmp_path / "d.json")
    with pytest.raises(ValueError, match=r"profiled on device 'cuda \(NVIDIA H200\)', but the device in use is 'cpu'"):
        dspark.api.resolve_verifier(tiny_host, "lagged", cost_table=tmp_path / "d.json")


def test_calibration_with_too_few_positions(tiny_host, tmp_path):
    """(STSCalibrator.load / apply: tests/test_calibration.py::test_save_load_and_position_errors.)"""
    STSCalibrator(temperatures=[1.0, 2.0, 3.0]).save(tmp_path / "sts.json")
    with pytest.raises(ValueError, match="was fitted for 3 draft positions, but 5 are in use: it has no temperatures "
                                         "for positions 4..5"):
        dspark.generate(tiny_host, "ngram", [[1, 2, 1, 2]], verifier="threshold", threshold=0.5,
                        calibration=tmp_path / "sts.json", draft_length=5, max_new_tokens=2)


def test_checkpoint_calibration_serves_the_sweeps_draft_lengths(tiny_host, tmp_path):
    """`dspark calibrate` fits at the default draft length and saves beside the drafter, where every confidence
    policy loads it automatically: the sweep's default gammas (all shorter) use its first gamma temperatures; a
    longer gamma is refused before decoding, naming the fix."""
    from dspark.cli import DecodeOptions, SweepOptions

    fitted_at = DecodeOptions.draft_length  # what `dspark calibrate` fits at by default
    STSCalibrator(temperatures=[1.0 + k / 10 for k in range(fitted_at)]).save(tmp_path / dspark.api.CALIBRATION_FILE)
    for gamma in SweepOptions().draft_lengths:
        verifier = dspark.api.resolve_verifier(tiny_host, "threshold", threshold=0.5, draft_length=gamma,
                                               drafter_path=tmp_path)
        assert verifier.calibrator.positions == fitted_at
        c = torch.full((2, gamma), 0.7)
        assert torch.allclose(verifier.calibrator.apply(c), STSCalibrator(
            temperatures=verifier.calibrator.temperatures[:gamma]).apply(c))
    with pytest.raises(ValueError, match=f"fitted for {fitted_at} draft positions, but {fitted_at + 2} are in use.*"
                                         f"dspark calibrate --draft-length {fitted_at + 2}"):
        dspark.api.resolve_verifier(tiny_host, "scheduler", cost_table=CostModel.flat(), draft_length=fitted_at + 2,
                                    drafter_path=tmp_path)


@pytest.mark.parametrize("load, what", [(CostModel.load, "cost table"), (STSCalibrator.load, "STS calibration")])
def test_missing_or_corrupt_verifier_file_names_the_file(load, what, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{what} file .*nope.json does not exist"):
        load(tmp_path / "nope.json")
    (tmp_path / "cut.json").write_text('{"format": "dspark.')  # a write cut short
    with pytest.raises(ValueError, match=f"{what} file .*cut.json is corrupt \\(not valid JSON"):
        load(tmp_path / "cut.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list.json is not a dspark\.\w+ version 1 file \(format='list'"):
        load(tmp_path / "list.json")


def test_verifier_files_are_replaced_atomically(tmp_path, monkeypatch):
    import dspark.engine.jsonio

    path = tmp_path / "sts.json"
    STSCalibrator(temperatures=[1.0, 2.0]).save(path)

    def killed(fd):
        raise OSError("killed mid-write")

    monkeypatch.setattr(dspark.engine.jsonio.os, "fsync", killed)
    with pytest.raises(OSError, match="killed mid-write"):
        STSCalibrator(temperatures=[3.0, 4.0, 5.0]).save(path)
    with pytest.raises(OSError, match="killed mid-write"):
        CostModel(tokens=[1, 64], sps=[100.0, 90.0], host="tiny", device="cpu").save(tmp_path / "cost.json")
    assert STSCalibrator.load(path).temperatures == [1.0, 2.0]  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sts.json"]  # no half-written or temporary files


# ---- data and config -----------------------------------------------------------------------------------------------
def _chats_with_a_bad_line(tmp_path) -> Path:
    from test_regenerate import write_conversations

    path = Path(write_conversations(tmp_path / "chats.jsonl", 3))
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"conversations": [{"from": "human", "value": 3}]}'] + lines[1:]) + "\n")
    return path


def test_malformed_dataset_line_is_skipped_or_fatal_by_flag(tmp_path, caplog):
    """(load_conversations itself: tests/test_data.py::test_malformed_line_reported_with_file_and_line.)"""
    from test_regenerate import chat_host

    from dspark.training.regenerate import RegenerateConfig, regenerate

    source = _chats_with_a_bad_line(tmp_path)
    host = chat_host()
    out = tmp_path / "out" / "fatal.jsonl"
    cfg = dict(data=str(source), split="all", max_new_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match=re.escape(f"{source}:2: turn content must be a string, got int")):
        regenerate(RegenerateConfig(output=str(out), on_error="raise", **cfg), host=host)
    assert not out.exists()  # nothing written for a fatal input
    out = regenerate(RegenerateConfig(output=str(tmp_path / "skip.jsonl"), on_error="skip", **cfg), host=host)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["c0", "c1", "c2"]
    assert f"skipping malformed record at {source}:2" in caplog.text


def test_on_error_flag_reaches_eval_and_train(tmp_path, capsys):
    from dspark.config import ConfigError, parse
    from dspark.training.train import TrainConfig

    source = _chats_with_a_bad_line(tmp_path)
    (cfg,) = parse([TrainConfig], ["--output", str(tmp_path / "t"), "--on-error", "raise"])
    assert cfg.on_error == "raise"
    with pytest.raises(ConfigError, match="--on-error: 'ignore' is not a valid choice; choose one of 'skip', 'raise'"):
        parse([TrainConfig], ["--output", str(tmp_path / "t"), "--on-error", "ignore"])
    out = tmp_path / "metrics.json"
    rc = main(["eval", "--host", "random:tiny-llama", "--device", "cpu", "--data", str(source), "--split", "all",
               "--on-error", "raise", "--output", str(out)])
    assert rc == 1 and f"{source}:2: turn content must be a string" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_config_key_on_the_command_line(tmp_path, capsys):
    """(dspark.config itself: tests/test_config.py::test_unknown_yaml_key_names_key_and_valid_ones.)"""
    (tmp_path / "run.yaml").write_text("max_new_token: 4\n")
    rc = main(["generate", "--config", str(tmp_path / "run.yaml"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "unknown key 'max_new_token' in config file" in err and "did you mean 'max_new_tokens'?" in err


# ---- no partial outputs --------------------------------------------------------------------------------------------
def test_failed_commands_leave_no_output_files(tmp_path, capsys):
    """(checkpoint writes: tests/test_drafters_dspark.py::test_checkpoint_write_is_atomic; training and
    regeneration: the kill -9 tests named in docs/RELIABILITY.md.)"""
    from test_regenerate import chat_host

    host = chat_host()
    host.model.save_pretrained(tmp_path / "host")
    host.tokenizer.save_pretrained(tmp_path / "host")
    source = _chats_with_a_bad_line(tmp_path)
    base = ["--host", str(tmp_path / "host"), "--device", "cpu"]
    out = tmp_path / "out" / "metrics.json"
    for bad, message in [(["--temperature", "-1"], "temperature must be a finite number >= 0"),
                         (["--top-p", "2"], "top_p must be in (0, 1]"),
                         (["--draft-length", "0", "--drafter", "ngram"], "draft_length (gamma) must be an integer"),
                         (["--max-new-tokens", "100000"], "beyond the host's context")]:
        rc = main(["eval", *base, "--data", str(source), "--split", "all", "--limit", "2", "--output", str(out),
                   *bad])
        assert rc == 1 and message in capsys.readouterr().err
        assert not out.exists() and not out.parent.exists()
    cost = tmp_path / "prof" / "cost.json"
    (tmp_path / "bad_sts.json").write_text("{}")
    rc = main(["profile", *base, "--out", str(cost), "--batch-sizes", "1", "--tokens-per-request", "1",
               "--repeats", "1", "--warmup", "0", "--engine-json", str(tmp_path / "engine.json"),
               "--calibration", str(tmp_path / "bad_sts.json")])
    assert rc == 1 and "is not a dspark.sts version 1 file" in capsys.readouterr().err
    assert not cost.exists() and not (tmp_path / "engine.json").exists()
    rc = main(["profile", *base, "--out", str(cost), "--batch-sizes", "1", "--tokens-per-request", "64",
               "--context", "500"])
    assert rc == 1 and "do not fit the host's context of 512" in capsys.readouterr().err
    assert not cost.exists()


# ---- numerical guards ----------------------------------------------------------------------------------------------
class _Poisoned(Host):
    """The tiny host whose logits turn non-finite in one batch row on the n-th verify round, or on the n-th
    prefill when `prefill` (prefill logits are (B, V), a round's (B, L+1, V))."""

    def __init__(self, call: int, row: int, value: float, *, prefill: bool = False):
        super().__init__(tiny_model("llama"), name="poisoned")
        self.call, self.row, self.value, self.prefill, self.calls = call, row, value, prefill, 0

    def logits(self, hidden):
        out = super().logits(hidden)
        if (hidden.dim() == 2) == self.prefill:
            if self.calls == self.call:
                out[self.row] = self.value
            self.calls += 1
        return out


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_non_finite_host_logits_are_reported_never_accepted(drafter, value):
    prompts = random_prompts([5, 7, 9], 128, seed=3)
    clean = generate(Host(tiny_model("llama"), name="clean"), prompts, max_new_tokens=8).token_ids
    streamed = {i: [] for i in range(3)}
    host = _Poisoned(call=1, row=1, value=value)
    with pytest.raises(FloatingPointError, match=r"non-finite \(NaN/Inf\) host or draft logits, or draft confidences "
                                                 r"outside \[0, 1\], in round 1 for request\(s\) \[1\]; no token "
                                                 r"of that round was accepted"):
        generate(host, prompts, max_new_tokens=8, drafter=None if drafter is None else build_drafter(drafter, host),
                 draft_length=3, on_tokens=lambda i, ids: streamed[i].extend(ids))
    for i in range(3):  # everything streamed before the error is the clean output; nothing of round 1 was
        assert streamed[i] == clean[i][: len(streamed[i])]
    assert 0 < len(streamed[1]) < 8


def test_non_finite_host_logits_at_prefill():
    host = _Poisoned(call=1, row=2, value=math.nan, prefill=True)  # the prefill of batch 2: requests 3..5
    with pytest.raises(FloatingPointError, match=r"non-finite values \(NaN/Inf\) in host logits at prefill "
                                                 r"\(before round 0\) for request\(s\) \[5\]"):
        generate(host, random_prompts([4] * 6, 128), max_new_tokens=4, batch_size=3)


class _NaNq(Drafter):
    """Proposes the anchor repeated with its point mass as q and confidence 0.5, `bad` (NaN) in q of one request
    from a given round on, or `bad` in its confidence with `in_confidence`."""

    name = "nan-q"

    def __init__(self, request: int, round_index: int, *, in_confidence: bool = False, bad: float = math.nan):
        self.request, self.round_index, self.in_confidence, self.bad = request, round_index, in_confidence, bad

    def propose(self, state, K):
        B = state.seq.shape[0]
        tokens = state.anchor.unsqueeze(1).expand(B, K).clone()
        q = torch.nn.functional.one_hot(tokens, 128).float()
        confidence = torch.full((B, K), 0.5)
        rows = (state.rounds >= self.round_index).nonzero().flatten()
        for b in rows.tolist():
            if int(state.seeds[b]) == self.request:  # seeds default to seed + request index
                if self.in_confidence:
                    confidence[b, -1] = self.bad
                else:
                    q[b, 0, 0] = self.bad
        return Proposal(tokens=tokens, q=q, confidence=confidence)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_draft_distribution_is_reported(tiny_host, temperature):
    with pytest.raises(FloatingPointError, match=r"in round 2 for request\(s\) \[1\]"):
        generate(tiny_host, random_prompts([4, 6, 8], 128), drafter=_NaNq(request=1, round_index=2), draft_length=2,
                 max_new_tokens=10, sampling=SamplingConfig(temperature=temperature))


@pytest.mark.parametrize("bad, verifier", [(math.nan, "threshold"), (math.nan, "scheduler"), (1.5, "full")])
def test_bad_draft_confidence_is_reported(tiny_host, bad, verifier):
    # the scheduler's table prices the drafter's step (next to nothing: a complete table, same rounds as a free one)
    table = with_draft_price(CostModel(tokens=[1, 64], sps=[100.0, 90.0]), _NaNq(request=1, round_index=2), 2, 1e-9)
    kw = {"threshold": {"threshold": 0.3}, "scheduler": {"cost_table": table}, "full": {}}[verifier]
    with pytest.raises(FloatingPointError, match=r"confidences outside \[0, 1\], in round 2 for request\(s\) \[1\]"):
        dspark.generate(tiny_host, _NaNq(request=1, round_index=2, in_confidence=True, bad=bad),
                        random_prompts([4, 6, 8], 128), verifier=verifier, draft_length=2, max_new_tokens=10, **kw)
    clean = dspark.generate(tiny_host, _NaNq(request=1, round_index=99, in_confidence=True),
                            random_prompts([4, 6, 8], 128), verifier=verifier, draft_length=2, max_new_tokens=10, **kw)
    assert len(clean.token_ids) == 3


def test_reliability_doc_names_existing_tests():
    """docs/RELIABILITY.md maps each guarantee to tests; every test it names must exist."""
    doc = (ROOT / "docs" / "RELIABILITY.md").read_text()
    refs = sorted(set(re.findall(r"(tests/\w+\.py)::(\w+)", doc)))
    assert len(refs) > 40
    missing = [f"{file}::{name}" for file, name in refs
               if not re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M)]
    assert not missing, missing
