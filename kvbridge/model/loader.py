"""Build a model shard: the built-in tiny model, or a local Hugging Face checkpoint directory.

A checkpoint directory holds ``config.json``, ``*.safetensors`` (HF weight
names), ``tokenizer.json`` and optionally ``tokenizer_config.json`` and
``generation_config.json``. Weights are read whole and sliced for the TP rank
as they are copied in (``LlamaForCausalLM.load_weights``).

``model=None`` everywhere means the built-in tiny model: fixed-seed random
weights and the byte-level tokenizer. ``write_tiny_checkpoint`` writes that same
model as a checkpoint directory, so tests can exercise the real loader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvbridge.model.llama import LlamaConfig, LlamaForCausalLM
from kvbridge.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}

# Equivalent to the default chat template (see kvbridge.model.tokenizer), in Jinja.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_config(model: str | Path | None) -> LlamaConfig:
    if model is None:
        return LlamaConfig.tiny()
    path = Path(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model}: no config.json (expected a local Hugging Face "
                                "checkpoint directory)")
    return LlamaConfig.from_hf(json.loads(path.read_text()))


def load_tokenizer(model: str | Path | None) -> Tokenizer:
    return ByteTokenizer() if model is None else HFTokenizer(model)


def load_model(model: str | Path | None, tp_rank: int = 0, tp_size: int = 1,
               dtype: str | torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """Rank ``tp_rank``'s shard of the model; ``seed`` only matters for the tiny model."""
    config = load_config(model)
    net = LlamaForCausalLM(config, tp_rank, tp_size, resolve_dtype(dtype))
    if model is None:
        weights = tiny_weights(config, seed)
        net.load_weights(weights.__getitem__)
    else:
        net.load_weights(_SafetensorsDir(Path(model)).get)
    return net


def tiny_weights(config: LlamaConfig | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) float32 weights under Hugging Face names, from a fixed seed.

    Projections are scaled by 1/sqrt(fan_in) so activations stay O(1), and the
    head gives logits of O(1) spread, so greedy decoding wanders a little
    rather than repeating one token.
    """
    cfg = config or LlamaConfig.tiny()
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def randn(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    w = {"model.embed_tokens.weight": randn(cfg.vocab_size, h, 1.0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = randn(q_out, h, 2 / math.sqrt(h))
        w[f"{p}.self_attn.k_proj.weight"] = randn(kv_out, h, 2 / math.sqrt(h))
        w[f"{p}.self_attn.v_proj.weight"] = randn(kv_out, h, 1 / math.sqrt(h))
        w[f"{p}.self_attn.o_proj.weight"] = randn(h, q_out, 1 / math.sqrt(q_out))
        w[f"{p}.mlp.gate_proj.weight"] = randn(inter, h, 1 / math.sqrt(h))
        w[f"{p}.mlp.up_proj.weight"] = randn(inter, h, 1 / math.sqrt(h))
        w[f"{p}.mlp.down_proj.weight"] = randn(h, inter, 1 / math.sqrt(inter))
        w[f"{p}.input_layernorm.weight"] = norm()
        w[f"{p}.post_attention_layernorm.weight"] = norm()
    w["model.norm.weight"] = norm()
    if not cfg.tie_word_embeddings:
        head = randn(cfg.vocab_size, h, 3 / math.sqrt(h))
        if cfg.vocab_size == 258:  # byte vocabulary: favour letters so samples look like text
            scale = torch.full((cfg.vocab_size, 1), 0.6)
            scale[[*range(ord("a"), ord("z") + 1), ord(" ")]] = 1.6
            head = head * scale
        w["lm_head.weight"] = head
    return w


def write_tiny_checkpoint(path: str | Path, seed: int = 0,
                          chat_template: str | None = TINY_CHAT_TEMPLATE) -> Path:
    """Write the tiny model (weights of ``seed``) as a Hugging Face checkpoint directory.

    The tokenizer is a byte-level BPE built with ``tokenizers`` whose ids equal
    the built-in ``ByteTokenizer``'s, so both give identical token ids.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig.tiny()
    (path / "config.json").write_text(json.dumps(
        {**config.to_hf(), "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32"},
        indent=2))
    save_file(tiny_weights(config, seed), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    _byte_level_hf_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 2048}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return path


class _SafetensorsDir:
    """Tensors by name across every ``*.safetensors`` file of a directory."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no weight {name!r}")
        return self._where[name].get_tensor(name)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as ``ByteLevel`` pre-tokenizers use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_hf_tokenizer():
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTok

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)])
    return tok
