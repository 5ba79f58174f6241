"""dspark.config: flags and YAML from the same dataclasses, precedence, strict keys and types."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from dspark.config import ConfigError, from_dict, parse, to_dict


@dataclass
class Run:
    host: str = field(default="smollm2", metadata={"help": "host model"})
    max_steps: Optional[int] = field(default=None, metadata={"help": "optimizer steps"})
    lr: float = 6e-4
    bf16: bool = True
    report_to: Literal["none", "wandb", "tensorboard"] = "none"
    resume: Literal["auto", "always", "never"] = field(default="auto", metadata={"const": "always"})
    taps: list[int] = field(default_factory=list)
    drafter_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Other:
    output: str = field(metadata={"help": "required: no default"})


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_flags_defaults_and_dash_or_underscore():
    (run,) = parse([Run], ["--max-steps", "12", "--lr=1e-3", "--report_to", "wandb"])
    assert run.max_steps == 12 and run.lr == 1e-3 and run.report_to == "wandb" and run.host == "smollm2"
    assert run.bf16 is True and run.resume == "auto" and run.taps == [] and run.drafter_args == {}


def test_bool_list_dict_const_flags():
    (run,) = parse([Run], ["--no-bf16", "--resume", "--taps", "1", "5", "--drafter-args", "num_layers=3", "head=rnn"])
    assert run.bf16 is False and run.resume == "always" and run.taps == [1, 5]
    assert run.drafter_args == {"num_layers": 3, "head": "rnn"}
    (run,) = parse([Run], ["--bf16", "false", "--taps", "2,4", "--resume", "never", "--max-steps", "none"])
    assert run.bf16 is False and run.taps == [2, 4] and run.resume == "never" and run.max_steps is None


def test_yaml_then_flags_override(tmp_path):
    path = write(tmp_path, "max_steps: 100\nlr: 0.001\nbf16: false\ntaps: [1, 2]\ndrafter_args: {gamma: 7}\n")
    (run,) = parse([Run], ["--config", path])
    assert (run.max_steps, run.lr, run.bf16, run.taps, run.drafter_args) == (100, 1e-3, False, [1, 2], {"gamma": 7})
    (run,) = parse([Run], ["--config", path, "--max-steps", "5", "--bf16"])
    assert run.max_steps == 5 and run.bf16 is True and run.lr == 1e-3  # flag wins, YAML keeps the rest
    (run,) = parse([Run], ["--max-steps", "5", "--config", path])  # flag order does not matter
    assert run.max_steps == 5


def test_unknown_yaml_key_names_key_and_valid_ones(tmp_path):
    path = write(tmp_path, "max_step: 10\n")
    with pytest.raises(ConfigError) as err:
        parse([Run], ["--config", path])
    message = str(err.value)
    assert "'max_step'" in message and "did you mean 'max_steps'" in message
    for valid in ("host", "max_steps", "lr", "bf16", "report_to"):
        assert valid in message


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse([Run], ["--max-stepz", "3"])
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("text, key", [
    ("max_steps: ten\n", "max_steps"),
    ("max_steps: 1.5\n", "max_steps"),
    ("lr: '1e-3x'\n", "lr"),
    ("bf16: maybe\n", "bf16"),
    ("report_to: mlflow\n", "report_to"),
    ("host: 3\n", "host"),
    ("taps: 3\n", "taps"),
    ("taps: [1, x]\n", "taps[1]"),
    ("drafter_args: [1]\n", "drafter_args"),
])
def test_yaml_type_errors(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse([Run], ["--config", write(tmp_path, text)])


def test_flag_type_errors_and_choices():
    with pytest.raises(ConfigError, match="max-steps"):
        parse([Run], ["--max-steps", "many"])
    with pytest.raises(ConfigError, match="choose one of 'none', 'wandb', 'tensorboard'"):
        parse([Run], ["--report-to", "mlflow"])


def test_yaml_quoted_numbers_convert_but_bools_do_not_become_ints(tmp_path):
    (run,) = parse([Run], ["--config", write(tmp_path, "lr: '2e-4'\nmax_steps: 7\n")])
    assert run.lr == 2e-4
    with pytest.raises(ConfigError):
        parse([Run], ["--config", write(tmp_path, "max_steps: true\n")])


def test_several_dataclasses_and_required_fields(tmp_path):
    run, other = parse([Run, Other], ["--output", "out", "--lr", "0.1"])
    assert other.output == "out" and run.lr == 0.1
    with pytest.raises(ConfigError, match="missing required setting"):
        parse([Run, Other], [])
    (other,) = parse([Other], ["--config", write(tmp_path, "output: o\n")])
    assert other.output == "o"


def test_to_dict_from_dict_roundtrip():
    run = Run(max_steps=3, taps=[1], drafter_args={"gamma": 5})
    data = to_dict(run)
    assert from_dict(Run, data) == run
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        from_dict(Run, {**data, "nope": 1})
    with pytest.raises(ConfigError, match="lr"):
        from_dict(Run, {**data, "lr": "fast"})


def test_help_text_comes_from_metadata(capsys):
    with pytest.raises(SystemExit):
        parse([Run], ["--help"])
    out = capsys.readouterr().out
    assert "--max-steps" in out and "optimizer steps" in out and "--config" in out


@dataclass
class Lists:
    prompt: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=lambda: [1, 4])
    drafter_args: dict[str, Any] = field(default_factory=dict)


def test_repeated_list_and_dict_flags_append():
    (opts,) = parse([Lists], ["--prompt", "A", "--prompt", "B", "--sizes", "1", "2", "--sizes", "8",
                              "--drafter-args", "num_layers=3", "--drafter-args", "head=rnn"])
    assert opts.prompt == ["A", "B"] and opts.sizes == [1, 2, 8]
    assert opts.drafter_args == {"num_layers": 3, "head": "rnn"}
    (opts,) = parse([Lists], ["--sizes", "1,4", "16"])  # numbers may still come comma-separated
    assert opts.sizes == [1, 4, 16]


def test_a_comma_inside_a_text_value_is_text(tmp_path):
    (opts,) = parse([Lists], ["--prompt", "Name three primes, please.", "--prompt", "a,b"])
    assert opts.prompt == ["Name three primes, please.", "a,b"]
    (opts,) = parse([Lists], ["--config", write(tmp_path, "prompt: 'Hi, there'\nsizes: '2,3'\n")])
    assert opts.prompt == ["Hi, there"] and opts.sizes == [2, 3]
    (opts,) = parse([Lists], ["--config", write(tmp_path, "prompt: [x, y]\nsizes: [5]\n"), "--prompt", "z"])
    assert opts.prompt == ["z"] and opts.sizes == [5]  # a flag replaces the YAML list


def test_a_recipe_gives_each_command_its_section_and_the_shared_keys(tmp_path):
    path = write(tmp_path, "host: qwen\ntrain:\n  max_steps: 9\n  drafter_args: {num_layers: 2}\n"
                           "eval:\n  output: runs/eval.json\n")
    (run,) = parse([Run], ["--config", path], prog="dspark train")
    assert (run.host, run.max_steps, run.drafter_args) == ("qwen", 9, {"num_layers": 2})
    (other,) = parse([Other], ["--config", path], prog="dspark eval")  # the train section is not read here
    assert other.output == "runs/eval.json"
    (run,) = parse([Run], ["--config", path, "--max-steps", "2"], prog="dspark train")  # flags still win
    assert run.max_steps == 2
    with pytest.raises(ConfigError, match="sections for eval, train, none for 'dspark bench'"):
        parse([Run], ["--config", path], prog="dspark bench")
    with pytest.raises(ConfigError, match="unknown key 'max_stepz'"):
        parse([Run], ["--config", write(tmp_path, "train:\n  max_stepz: 3\n")], prog="dspark train")
