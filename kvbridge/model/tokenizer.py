"""Tokenizers behind one interface: the built-in byte-level one and Hugging Face ``tokenizers``.

Chat templates: a checkpoint's Jinja template is rendered with ``jinja2`` in the
environment transformers uses. It is read, as transformers 5 does, from
``chat_template.jinja`` first, then ``chat_template.json``, then the
``chat_template`` of ``tokenizer_config.json``. Only a checkpoint without any
template (and the built-in tokenizer) gets the simple default: one
``<|role|>\\ncontent\\n`` section per message, then ``<|assistant|>\\n``.

Stop tokens: generation ends at any of the ids named ``eos_token_id`` in
``generation_config.json`` or ``config.json`` (an id or a list) and at the
``eos_token`` of ``tokenizer_config.json`` (SmolLM2's ``<|im_end|>``, which ends a
ChatML turn).
"""

from __future__ import annotations

import datetime
import functools
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
        if self.chat_template is None:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        return _render_jinja(self.chat_template, messages, add_generation_prompt,
                             self.special_tokens_map)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens a chat template may refer to (``bos_token``, ...)."""
        return {k: v for k, v in (("bos_token", self.bos_token),
                                  ("eos_token", self.eos_token)) if v is not None}

    def encode_chat(self, messages: list[Message]) -> list[int]:
        text = self.apply_chat_template(messages)
        # A Jinja template writes the BOS token itself (as transformers and vLLM assume);
        # the default one does not.
        return self.encode(text, add_special_tokens=self.chat_template is None)


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
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (kvbridge reads the fast "
                                    "tokenizer file of a checkpoint)")
        self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self._special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                         if (t := _token_text(cfg.get(k))) is not None}
        self.chat_template = read_chat_template(path, cfg)
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
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

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


def read_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """A checkpoint's chat template, where transformers 5 looks for it, in its order."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = _read_json(path / "chat_template.json")
    if json_file.get("chat_template"):
        return _pick_template(json_file["chat_template"])
    return _pick_template(tokenizer_config.get("chat_template"))


@functools.cache
def _jinja_env() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    # The environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    return _jinja_env().from_string(template)


def _render_jinja(template: str, messages: list[Message], add_generation_prompt: bool,
                  special_tokens: dict[str, str]) -> str:
    import jinja2

    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **{"bos_token": "", "eos_token": "", **special_tokens})
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
