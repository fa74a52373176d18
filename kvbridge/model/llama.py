"""A Llama-architecture decoder for CPU, tensor-parallel over ``torch.distributed``.

RMSNorm, rotary embeddings, grouped-query attention over the paged KV cache,
SwiGLU MLP. Under tensor parallelism (TP) each rank holds a slice:

* attention: query heads ``[r*H/tp, (r+1)*H/tp)``; KV heads per
  ``kvbridge.tp_mapping.rank_heads`` (replicated when tp > KV heads) -- the
  same assignment the KV-transfer code assumes; ``o_proj`` is row-parallel.
* MLP: ``gate``/``up`` column-parallel, ``down`` row-parallel.
* embedding, final norm and ``lm_head`` are replicated (simplest correct choice).

Row-parallel outputs are summed with an all-reduce, so every rank ends a layer
with the full hidden state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvbridge.errors import ConfigError, UnsupportedModelError
from kvbridge.model.attention import AttentionMetadata, paged_attention
from kvbridge.tp_mapping import rank_heads


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields of a Hugging Face ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """The built-in test model: 258 byte-level tokens, works with TP 1, 2, 4 and 8."""
        return cls(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   rope_theta=10000.0, max_position_embeddings=2048)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        """The config of a Hugging Face ``config.json``; ``UnsupportedModelError`` (one line
        naming the field) for anything this engine would otherwise compute differently.

        RoPE comes in either layout: transformers 5's ``rope_parameters`` ({rope_theta,
        rope_type, scaling keys}) or the older top-level ``rope_theta`` + ``rope_scaling``.
        """
        _check_supported(d)
        heads = d["num_attention_heads"]
        theta, scaling = _rope(d)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
        )

    def to_hf(self) -> dict[str, Any]:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self)}

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ConfigError`` (a ``ValueError``) unless the model can be split ``tp_size``
        ways."""
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if tp_size < 1 or h % tp_size:
            raise ConfigError(f"{h} attention heads cannot be split over tp size {tp_size}")
        if kv % tp_size and tp_size % kv:
            raise ConfigError(f"{kv} KV heads and tp size {tp_size}: one must divide the other")
        if self.intermediate_size % tp_size:
            raise ConfigError(f"intermediate size {self.intermediate_size} cannot be split "
                              f"over tp size {tp_size}")

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        return max(1, self.num_key_value_heads // tp_size)


ROPE_TYPES = ("default", "linear", "llama3")

# Fields that change the computation when set to anything but their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "attention_bias": (None, False), "mlp_bias": (None, False),
    "sliding_window": (None,), "use_sliding_window": (None, False),
    "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "quantization_config": (None,), "partial_rotary_factor": (None, 1, 1.0),
    "hidden_act": (None, "silu"),
}


def _check_supported(d: dict[str, Any]) -> None:
    model_type = d.get("model_type")
    if model_type not in (None, "llama"):
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported (kvbridge's "
                                    "engine runs llama checkpoints)")
    archs = d.get("architectures") or []
    if any(a != "LlamaForCausalLM" for a in archs):
        raise UnsupportedModelError(f"architectures {archs} are not supported (only "
                                    "LlamaForCausalLM)")
    for key, neutral in _NEUTRAL.items():
        if d.get(key) not in neutral:
            raise UnsupportedModelError(f"{key}={d[key]!r} is not supported by kvbridge's "
                                        f"engine (it computes {key}={neutral[-1]!r})")
    layer_types = d.get("layer_types")
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise UnsupportedModelError(f"layer_types {sorted(set(layer_types))} are not "
                                    "supported (only full_attention)")


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config layout."""
    params = d.get("rope_parameters")
    top_theta, top_scaling = d.get("rope_theta"), d.get("rope_scaling")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params and "rope_type" not in \
                params:
            raise UnsupportedModelError(f"rope_parameters {params!r}: expected one "
                                        "{rope_theta, rope_type, ...} (per-layer-type RoPE is "
                                        "not supported)")
        theta = params.get("rope_theta", top_theta)
        if top_theta is not None and theta != top_theta:
            raise UnsupportedModelError(f"rope_theta {top_theta} and rope_parameters.rope_theta "
                                        f"{theta} disagree")
        where, scaling = "rope_parameters", {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, where, scaling = top_theta, "rope_scaling", top_scaling
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"{where} type {kind!r} is not supported (supported: "
                                        f"{', '.join(ROPE_TYPES)})")
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return float(10000.0 if theta is None else theta), scaling


def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and rotary angles run in at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the Hugging Face "rotate half" convention."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.register_buffer("inv_freq", _scale_inv_freq(inv_freq, config.rope_scaling),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(q.dtype)
        angles = positions.to(dtype)[:, None] * self.inv_freq.to(dtype)[None, :]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = angles.cos(), angles.sin()

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xf = x.to(dtype)
            x1, x2 = xf.chunk(2, dim=-1)
            return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

        return rotate(q), rotate(k)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by ``factor``, blend in between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        d = config.head_dim
        self.tp_size = tp_size
        self.head_dim = d
        self.num_heads = config.num_attention_heads // tp_size
        self.q_heads = range(tp_rank * self.num_heads, (tp_rank + 1) * self.num_heads)
        self.kv_heads = rank_heads(tp_rank, tp_size, config.num_key_value_heads)
        self.num_kv_heads = len(self.kv_heads)
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return _all_reduce(self.o_proj(out.reshape(t, -1)), self.tp_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp_size: int):
        super().__init__()
        self.tp_size = tp_size
        inter = config.intermediate_size // tp_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return _all_reduce(self.down_proj(h), self.tp_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


WeightGetter = Callable[[str], torch.Tensor]


class LlamaForCausalLM(nn.Module):
    """One TP rank's shard of a Llama model. Call ``load_weights`` before use."""

    def __init__(self, config: LlamaConfig, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        config.check_tp(tp_size)
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (the KV cache's head dimension)."""
        return self.layers[0].self_attn.num_kv_heads

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (after the final norm) of the new tokens, [T, hidden].

        ``kv_cache`` is this rank's whole cache, [layers, 2, blocks, heads, block_size, dim].
        """
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary, kv_cache[i], meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def load_weights(self, get: WeightGetter) -> None:
        """Copy this rank's slice of every weight, by Hugging Face name, from ``get``.

        ``get(name)`` returns the full (unsharded) tensor; the slicing is done here.
        """
        cfg, d = self.config, self.config.head_dim

        def load(param: torch.Tensor, name: str, index: Any = ...) -> None:
            value = get(name)[index]
            # copy_ would silently broadcast a wrongly shaped checkpoint tensor.
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match the "
                                 f"model's {tuple(param.shape)} (tp rank {self.tp_rank})")
            param.copy_(value)

        load(self.embed_tokens.weight, "model.embed_tokens.weight")
        load(self.norm.weight, "model.norm.weight")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        load(self.lm_head.weight, head)
        inter = cfg.intermediate_size // self.tp_size
        mlp_rows = slice(self.tp_rank * inter, (self.tp_rank + 1) * inter)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            q_rows = slice(attn.q_heads.start * d, attn.q_heads.stop * d)
            kv_rows = slice(attn.kv_heads.start * d, attn.kv_heads.stop * d)
            load(attn.q_proj.weight, f"{p}.self_attn.q_proj.weight", q_rows)
            load(attn.k_proj.weight, f"{p}.self_attn.k_proj.weight", kv_rows)
            load(attn.v_proj.weight, f"{p}.self_attn.v_proj.weight", kv_rows)
            load(attn.o_proj.weight, f"{p}.self_attn.o_proj.weight", (slice(None), q_rows))
            load(mlp.gate_proj.weight, f"{p}.mlp.gate_proj.weight", mlp_rows)
            load(mlp.up_proj.weight, f"{p}.mlp.up_proj.weight", mlp_rows)
            load(mlp.down_proj.weight, f"{p}.mlp.down_proj.weight", (slice(None), mlp_rows))
            load(layer.input_layernorm.weight, f"{p}.input_layernorm.weight")
            load(layer.post_attention_layernorm.weight, f"{p}.post_attention_layernorm.weight")
