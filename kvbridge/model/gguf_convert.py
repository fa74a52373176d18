"""A packaged GGUF file into a float32 Hugging Face checkpoint (``kvbridge model prepare``).

``convert`` reads the GGUF with the ``gguf`` library and dequantizes each tensor to
float32, un-permutes the query and key projections (llama.cpp's converter reorders their
rows per head for its own RoPE layout; the same reverse permutation transformers' GGUF
loader applies), checks every shape against the config it derives, and writes
``model.safetensors``, ``config.json``, ``generation_config.json``, ``tokenizer.json`` (a
byte-level BPE built from the GGUF's vocabulary and merges), ``tokenizer_config.json`` and
``chat_template.jinja``. Which file, where and when: ``kvbridge.model.models``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ModelPrepareError

if TYPE_CHECKING:
    from kvbridge.model.packaged import PackagedModel


# GGUF tensor names (llama.cpp) -> Hugging Face Llama names.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor (``ValueError`` for an unknown one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    blk, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if blk == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"
    raise ValueError(f"tensor {gguf_name!r} has no Llama counterpart")


def unpermute_rope(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's ``permute`` of a query/key projection, [n_heads*head_dim, hidden].

    llama.cpp's converter stores each head's rows interleaved (pairs ``(i, i + d/2)``
    adjacent) for its RoPE; Hugging Face's "rotate half" wants the two halves apart.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(model: PackagedModel, gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Write ``gguf_path`` as a float32 Hugging Face checkpoint into the directory ``out``."""
    try:
        import gguf
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError as e:
        raise ModelPrepareError(f"{model.name}: the gguf package is needed to read "
                                f"{model.filename} (pip install gguf): {e}") from None
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        meta = _Metadata(reader)
        config = _hf_config(meta)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ModelPrepareError(f"{gguf_path}: not a readable Llama GGUF file: {e}") from None
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, Any] = {}
    with _bar(len(reader.tensors), f"dequantizing {model.filename}", progress) as step:
        for t in reader.tensors:
            try:
                name = hf_name(t.name)
                w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            except (ValueError, NotImplementedError) as e:
                raise ModelPrepareError(f"{gguf_path}: tensor {t.name}: {e}") from None
            if name.endswith("q_proj.weight"):
                w = unpermute_rope(w, heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_rope(w, kv_heads)
            tensors[name] = np.ascontiguousarray(w)
            step()
    if "lm_head.weight" not in tensors:
        config["tie_word_embeddings"] = True
    _check_shapes(config, tensors, gguf_path)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(model, meta, out)


class _Metadata:
    """A GGUF file's key/value fields as Python values."""

    def __init__(self, reader: Any):
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def __getitem__(self, key: str) -> Any:
        if key not in self._fields:
            raise KeyError(f"no {key} field")
        return self._fields[key].contents()


def _hf_config(meta: _Metadata) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} (only llama is supported)")
    p = f"{arch}."
    heads = meta[p + "attention.head_count"]
    kv_heads = meta.get(p + "attention.head_count_kv", heads)
    hidden = meta[p + "embedding_length"]
    head_dim = meta.get(p + "rope.dimension_count", hidden // heads)
    tokens = meta["tokenizer.ggml.tokens"]
    # float32 in the file: 9.999999747e-06 is the 1e-05 the model was trained with.
    eps = float(f"{meta[p + 'attention.layer_norm_rms_epsilon']:.6g}")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get(p + "vocab_size", len(tokens)),
        "hidden_size": hidden, "intermediate_size": meta[p + "feed_forward_length"],
        "num_hidden_layers": meta[p + "block_count"], "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": eps,
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)), "rope_scaling": None,
        "max_position_embeddings": meta.get(p + "context_length", 2048),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if meta.get(p + "rope.scaling.type") not in (None, "none"):
        raise ValueError(f"RoPE scaling {meta.get(p + 'rope.scaling.type')!r} is not converted")
    return config


def _check_shapes(config: dict[str, Any], tensors: dict[str, Any], path: Path) -> None:
    h, d = config["hidden_size"], config["head_dim"]
    want = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        want |= {
            f"{p}.self_attn.q_proj.weight": (config["num_attention_heads"] * d, h),
            f"{p}.self_attn.k_proj.weight": (config["num_key_value_heads"] * d, h),
            f"{p}.self_attn.v_proj.weight": (config["num_key_value_heads"] * d, h),
            f"{p}.self_attn.o_proj.weight": (h, config["num_attention_heads"] * d),
            f"{p}.mlp.gate_proj.weight": (config["intermediate_size"], h),
            f"{p}.mlp.up_proj.weight": (config["intermediate_size"], h),
            f"{p}.mlp.down_proj.weight": (h, config["intermediate_size"]),
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    for name, shape in want.items():
        if name not in tensors:
            raise ModelPrepareError(f"{path}: no tensor for {name}")
        if tuple(tensors[name].shape) != shape:
            raise ModelPrepareError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, "
                                    f"expected {shape}")


def _write_tokenizer(model: PackagedModel, meta: _Metadata, out: Path) -> None:
    """tokenizer.json (byte-level BPE), tokenizer_config.json and chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta["tokenizer.ggml.model"]
    if kind != "gpt2":
        raise ModelPrepareError(f"{model.name}: tokenizer model {kind!r} is not converted "
                                "(only gpt2 byte-level BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level])
                         if model.pre_tokenizer_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # GGUF token types: 3 control (special), 4 user-defined (added, not special).
    tok.add_tokens([AddedToken(t, special=(k == 3), normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k in (3, 4)])
    tok.save(str(out / "tokenizer.json"))

    def text(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = [t for t, k in zip(tokens, types, strict=True) if k == 3]
    tok_cfg = {
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
        "bos_token": model.bos_token or text("tokenizer.ggml.bos_token_id"),
        "eos_token": model.eos_tokens[0] if model.eos_tokens else
        text("tokenizer.ggml.eos_token_id"),
        "pad_token": model.pad_token or text("tokenizer.ggml.padding_token_id"),
        "unk_token": model.unk_token or text("tokenizer.ggml.unknown_token_id"),
        "additional_special_tokens": [t for t in (model.bos_token, *model.eos_tokens)
                                      if t in special],
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length", 2048),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    if template:
        (out / "chat_template.jinja").write_text(template)


@contextlib.contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr (tqdm), or nothing."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=True)
        except ImportError:
            bar = None
    try:
        yield (lambda: bar.update(1)) if bar is not None else (lambda: None)
    finally:
        if bar is not None:
            bar.close()
