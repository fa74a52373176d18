"""What a trained model shipped as a GGUF file inside a Python package is: the one
description ``models`` (lookup, prepare) and ``gguf_convert`` both read."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PackagedModel"]


@dataclass(frozen=True)
class PackagedModel:
    """A trained model shipped as a GGUF file inside a Python package."""

    name: str  # what users type: kvbridge model prepare NAME
    hf_id: str  # the Hugging Face repository it was converted from (an accepted alias)
    distribution: str  # pip name, pinned
    version: str
    package: str  # import name; only its directory is used, it is never imported
    filename: str
    sha256: str
    license: str
    # Tokens that end a turn: generation stops at any of them.
    eos_tokens: tuple[str, ...] = ()
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    pre_tokenizer_digits: bool = False  # llama.cpp's "smollm" pre-tokenizer splits digits

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"
