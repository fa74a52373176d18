"""Tokenizers behind one interface: the built-in byte-level one and Hugging Face ``tokenizers``.

Chat templates: a checkpoint's Jinja ``chat_template`` (from
``tokenizer_config.json``) is rendered with ``jinja2`` when that package is
installed. Otherwise, and for the built-in tokenizer, a simple default
applies: one ``<|role|>\\ncontent\\n`` section per message, then
``<|assistant|>\\n`` to prompt the reply.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class Tokenizer(ABC):
    """What the engine and the API need from a tokenizer."""

    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    chat_template: str | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def apply_chat_template(self, messages: list[Message],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``ValueError`` if the template rejects them)."""
        messages = [_normalize(m) for m in messages]
        template = self.chat_template if _has_jinja() else None
        if template is None:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        return _render_jinja(template, messages, add_generation_prompt, self.bos_token,
                             self.eos_token)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        text = self.apply_chat_template(messages)
        # A Jinja template writes the BOS token itself; the default one does not.
        uses_jinja = self.chat_template is not None and _has_jinja()
        return self.encode(text, add_special_tokens=not uses_jinja)


class ByteTokenizer(Tokenizer):
    """Token ``b`` is byte ``b`` (0-255), then BOS (256) and EOS (257)."""

    bos_token, eos_token = "<s>", "</s>"
    bos_token_id = 256
    eos_token_ids = frozenset({257})

    @property
    def vocab_size(self) -> int:
        return 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for t in token_ids:
            if t < 256:
                run.append(t)
                continue
            if not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
                out.append(self.bos_token if t == self.bos_token_id else self.eos_token)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` (plus ``tokenizer_config.json``) from a checkpoint directory."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = _pick_template(cfg.get("chat_template"))
        model_cfg = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        eos: set[int] = set()
        for src in (model_cfg.get("eos_token_id"), gen_cfg.get("eos_token_id")):
            eos.update(src if isinstance(src, list) else [] if src is None else [src])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_token_id = bos if bos is not None else model_cfg.get("bos_token_id")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # BOS, if any, comes from tokenizer.json's post-processor, as in transformers.
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _normalize(m: Message) -> Message:
    """OpenAI content may be a list of parts; templates expect a string."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**m, "role": m.get("role", "user"), "content": content or ""}


def _has_jinja() -> bool:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return False
    return True


def _render_jinja(template: str, messages: list[Message], add_generation_prompt: bool,
                  bos_token: str | None, eos_token: str | None) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    # The same environment settings transformers uses for chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "", eos_token=eos_token or "")
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _pick_template(t: Any) -> str | None:
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t}
        return named.get("default")
    return t
