"""dspark.training.train: the loop lowers the loss, trains only the drafter, checkpoints atomically and resumes exactly.

Tiny hosts on the CPU, fp32: a random Llama with a character-level chat tokenizer (real chat-template data
path, tests/test_regenerate.py) and `random:tiny-llama` by name with `--data synthetic` (the no-tokenizer path).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_regenerate import chat_host, write_conversations

from drafters import DRAFTERS, build_drafter, load_drafter
from dspark.cli import DecodeOptions, _drafter_label
import dspark.training.train as train_module
from dspark.training.train import TrainConfig, checkpoints, main_train, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]
RANDOM_HOST = "random:tiny-llama?initializer_range=0.2"  # why 0.2: peaked host distributions, something to learn
SMALL = {  # per-drafter overrides that keep a step around 0.1 s on the CPU
    "dspark": dict(num_layers=1, block_size=4, rank=16, max_anchors=32, num_feature_layers=2),
    "dflash": dict(num_layers=1, block_size=4, max_anchors=32, num_feature_layers=2),
    "mtp": dict(),
    "eagle3": dict(ttt_length=3),
}
TRAINABLE = [name for name in SMALL if name in DRAFTERS]


def synthetic_config(output, **overrides) -> TrainConfig:
    settings = dict(output=str(output), host=RANDOM_HOST, drafter="dspark", drafter_args=SMALL["dspark"],
                    data="synthetic:64", seq_len=128, batch_size=2, max_steps=10, save_every=4, eval_every=5,
                    eval_batches=1, lr=2e-3)
    return TrainConfig(**{**settings, **overrides})


def losses(output) -> list[tuple[str, int, float]]:
    return [(r["kind"], r["step"], r["loss"]) for r in read_metrics(Path(output) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    return write_conversations(tmp_path_factory.mktemp("data") / "chats.jsonl", 48)


@pytest.mark.parametrize("kind", TRAINABLE)
def test_loss_falls_only_drafter_trains_checkpoint_loads(tmp_path, chat_data, kind):
    host = chat_host()
    embed, head = host.embed_tokens.weight.clone(), host.lm_head.weight.clone()
    cfg = TrainConfig(output=str(tmp_path / kind), host="tiny-chat", drafter=kind, drafter_args=SMALL[kind],
                      data=chat_data, heldout_fraction=0.2, max_length=128, seq_len=128, batch_size=2, max_steps=24,
                      lr=3e-3, save_every=12, eval_every=12, eval_batches=2)
    path = train(cfg, host=host)

    records = read_metrics(Path(cfg.output) / "metrics.jsonl")
    train_loss = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(train_loss) == 24
    assert sum(train_loss[-4:]) / 4 < sum(train_loss[:4]) / 4, train_loss
    assert [r["step"] for r in records if r["kind"] == "eval"] == [12, 24]
    last = records[-2]
    assert len(last["acceptance"]) >= 1 and all(0 <= a <= 1 for a in last["acceptance"])
    assert last["tau"] == pytest.approx(1 + float(torch.tensor(last["acceptance"]).cumprod(0).sum()))
    for key in ("lr", "grad_norm", "tokens_per_s", "peak_mem_gb", "epoch", "step_s", "time"):
        assert key in last
    assert (Path(cfg.output) / "training_curve.png").stat().st_size > 1000

    # the frozen host embedding and LM head are untouched; every trainable drafter tensor moved
    assert torch.equal(host.embed_tokens.weight, embed) and torch.equal(host.lm_head.weight, head)
    torch.manual_seed(cfg.seed)  # train seeds the same way before building, so this is the initial drafter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "random weights": this is the untrained start, on purpose
        initial = build_drafter(kind, host, **SMALL[kind])
    trained = load_drafter(path, host)
    assert type(trained) is type(initial)
    names = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert names and set(trained.state_dict()) == set(initial.state_dict())
    unchanged = [n for n in names if torch.equal(trained.state_dict()[n], initial.state_dict()[n])]
    assert not unchanged, f"parameters that never moved: {unchanged}"
    assert type(trained).from_pretrained(path, host) is not None

    # checkpoint layout: the drafter's files plus trainer state, all safetensors + JSON, no pickle
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state.json", "optimizer.safetensors", "optimizer.json",
            "scheduler.json", "rng-0.safetensors"} <= files
    assert not [f for f in files if f.endswith((".pt", ".bin", ".pkl"))]
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 24 and state["config"]["drafter"] == kind
    # reports name the checkpoint by what it is (a DFlash checkpoint is a DSpark-class one with no head)
    assert _drafter_label(DecodeOptions(drafter_path=str(path))) == kind


def test_sparse_attention_flag_reaches_the_block_mask(tmp_path, monkeypatch):
    """--sparse-attention false makes DSpark training use the dense mask even where the sparse one would apply
    (here: pretend it applies, and record which mask each training step asked for)."""
    import drafters.dspark as dspark_module

    asked = []
    dense = dspark_module.block_training_mask

    def recording(*args, sparse=False, **kwargs):
        asked.append(sparse)
        return dense(*args, sparse=False, **kwargs)  # the CPU has no flex backward: compute with the dense mask

    monkeypatch.setattr(dspark_module, "sparse_training_attention", lambda x: True)
    monkeypatch.setattr(dspark_module, "block_training_mask", recording)
    train(synthetic_config(tmp_path / "auto", max_steps=1, eval_every=0))
    assert asked and all(asked)
    asked.clear()
    train(synthetic_config(tmp_path / "off", max_steps=1, eval_every=0, sparse_attention=False))
    assert asked and not any(asked)


def test_stage_timing_splits_the_steps_it_is_asked_for(tmp_path, monkeypatch):
    """stage_timing_every = 3: steps 3 and 6 log `stage_s` (host forward, drafter forward, backward, optimizer),
    whose sum is the step's own time but what the record-keeping after the optimizer takes; the others log none."""
    laps = []
    monkeypatch.setattr(train_module.StageClock, "lap", lambda self, stage, lap=train_module.StageClock.lap:
                        (laps.append(stage) if self.on else None, lap(self, stage))[1])
    cfg = synthetic_config(tmp_path / "run", max_steps=6, eval_every=0, save_every=6, grad_accum=2,
                           stage_timing_every=3)
    train(cfg)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    timed = {r["step"]: r["stage_s"] for r in records if "stage_s" in r}
    assert sorted(timed) == [3, 6]
    for step, stages in timed.items():
        assert list(stages) == ["host", "forward", "backward", "optimizer"] and min(stages.values()) > 0
        step_s = next(r["step_s"] for r in records if r["step"] == step)
        assert 0.5 * step_s < sum(stages.values()) <= step_s
    # per timed step: each of the 2 micro-batches laps host, forward, backward; then one optimizer lap
    assert laps == (["host", "forward", "backward"] * 2 + ["optimizer"]) * 2
    with pytest.raises(ValueError, match="stage_timing_every"):
        synthetic_config(tmp_path / "bad", stage_timing_every=-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_init_layers_from_host_copies_the_last_layers(kind, caplog):
    """init_layers_from_host: a 2-layer DSpark backbone starts as the host's last two layers, every weight of the
    same name and shape copied (Qwen2's q/k/v biases have none here: left out and logged); EAGLE-3, whose layer
    reads 2H-wide inputs, is refused by name."""
    from conftest import tiny_model
    from dspark.engine.host import Host

    host = Host(tiny_model(kind, layers=4), name=kind)
    drafter = build_drafter("dspark", host, num_layers=2, block_size=4, rank=16, max_anchors=8, num_feature_layers=2)
    with caplog.at_level("INFO", logger=train_module.logger.name):
        train_module.init_layers_from_host(drafter, host)
    for mine, theirs in zip(drafter.backbone.layers, host.layers[2:]):
        own = dict(mine.named_parameters())
        for name, weight in theirs.named_parameters():
            if name.endswith("_proj.bias"):
                assert kind == "qwen2" and name.removeprefix("self_attn.") not in own
                continue
            assert torch.equal(own[name.removeprefix("self_attn.")], weight), name
        assert len(own) == sum(not n.endswith("bias") for n, _ in theirs.named_parameters())  # nothing else
    assert ("left out" in caplog.text) == (kind == "qwen2")
    with pytest.raises(ValueError, match="Eagle3.*no decoder layers of the host's shape"):
        train_module.init_layers_from_host(build_drafter("eagle3", host, ttt_length=2), host)


def test_eagle3_draft_vocab_is_the_most_frequent_training_targets_and_survives_resume(tmp_path, monkeypatch):
    cfg = synthetic_config(tmp_path / "run", drafter="eagle3", drafter_args=dict(ttt_length=3, draft_vocab=20),
                           max_steps=2, save_every=1, eval_every=0)
    train(cfg)
    host = train_module.load_host(RANDOM_HOST)
    rows = train_module.build_rows(cfg, host, split="train", limit=None,
                                   max_rows=train_module.rows_needed(cfg, 1))  # the rows the run trained on
    counts = train_module.target_counts(rows, host.vocab_size)
    first = load_drafter(checkpoints(tmp_path / "run")[-1], host)
    expected = torch.tensor(sorted(counts.argsort(descending=True, stable=True)[:20].tolist()))
    assert torch.equal(first.d2t, expected) and int(counts[expected].min()) >= int(counts.sort().values[-21])
    def recount(*_):
        raise AssertionError("a resumed run recounted its draft vocabulary")

    monkeypatch.setattr(train_module, "target_counts", recount)
    train(train_module.replace(cfg, max_steps=4))  # resumed: the checkpoint's vocabulary, not a recount
    assert torch.equal(load_drafter(checkpoints(tmp_path / "run")[-1], host).d2t, expected)


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, monkeypatch):
    steady = synthetic_config(tmp_path / "steady", grad_accum=2)
    train(steady)

    crash_after = 7  # past the step-4 checkpoint, so the crashed run logged steps 5..6 that resume must drop
    original = train_module.log_metrics

    def crash(record, **kwargs):
        if record["kind"] == "train" and record["step"] == crash_after:
            raise KeyboardInterrupt("simulated crash")
        original(record, **kwargs)

    interrupted = synthetic_config(tmp_path / "interrupted", grad_accum=2)
    monkeypatch.setattr(train_module, "log_metrics", crash)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted)
    monkeypatch.setattr(train_module, "log_metrics", original)
    assert [c.name for c in checkpoints(Path(interrupted.output))] == ["checkpoint-00000004"]
    train(interrupted)  # resume="auto" picks up checkpoint-4

    a, b = losses(steady.output), losses(interrupted.output)
    assert [(k, s) for k, s, _ in a] == [(k, s) for k, s, _ in b]  # same records, none duplicated
    assert max(abs(x - y) for (_, _, x), (_, _, y) in zip(a, b)) < 1e-6
    ra, rb = read_metrics(Path(steady.output) / "metrics.jsonl"), read_metrics(Path(interrupted.output) / "metrics.jsonl")
    assert [r.get("lr") for r in ra] == [r.get("lr") for r in rb]
    assert [c.name for c in checkpoints(Path(interrupted.output))] == ["checkpoint-00000008", "checkpoint-00000010"]

    # resuming a finished run returns its final checkpoint; changed data-order settings are refused
    assert train(interrupted).name == "checkpoint-00000010"
    with pytest.raises(ValueError, match="batch_size"):
        train(synthetic_config(tmp_path / "interrupted", grad_accum=2, batch_size=4))
    with pytest.raises(FileExistsError):
        train(synthetic_config(tmp_path / "interrupted", grad_accum=2, resume="never"))
    with pytest.raises(FileNotFoundError):
        train(synthetic_config(tmp_path / "empty", resume="always"))


def test_sigkill_mid_run_then_resume(tmp_path):
    output = tmp_path / "killed"
    flags = ["--output", str(output), "--host", RANDOM_HOST, "--drafter", "dflash", "--drafter-args",
             *(f"{k}={v}" for k, v in SMALL["dflash"].items()), "--data", "synthetic:64", "--seq-len", "128",
             "--batch-size", "2", "--max-steps", "24", "--save-every", "2", "--eval-every", "0", "--lr", "2e-3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    process = subprocess.Popen([sys.executable, "-m", "dspark.training.train", *flags], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mid_write = False
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if output.is_dir():
                partial = [p for p in output.iterdir() if p.name.startswith(".") and "tmp-checkpoint" in p.name]
                done = checkpoints(output)
                if partial and done:  # a save in progress with an earlier checkpoint already there
                    mid_write = True
                    break
                if len(done) >= 3:
                    break
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    survivors = checkpoints(output)
    assert survivors
    from dspark.engine.models import load_host

    host = load_host(RANDOM_HOST, device=torch.device("cpu"), dtype=torch.float32)
    for checkpoint in survivors:  # every complete checkpoint is loadable, whatever the kill interrupted
        load_drafter(checkpoint, host)
        json.loads((checkpoint / "trainer_state.json").read_text())

    from dspark.config import parse

    (cfg,) = parse([TrainConfig], flags)
    final = train(cfg)
    assert final.name == "checkpoint-00000024"
    assert not [p for p in output.iterdir() if p.name.startswith(".")]  # killed-save debris cleaned up
    resumed = losses(output)
    assert [s for _, s, _ in resumed] == list(range(1, 25))
    (steady,) = parse([TrainConfig], [*flags[:1], str(tmp_path / "steady"), *flags[2:]])
    reference = losses(train(steady).parent)
    # why relative 1e-5, not exact: the pre-kill steps ran in a subprocess whose intra-op thread pool may split
    # reductions differently from this process; a wrong data order or lost optimizer state moves losses by >1e-2
    diffs = [(s, abs(x - y) / abs(y)) for (_, s, x), (_, _, y) in zip(reference, resumed)]
    assert max(d for _, d in diffs) < 1e-5, diffs
    print(f"killed {'during a checkpoint write' if mid_write else 'between checkpoint writes'}")


def test_two_process_ddp_on_cpu_then_resume(tmp_path):
    """The multi-GPU path (DDP over the drafter, host replicated, rows split by rank, per-rank RNG files) through
    torchrun with gloo on the CPU; on GPUs `accelerate launch` starts the same processes."""
    output = tmp_path / "ddp"
    flags = ["--output", str(output), "--host", RANDOM_HOST, "--drafter", "dspark", "--drafter-args",
             *(f"{k}={v}" for k, v in SMALL["dspark"].items()), "--data", "synthetic:64", "--seq-len", "128",
             "--batch-size", "2", "--save-every", "3", "--eval-every", "3", "--eval-batches", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "true"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "dspark.training.train", *flags]
    for steps in ("4", "6"):  # the second launch resumes the first one's step-4 checkpoint
        # why a process group of its own: on a hang, the launcher's worker processes are killed with it
        process = subprocess.Popen([*launch, "--max-steps", steps], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, process_group=0)
        try:
            _, stderr = process.communicate(timeout=300)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        assert process.returncode == 0, stderr[-3000:]
    final = checkpoints(output)[-1]
    assert final.name == "checkpoint-00000006"
    assert {"rng-0.safetensors", "rng-1.safetensors"} <= {p.name for p in final.iterdir()}
    assert json.loads((final / "trainer_state.json").read_text())["world_size"] == 2
    assert [(k, s) for k, s, _ in losses(output)] == [("train", 1), ("train", 2), ("train", 3), ("eval", 3),
                                                       ("train", 4), ("eval", 4), ("train", 5), ("train", 6),
                                                       ("eval", 6)]


@pytest.mark.slow  # ~30 s: a torchrun launch of two processes and a one-process run
def test_two_processes_train_as_one_process_of_the_same_global_batch(tmp_path, monkeypatch):
    """2 processes x batch 2 (torchrun, gloo, CPU) log the losses, see the rows and end with the drafter
    weights of 1 process x batch 4, with grad_accum 2; each process trains on its own rows, none twice an epoch.
    why torchrun, not `accelerate launch`: on a CPU, `accelerate launch --cpu --num_processes 2` starts a single
    process (multi-CPU needs mpirun) and `--multi_gpu` starts two that each see a world of one; on GPUs
    `accelerate launch` starts the processes torchrun starts here."""
    common = dict(host=RANDOM_HOST, drafter="dspark", drafter_args=SMALL["dspark"], data="synthetic:64", seq_len=128,
                  grad_accum=2, max_steps=3, save_every=3, eval_every=0, lr=2e-3)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in common.items() if k != "drafter_args"]
    flags += ["--drafter-args", *(f"{k}={v}" for k, v in SMALL["dspark"].items())]
    (tmp_path / "rows2").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "true", "DSPARK_TRAIN_ROW_LOG": str(tmp_path / "rows2")}
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", "-m", "dspark.training.train", *flags, "--batch-size=2",
                                f"--output={tmp_path / 'two'}"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:  # a hang: kill the launcher's workers with it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    (tmp_path / "rows1").mkdir()
    monkeypatch.setenv("DSPARK_TRAIN_ROW_LOG", str(tmp_path / "rows1"))
    one = train(TrainConfig(output=str(tmp_path / "one"), batch_size=4, **common))

    two_records = read_metrics(tmp_path / "two" / "metrics.jsonl")
    one_records = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two_records] == [r["step"] for r in one_records] == [1, 2, 3]
    for a, b in zip(two_records, one_records):  # the loss and its parts, which share the loss's normaliser
        for key in ("loss", "ce", "tv", "conf"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a["step"], a[key], b[key])

    # rows: process r took places 2r, 2r+1 of each global micro-batch of 4; together one epoch, each row once
    ranks = [[json.loads(line) for line in (tmp_path / "rows2" / f"rows-{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)]
    single = [json.loads(line) for line in (tmp_path / "rows1" / "rows-0.jsonl").read_text().splitlines()]
    assert [e["micro"] for e in single] == [e["micro"] for e in ranks[0]] == [e["micro"] for e in ranks[1]]
    assert [a["rows"] + b["rows"] for a, b in zip(*ranks)] == [e["rows"] for e in single]
    seen = [i for e in ranks[0] + ranks[1] for i in e["rows"]]
    n_rows = json.loads((one / "trainer_state.json").read_text())["train_rows"]
    assert len(seen) == n_rows == 24 and sorted(seen) == list(range(n_rows))  # 3 steps x 2 x 4 rows: one epoch

    # one process wrote the checkpoint; its drafter equals the one-process drafter. why atol 2e-5: an AdamW step moves
    # a weight by up to lr = 2e-3 whatever its gradient's size, so rounding-level gradient differences (the two
    # padded shapes reduce in other orders) reach ~1e-6 in 3 steps; 2e-5 is 1% of one step
    final = checkpoints(tmp_path / "two")[-1]
    assert final.name == one.name == "checkpoint-00000003"
    assert {p.name for p in final.iterdir()} >= {"rng-0.safetensors", "rng-1.safetensors", "model.safetensors"}
    from safetensors.torch import load_file

    a, b = load_file(final / "model.safetensors"), load_file(one / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=2e-5, msg=name)


def test_cli_yaml_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # train must choose offline by itself
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "run.yaml").write_text(
        f"host: '{RANDOM_HOST}'\ndrafter: dspark\ndrafter_args: {json.dumps(SMALL['dspark'])}\n"
        "data: synthetic:32\nseq_len: 128\nbatch_size: 2\nmax_steps: 50\neval_every: 0\n")
    path = main_train(["--config", str(tmp_path / "run.yaml"), "--max-steps", "2", "--report-to", "wandb",
                       "--output", str(tmp_path / "run")])
    assert path.name == "checkpoint-00000002" and os.environ["WANDB_MODE"] == "offline"
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(losses(tmp_path / "run")) == 2


def test_tensorboard_tracker(tmp_path):
    from accelerate.utils import is_tensorboard_available

    if not is_tensorboard_available():
        pytest.skip("neither tensorboard nor tensorboardX is installed")
    train(synthetic_config(tmp_path / "tb", max_steps=2, eval_every=0, report_to="tensorboard"))
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_random_host_needs_synthetic_data(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        train(synthetic_config(tmp_path / "x", data="sharegpt"))


@pytest.mark.slow
def test_smollm2_sharegpt_smoke(tmp_path):
    """A few dozen CPU steps of DSpark on SmolLM2 over a ShareGPT slice lower the loss (a few minutes)."""
    cfg = TrainConfig(output=str(tmp_path / "smollm2"), host="smollm2", drafter="dspark",
                      drafter_args=dict(num_layers=1, rank=32, max_anchors=16), data="sharegpt", data_limit=48,
                      max_length=192, seq_len=192, batch_size=1, max_steps=30, lr=2e-3, save_every=30,
                      eval_every=0)  # why this small: the SmolLM2 forward is ~2-5 s per 200 tokens on 2 CPU cores
    started = time.perf_counter()
    path = train(cfg)
    train_loss = [r["loss"] for r in read_metrics(Path(cfg.output) / "metrics.jsonl")]
    print(f"SmolLM2 smoke: {time.perf_counter() - started:.0f} s, loss {train_loss[0]:.3f} -> {train_loss[-1]:.3f}")
    assert sum(train_loss[-5:]) / 5 < sum(train_loss[:5]) / 5
    assert path.name == "checkpoint-00000030"


def test_resume_refuses_another_heldout_fraction(tmp_path):
    """The held-out split is part of what a run trains on: a resume that changes it is refused."""
    train(synthetic_config(tmp_path / "run", max_steps=2, save_every=2, eval_every=0))
    with pytest.raises(ValueError, match=r"heldout_fraction \(0.02 -> 0.1\)"):
        train(synthetic_config(tmp_path / "run", max_steps=4, save_every=2, eval_every=0, heldout_fraction=0.1))
def test_default_run_on_cpu_tokenises_only_what_it_trains_on_at_cpu_sizes(tmp_path, monkeypatch):
    """`dspark train --max-steps N` with no size flags and no GPU takes the CPU-sized defaults and
    tokenises only the conversations of the rows its N steps consume (it used to tokenise all of ShareGPT)."""
    import dspark.training.data as data_module

    data = write_conversations(tmp_path / "chats.jsonl", 300)
    tokenised = []
    real = data_module.tokenize_chat
    monkeypatch.setattr(data_module, "tokenize_chat", lambda *a, **k: tokenised.append(1) or real(*a, **k))
    cfg = TrainConfig(output=str(tmp_path / "run"), host="tiny-chat", drafter="dspark",
                      drafter_args=dict(num_layers=1, block_size=4, rank=16, num_feature_layers=2), data=data,
                      max_steps=2, eval_every=0)
    path = train(cfg, host=chat_host())
    n_tokenised = len(tokenised)
    saved = json.loads((path / "trainer_state.json").read_text())
    assert (saved["config"]["seq_len"], saved["config"]["max_length"], saved["config"]["batch_size"]) == (384, 384, 2)
    assert saved["config"]["drafter_args"]["max_anchors"] == 40
    assert saved["train_rows"] == 2 * 2  # max_steps x batch_size rows, one epoch
    resolved = train_module.resolve_sizes(cfg, torch.device("cpu"))
    rows = train_module.build_rows(resolved, chat_host(), split="train", limit=None)
    print(f"tokenised {n_tokenised} of {len(tokenised) - n_tokenised} training conversations for 4 of {len(rows)} rows")
    assert n_tokenised < len(rows)  # a few short chats a 384-token row, 4 rows (+1 chat that would start the 5th)
    # the rows read are the first rows of the full packing
    assert [r.input_ids for r in rows[:4]] == [r.input_ids for r in train_module.build_rows(
        resolved, chat_host(), split="train", limit=None, max_rows=4)]
    gpu = train_module.resolve_sizes(cfg, torch.device("cuda"))  # only the device's type is read: no GPU needed
    assert (gpu.seq_len, gpu.max_length, gpu.batch_size, gpu.drafter_args.get("max_anchors")) == (2048, 2048, 4, None)


def test_a_step_too_large_for_the_memory_stops_at_once_naming_the_flags(tmp_path, monkeypatch):
    """Rather than being killed by the kernel mid-step, a run whose step cannot fit stops before
    the first step with a message naming the flags that lower it (here: a machine with 64 MiB available)."""
    monkeypatch.setattr(train_module, "available_memory", lambda device: 64 * 2**20)
    tokenised = []
    monkeypatch.setattr(train_module, "build_rows", lambda *a, **k: tokenised.append(1))
    for drafter, knob in (("dspark", "max_anchors"), ("eagle3", "ttt_length")):
        with pytest.raises(MemoryError, match=rf"needs at least .* GiB but only 0.1 GiB .*--batch-size, --seq-len, "
                                              rf"--drafter-args {knob}=N"):
            train(synthetic_config(tmp_path / drafter, drafter=drafter, drafter_args=SMALL[drafter], seq_len=2048,
                                   batch_size=4))
    assert not tokenised  # it stopped before reading any data
    cfg = synthetic_config(tmp_path / "fits", drafter="eagle3", drafter_args=SMALL["eagle3"], seq_len=128)
    host = train_module.load_host(cfg.host, device=torch.device("cpu"), dtype=torch.float32)
    drafter = build_drafter("eagle3", host, **SMALL["eagle3"])
    small = train_module.step_memory(cfg, host, drafter, element_size=4, sparse=False)
    large = train_module.step_memory(train_module.replace(cfg, seq_len=2048), host, drafter, element_size=4,
                                     sparse=False)
    assert small < 64 * 2**20 < large  # the same drafter at 128 tokens a row fits the 64 MiB
