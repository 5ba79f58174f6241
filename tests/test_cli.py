"""The `dspark` commands as a user types them: list flags, drafter names next to folders of the same name, what
an eval JSON records and which runs `dspark compare` pairs, the held-out split a drafter was trained with."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_regenerate import chat_host

import dspark
from dspark.cli import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:drafter '.*' has no checkpoint")


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory) -> str:
    """A tiny random chat host saved as a model directory, so the commands load it like any local host."""
    path = tmp_path_factory.mktemp("host")
    host = chat_host()
    host.model.save_pretrained(path)
    host.tokenizer.save_pretrained(path)
    return str(path)


def run_json(capsys, argv) -> dict:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def test_generate_decodes_every_repeated_prompt_and_keeps_commas(host_dir, capsys):
    base = ["generate", "--host", host_dir, "--device", "cpu", "--max-new-tokens", "3", "--json"]
    out = run_json(capsys, [*base, "--prompt", "Name three primes, please.", "--prompt", "hi"])
    plain = [run_json(capsys, [*base, "--prompt", p])["outputs"][0] for p in ("Name three primes, please.", "hi")]
    assert out["outputs"] == plain  # two prompts, the first one whole


def test_a_registered_drafter_name_is_not_read_as_a_folder(host_dir, tmp_path, monkeypatch, capsys):
    """From the repository root the package folder dspark/ exists; `--drafter dspark` still means the drafter."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dspark").mkdir()
    base = ["--host", host_dir, "--device", "cpu", "--max-new-tokens", "4"]
    plain = run_json(capsys, ["generate", *base, "--prompt", "hi", "--json"])
    spec = run_json(capsys, ["generate", *base, "--prompt", "hi", "--json", "--drafter", "dspark"])
    assert spec["outputs"] == plain["outputs"] and spec["stats"]["rounds"] > 0
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    metrics = run_json(capsys, ["eval", *base, "--drafter", "dspark", "--data", str(data), "--split", "all",
                                "--limit", "1", "--json"])
    assert metrics["drafter"] == "dspark" and metrics["requests"] == 1
    host = dspark.load_host(host_dir, device="cpu")
    assert dspark.generate(host, "dspark", ["hi"], max_new_tokens=4).texts == [o["text"] for o in plain["outputs"]]


def test_a_folder_given_to_drafter_points_to_drafter_path(host_dir, tmp_path, capsys):
    folder = tmp_path / "runs" / "mine"
    folder.mkdir(parents=True)
    rc = main(["generate", "--host", host_dir, "--device", "cpu", "--prompt", "hi", "--drafter", str(folder)])
    err = capsys.readouterr().err
    assert rc == 1 and f"unknown --drafter '{folder}'" in err and f"--drafter-path {folder}" in err


@pytest.mark.slow
def test_readme_style_commands_from_the_repository_root(monkeypatch, capsys):
    """Issue 19's commands as typed, from the repository root (where the package folder dspark/ exists)."""
    monkeypatch.chdir(ROOT)
    out = run_json(capsys, ["generate", "--host", "smollm2", "--drafter", "dspark", "--prompt",
                            "Name three primes, please.", "--prompt", "hi", "--max-new-tokens", "4", "--json"])
    assert len(out["outputs"]) == 2 and out["stats"]["rounds"] > 0


def test_a_dflash_checkpoint_is_labelled_dflash_under_drafter_dspark(host_dir, tmp_path, capsys):
    from drafters import build_drafter

    host = dspark.load_host(host_dir, device="cpu")
    build_drafter("dflash", host, num_layers=1).save_pretrained(tmp_path / "dflash")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    base = ["eval", "--host", host_dir, "--device", "cpu", "--max-new-tokens", "2", "--data", str(data), "--split",
            "all", "--limit", "1", "--draft-length", "2", "--drafter-path", str(tmp_path / "dflash"), "--json"]
    assert run_json(capsys, [*base, "--drafter", "dspark"])["drafter"] == "dflash"
    assert run_json(capsys, base)["drafter"] == "dflash"


def test_sweep_deterministic_flag_switches_before_loading(monkeypatch):
    """(generate / eval / profile / calibrate: tests/test_soak.py::test_deterministic_flag_calls_the_switch_before_loading.)"""
    from dspark import api

    calls = []

    def load(*args, **kwargs):
        calls.append("load")
        raise RuntimeError("stop after loading")

    monkeypatch.setattr(api, "set_deterministic", lambda enabled=True: calls.append("deterministic"))
    monkeypatch.setattr(api, "load_host", load)
    with pytest.raises(RuntimeError, match="stop after loading"):
        main(["sweep", "--host", "random:tiny-llama", "--drafter", "ngram", "--deterministic"])
    assert calls == ["deterministic", "load"]


def test_regenerate_dtype_flag_reaches_the_host(host_dir, tmp_path, monkeypatch):
    import torch

    import dspark.regenerate

    seen = []
    real = dspark.regenerate.load_model_and_tokenizer

    def spy(name, *, dtype, device):
        seen.append(dtype)
        return real(name, dtype=dtype, device=device)

    monkeypatch.setattr(dspark.regenerate, "load_model_and_tokenizer", spy)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    main(["regenerate", "--host", host_dir, "--device", "cpu", "--dtype", "bfloat16", "--data", str(data),
          "--split", "all", "--max-new-tokens", "2", "--output", str(out)])
    assert seen == [torch.bfloat16] and len(out.read_text().splitlines()) == 1
