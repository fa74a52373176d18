"""Small Llama checkpoints with random weights, for tests whose point is the KV layout,
not the text: heterogeneous tensor parallelism needs KV heads that every TP size divides
(SmolLM2-135M has 3). The tokenizer is SmolLM2's, copied from the prepared model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def random_llama(dst: str | Path, tokenizer_from: str | Path, *, kv_heads: int = 2,
                 heads: int = 4, head_dim: int = 64, layers: int = 2,
                 intermediate: int = 512, seed: int = 0) -> Path:
    """Write a float32 ``LlamaForCausalLM`` checkpoint with random weights to ``dst``.
    ``kv_heads`` and ``heads`` divide by every TP size the caller runs. Deterministic for
    one ``seed``, so every process that loads it computes the same text."""
    import torch
    from safetensors.torch import save_file

    src = Path(tokenizer_from)
    cfg = json.loads((src / "config.json").read_text())
    hidden = heads * head_dim
    cfg.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               max_position_embeddings=2048)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    vocab = cfg["vocab_size"]
    tensors = {"model.embed_tokens.weight": w(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(intermediate, hidden),
            p + "mlp.up_proj.weight": w(intermediate, hidden),
            p + "mlp.down_proj.weight": w(hidden, intermediate),
        })
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out
