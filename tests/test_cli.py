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
    """The documented commands as typed, from the repository root (where the package folder dspark/ exists)."""
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

    import dspark.training.regenerate as regenerate_module

    seen = []
    real = regenerate_module.load_host

    def spy(name, *, dtype, device):
        host = real(name, dtype=dtype, device=device)
        seen.append(next(host.model.parameters()).dtype)
        return host

    monkeypatch.setattr(regenerate_module, "load_host", spy)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    main(["regenerate", "--host", host_dir, "--device", "cpu", "--dtype", "bfloat16", "--data", str(data),
          "--split", "all", "--max-new-tokens", "2", "--output", str(out)])
    assert seen == [torch.bfloat16] and len(out.read_text().splitlines()) == 1


# ---- which runs compare pairs ----------------------------------------------------------------------------------------
def test_eval_records_its_settings_and_compare_refuses_other_decoding(host_dir, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"q {i}"}]}) + "\n"
                            for i in range(3)))
    base = ["eval", "--host", host_dir, "--device", "cpu", "--data", str(data), "--split", "all", "--limit", "3",
            "--max-new-tokens", "4", "--draft-length", "3"]
    paths = {}
    for tag, extra in {"ngram": ["--drafter", "ngram"], "plain": [], "t1": ["--drafter", "ngram", "--temperature", "1"],
                       "gamma5": ["--drafter", "ngram", "--draft-length", "5"]}.items():
        paths[tag] = str(tmp_path / f"{tag}.json")
        assert main([*base, *extra, "--output", paths[tag]]) == 0
    capsys.readouterr()
    saved = json.loads(Path(paths["t1"]).read_text())
    assert {k: saved[k] for k in ("offset", "limit", "max_prompt_length", "max_new_tokens", "temperature", "top_p",
                                  "top_k", "seed", "draft_length", "verifier", "heldout_fraction")} == {
        "offset": 0, "limit": 3, "max_prompt_length": 512, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0, "seed": 0, "draft_length": 3, "verifier": "full", "heldout_fraction": 0.02}
    assert main(["compare", "--run", paths["ngram"], "--against", paths["plain"]]) == 0
    assert "paired bootstrap over 3 requests" in capsys.readouterr().out
    for other, message in (("t1", "were not decoded the same way: temperature 0.0 vs 1.0"),
                           ("gamma5", "were not decoded the same way: draft_length 3 vs 5")):
        assert main(["compare", "--run", paths["ngram"], "--against", paths[other]]) == 1
        assert message in capsys.readouterr().err


# ---- the held-out split a drafter was trained with -------------------------------------------------------------------
FRACTION = 0.25


@pytest.fixture(scope="module")
def trained(host_dir, tmp_path_factory) -> dict:
    """A DSpark drafter trained one step on 48 chats (distinct prompts) with heldout_fraction 0.25 (the default
    is 0.02)."""
    from dspark.training.train import TrainConfig, train

    root = tmp_path_factory.mktemp("trained")
    data = str(root / "chats.jsonl")
    Path(data).write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}: why?"}, {"from": "gpt", "value": f"because {i}" * 3}]}) + "\n"
        for i in range(48)))
    cfg = TrainConfig(output=str(root / "run"), host=host_dir, drafter="dspark", data=data, heldout_fraction=FRACTION,
                      drafter_args=dict(num_layers=1, block_size=4, rank=16, max_anchors=32, num_feature_layers=2),
                      seq_len=128, max_length=128, batch_size=2, max_steps=1, eval_every=0, bf16=False)
    train(cfg, host=dspark.load_host(host_dir, device="cpu"))
    return {"data": data, "output": str(root / "run")}


def test_eval_scores_the_heldout_split_the_drafter_was_trained_with(host_dir, trained, capsys):
    from dspark.training.data import load_conversations

    heldout = load_conversations(trained["data"], split="heldout", heldout_fraction=FRACTION)
    assert 0 < len(heldout) < 32 < 48 * FRACTION * 4  # the split is smaller than --limit
    base = ["eval", "--host", host_dir, "--device", "cpu", "--drafter-path", trained["output"], "--data",
            trained["data"], "--max-new-tokens", "2", "--draft-length", "4", "--json"]
    with pytest.warns(UserWarning, match=rf"has only {len(heldout)} prompts .*not --limit 32"):
        metrics = run_json(capsys, base)
    assert metrics["heldout_fraction"] == FRACTION and metrics["requests"] == len(heldout)
    assert main([*base, "--heldout-fraction", "0.5"]) == 1
    assert "differs from the 0.25 drafter" in capsys.readouterr().err


def test_calibrate_fits_on_prompts_eval_does_not_score(host_dir, trained, capsys):
    from dspark.cli import DecodeOptions, EvalOptions, eval_prompts, resolve_split

    host = dspark.load_host(host_dir, device="cpu")
    d = DecodeOptions(drafter_path=trained["output"])
    scored = eval_prompts(host, resolve_split(d, EvalOptions(data=trained["data"], limit=8)))
    fitted = eval_prompts(host, resolve_split(d, EvalOptions(data=trained["data"], limit=8), default_split="train"))
    assert scored and fitted and not {tuple(p) for p in scored} & {tuple(p) for p in fitted}
    report = Path(trained["output"]).parent / "cal_report.json"
    assert main(["calibrate", "--host", host_dir, "--device", "cpu", "--drafter-path", trained["output"], "--data",
                 trained["data"], "--limit", "8", "--draft-length", "4", "--max-new-tokens", "6",
                 "--out", str(report.with_name("cal.json")), "--report", str(report)]) == 0
    saved = json.loads(report.read_text())
    assert (saved["split"], saved["heldout_fraction"], saved["fit_requests"] + saved["report_requests"]) == (
        "train", FRACTION, 8)
    with pytest.warns(UserWarning, match="which `dspark eval` also scores"):
        main(["calibrate", "--host", host_dir, "--device", "cpu", "--drafter-path", trained["output"], "--data",
              trained["data"], "--split", "heldout", "--limit", "4", "--draft-length", "4", "--max-new-tokens", "4",
              "--out", str(report.with_name("cal2.json"))])


def test_concurrency_flag_decodes_continuously_with_the_same_tokens(host_dir, capsys):
    """`--concurrency C` runs the slot engine's continuous batching (C in flight, queued prompts entering as others
    stop); greedy fp32 output is the same as static batches, and the flag excludes --batch-size."""
    base = ["generate", "--host", host_dir, "--device", "cpu", "--max-new-tokens", "5", "--json", "--drafter", "ngram",
            "--prompt", "one", "--prompt", "two two", "--prompt", "three three three"]
    static = run_json(capsys, base)
    continuous = run_json(capsys, [*base, "--concurrency", "2"])
    assert continuous["outputs"] == static["outputs"]
    assert main([*base, "--concurrency", "2", "--batch-size", "2"]) == 1
    assert "exclude each other" in capsys.readouterr().err


def test_eval_scores_all_of_an_evaluation_set_the_drafter_did_not_train_on(trained):
    from dspark.cli import DecodeOptions, EvalOptions, resolve_split

    d = DecodeOptions(drafter_path=trained["output"])
    assert resolve_split(d, EvalOptions(data="humaneval")).split == "all"
    assert resolve_split(DecodeOptions(drafter="ngram"), EvalOptions(data="champ")).split == "all"
    assert resolve_split(d, EvalOptions(data="humaneval", split="heldout")).split == "heldout"  # asked for
    assert resolve_split(d, EvalOptions(data="humaneval"), default_split="train").split == "train"  # calibrate
    assert resolve_split(d, EvalOptions(data=trained["data"])).split == "heldout"  # its own training data


# ---- what a user reads: help, units, JSON ----------------------------------------------------------------------------
def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as strict parsers (and the JSON standard) do."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_top_level_help_starts_with_usage_and_names_commands_not_modules(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    first, *rest = text.splitlines()
    assert first.startswith("usage: dspark <command>") and "--help" in first
    assert rest[1].startswith("dspark: ")  # a one-line description before the command list
    assert "dspark train --output" in text and "dspark regenerate --output" in text
    assert "dspark.training" not in text  # commands, not module paths
    assert main([]) == 2 and capsys.readouterr().out.startswith("usage: dspark")


@pytest.mark.parametrize("command", ["quickstart", "generate", "eval", "compare", "train", "regenerate", "profile",
                                     "calibrate", "sweep", "bench", "export"])
def test_help_texts_say_what_a_flag_does_now_without_dates(command, capsys):
    import re

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and text.startswith("usage:")
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\b(before|since|until) 20\d\d\b", text), text


def test_profile_prints_its_figures_with_units(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["profile", "--host", "random:tiny-llama", "--device", "cpu", "--out", str(out), "--batch-sizes", "1",
                 "2", "--tokens-per-request", "1", "--repeats", "1", "--warmup", "0", "--context", "8",
                 "--drafter", "ngram", "--draft-lengths", "2"]) == 0
    printed = capsys.readouterr().out
    assert "steps per second" in printed and "steps/s" in printed and "ms a step" in printed
    assert "M = 1:" in printed and "M = 2:" in printed  # tokens per step, which is what the table is keyed by
    drafter_line = next(line for line in printed.splitlines() if "drafter step ngram/K2" in line)
    assert "R = 1: propose" in drafter_line and drafter_line.count(" ms") == 4
    strict_json(out.read_text())


def test_eval_json_is_strict_json_with_null_for_undefined_metrics(host_dir, tmp_path, capsys):
    """Plain decoding verifies no draft: its verify rate is undefined, null in the file and on stdout (not NaN)."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello"}]}) + "\n")
    written = tmp_path / "eval_plain.json"
    assert main(["eval", "--host", host_dir, "--device", "cpu", "--max-new-tokens", "3", "--data", str(data),
                 "--split", "all", "--limit", "1", "--output", str(written), "--json"]) == 0
    printed = strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    on_disk = strict_json(written.read_text())
    for metrics in (printed, on_disk):
        assert metrics["verify_rate"] is None and metrics["verified_token_savings"] is None
        assert metrics["tau"] == 1.0
    assert main(["compare", "--run", str(written), "--against", str(written), "--json"]) == 0
    strict_json(capsys.readouterr().out.strip().splitlines()[-1])
