"""The reference Llama model: paged attention, cached prefixes, TP sharding, checkpoint I/O."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.engine import EngineConfig, LLMEngine, SamplingParams
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.model import (
    AttentionMetadata,
    ByteTokenizer,
    HFTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    SeqChunk,
    load_config,
    load_model,
    load_tokenizer,
    tiny_weights,
    write_tiny_checkpoint,
)
from kvbridge.model.llama import UnsupportedModelError
from kvbridge.model.loader import TINY_CHAT_TEMPLATE
from kvbridge.tp_mapping import rank_heads

PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog", "x",
           "ünïcödé → 漢字 and more text to make a prompt longer than one block of KV"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # A tiny model only pays for thread hand-offs (as the engine's workers do, too).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _model(dtype: torch.dtype = torch.float64, seed: int = 0) -> LlamaForCausalLM:
    return load_model(None, dtype=dtype, seed=seed)


def _cache(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    c = model.config
    return allocate_kv_cache(c.num_hidden_layers, num_blocks, model.num_kv_heads, block_size,
                             c.head_dim, model.dtype)


def _logits(model: LlamaForCausalLM, cache: torch.Tensor, chunks: list[SeqChunk],
            block_size: int) -> torch.Tensor:
    """Logits of every new token of every chunk, [T, vocab]."""
    meta = AttentionMetadata.build(chunks, block_size)
    ids = torch.tensor([t for c in chunks for t in c.token_ids])
    pos = torch.tensor([c.start_pos + i for c in chunks for i in range(len(c.token_ids))])
    return model.compute_logits(model(ids, pos, cache, meta))


# -- paged attention and cached prefixes ---------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(length=st.integers(2, 40), data=st.data(), block_size=st.sampled_from([1, 4, 16]))
def test_prefill_after_cached_prefix_matches_full_prefill(length, data, block_size):
    model = _model()
    split = data.draw(st.integers(1, length - 1), label="num_cached_tokens")
    tokens = data.draw(st.lists(st.integers(0, 257), min_size=length, max_size=length))
    num_blocks = -(-length // block_size)
    # Scattered, out-of-order blocks: the paging must not rely on contiguity.
    table = data.draw(st.permutations(range(2 * num_blocks + 3)))[:num_blocks]
    full = _logits(model, _cache(model, 2 * num_blocks + 3, block_size),
                   [SeqChunk(tokens, 0, table)], block_size)
    cache = _cache(model, 2 * num_blocks + 3, block_size)
    _logits(model, cache, [SeqChunk(tokens[:split], 0, table)], block_size)
    rest = _logits(model, cache, [SeqChunk(tokens[split:], split, table)], block_size)
    torch.testing.assert_close(rest, full[split:], rtol=0, atol=1e-10)


def test_batched_prefill_and_decode_match_single_sequences():
    model, bs = _model(), 4
    tok = ByteTokenizer()
    seqs = [tok.encode(p + "...") for p in PROMPTS]
    cache = _cache(model, 64, bs)
    tables, next_block = [], 0
    for s in seqs:
        n = -(-(len(s) + 3) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    # Batched: prefill all but the last 3 tokens together, then 3 batched decode steps.
    _logits(model, cache, [SeqChunk(s[:-3], 0, t) for s, t in zip(seqs, tables, strict=True)], bs)
    batched = []
    for k in range(3, 0, -1):
        chunks = [SeqChunk([s[-k]], len(s) - k, t) for s, t in zip(seqs, tables, strict=True)]
        batched.append(_logits(model, cache, chunks, bs))
    for i, (s, t) in enumerate(zip(seqs, tables, strict=True)):
        alone = _logits(model, _cache(model, 64, bs), [SeqChunk(s, 0, t)], bs)
        got = torch.stack([b[i] for b in batched])
        torch.testing.assert_close(got, alone[-3:], rtol=0, atol=1e-10)


def test_attention_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([SeqChunk([1, 2, 3, 4, 5], 0, [0])], 4)


# -- tensor parallelism --------------------------------------------------------------------

def test_kv_heads_follow_the_tp_mapping_contract():
    full = load_model(None, dtype=torch.float64)
    cfg, d = full.config, full.config.head_dim
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            shard = load_model(None, rank, tp, dtype=torch.float64)
            heads = rank_heads(rank, tp, cfg.num_key_value_heads)
            assert shard.num_kv_heads == len(heads) == max(1, 4 // tp)
            for name in ("k_proj", "v_proj"):
                got = getattr(shard.layers[0].self_attn, name).weight
                want = getattr(full.layers[0].self_attn, name).weight
                assert torch.equal(got, want[heads.start * d:heads.stop * d])
            q_rows = cfg.num_attention_heads // tp * d
            assert torch.equal(shard.layers[0].self_attn.q_proj.weight,
                               full.layers[0].self_attn.q_proj.weight[rank * q_rows:
                                                                      (rank + 1) * q_rows])


@pytest.mark.parametrize("tp", [3, 16])
def test_unsplittable_tp_sizes_are_rejected(tp):
    with pytest.raises(ValueError):
        LlamaConfig.tiny().check_tp(tp)


@pytest.fixture(scope="module")
def tp_engines() -> Iterator[dict[int, LLMEngine]]:
    def start(tp: int) -> LLMEngine:
        return LLMEngine(EngineConfig(tp_size=tp, dtype="float64", num_blocks=64))

    with ThreadPoolExecutor() as pool:  # the worker processes start in parallel
        engines = dict(zip((1, 2, 4), pool.map(start, (1, 2, 4)), strict=True))
    yield engines
    for e in engines.values():
        e.shutdown()


def test_tp_sizes_give_the_same_logits_and_tokens(tp_engines):
    tok = ByteTokenizer()
    ids = tok.encode(PROMPTS[3])
    ref = tp_engines[1].collective_rpc("score", ids)[0]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    ref_tokens = tp_engines[1].generate(PROMPTS, sampling)
    for tp in (2, 4):
        per_rank = tp_engines[tp].collective_rpc("score", ids)
        assert len(per_rank) == tp
        for logits in per_rank:  # replicated lm_head: every rank ends with the same logits
            torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)
        assert tp_engines[tp].generate(PROMPTS, sampling) == ref_tokens


# -- checkpoints and tokenizers ------------------------------------------------------------

def test_checkpoint_round_trip_through_the_loader(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=7)
    loaded, direct = load_model(path), load_model(None, seed=7)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), direct.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(direct.lm_head.weight, load_model(None, seed=8).lm_head.weight)
    ids = ByteTokenizer().encode(PROMPTS[1])
    bs = 16
    got = _logits(loaded, _cache(loaded, 8, bs), [SeqChunk(ids, 0, [3, 1, 5])], bs)
    want = _logits(direct, _cache(direct, 8, bs), [SeqChunk(ids, 0, [3, 1, 5])], bs)
    assert torch.equal(got, want)
    # Sharding happens at load time, from the full checkpoint tensors.
    for rank in range(2):
        a = load_model(path, rank, 2).state_dict()
        b = load_model(None, rank, 2, seed=7).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_engine_matches_builtin_model(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path))) as from_disk, LLMEngine() as builtin:
        assert isinstance(from_disk.tokenizer, HFTokenizer)
        assert from_disk.generate(PROMPTS, sampling) == builtin.generate(PROMPTS, sampling)


def test_hf_tokenizer_matches_byte_tokenizer(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    hf = load_tokenizer(ckpt)
    byte = load_tokenizer(None)
    for text in [*PROMPTS, "", "  leading spaces\nand\ttabs"]:
        assert hf.encode(text) == byte.encode(text)
        assert hf.encode(text, add_special_tokens=False) == byte.encode(text, False)
        assert hf.decode(byte.encode(text)) == text == byte.decode(byte.encode(text))
    assert (hf.bos_token_id, hf.eos_token_ids) == (byte.bos_token_id, byte.eos_token_ids)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                             {"type": "text", "text": "there"}]}]
    # The checkpoint's Jinja template (its tokenizer_config.json's, not the built-in
    # default) and the default render the same prompt; the template writes the BOS token.
    assert hf.chat_template == TINY_CHAT_TEMPLATE and byte.chat_template is None
    assert hf.apply_chat_template(messages) == hf.bos_token + byte.apply_chat_template(messages)
    assert hf.encode_chat(messages) == byte.encode_chat(messages)
    assert byte.apply_chat_template(messages) == \
        "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"
    # chat_template.jinja wins over tokenizer_config.json, and jinja2 renders it: a loop
    # variable, a filter and the BOS token, which no fallback would produce.
    (ckpt / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ loop.index }}:{{ m['role'] | upper }}="
        "{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    jinja = load_tokenizer(ckpt)
    assert jinja.chat_template == (ckpt / "chat_template.jinja").read_text()
    assert jinja.apply_chat_template(messages) == "<s>1:SYSTEM=be brief;2:USER=hi there;>"
    assert jinja.apply_chat_template(messages, add_generation_prompt=False).endswith(";")


def test_llama3_rope_scaling_only_changes_low_frequencies():
    base = LlamaConfig.tiny()
    scaled = LlamaConfig.from_hf({**base.to_hf(), "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    a = LlamaForCausalLM(base).rotary.inv_freq
    b = LlamaForCausalLM(scaled).rotary.inv_freq
    assert a[0] == b[0]  # the highest frequency is kept
    assert b[-1] == pytest.approx(a[-1] / 8)  # the lowest is divided by the factor
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf({**base.to_hf(), "rope_scaling": {"type": "yarn", "factor": 2.0}})


# -- real checkpoints: both RoPE layouts, templates, stop tokens, refused fields -------------

def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()


def test_rope_theta_is_read_from_either_layout(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    # transformers 5 writes RoPE under rope_parameters, with no top-level rope_theta.
    _edit_config(path, rope_theta=_DROP, rope_scaling=_DROP,
                 rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    cfg = load_config(path)
    assert (cfg.rope_theta, cfg.rope_scaling) == (100000.0, None)
    _edit_config(path, rope_parameters=_DROP, rope_theta=500000.0, rope_scaling=None)
    assert load_config(path).rope_theta == 500000.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    _edit_config(path, rope_theta=_DROP, rope_parameters={"rope_theta": 5e5, **llama3})
    new = load_config(path)
    _edit_config(path, rope_parameters=_DROP, rope_theta=5e5, rope_scaling=llama3)
    old = load_config(path)
    assert new == old and new.rope_scaling["rope_type"] == "llama3"
    assert torch.equal(LlamaForCausalLM(new).rotary.inv_freq,
                       LlamaForCausalLM(old).rotary.inv_freq)


def test_the_rope_base_changes_the_answer(tmp_path):
    """The base is not cosmetic: reading 10000 for a 100000 model changes the logits."""
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_config(path, rope_theta=_DROP, rope_parameters={"rope_theta": 100000.0})
    ids = ByteTokenizer().encode(PROMPTS[1])
    a, b = load_model(path), load_model(None)
    assert not torch.allclose(_logits(a, _cache(a, 8, 16), [SeqChunk(ids, 0, [0, 1, 2])], 16),
                              _logits(b, _cache(b, 8, 16), [SeqChunk(ids, 0, [0, 1, 2])], 16))


@pytest.mark.parametrize("changes, named", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
    ({"rope_theta": _DROP, "rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic"}},
     "rope_parameters type 'dynamic'"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}, "disagree"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unsupported_config_fields_are_refused_by_name(tmp_path, changes, named):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_config(path, **changes)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_neutral_values_of_those_fields_are_accepted(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    _edit_config(path, attention_bias=False, mlp_bias=False, sliding_window=None,
                 hidden_act="silu", layer_types=["full_attention"] * 2, pretraining_tp=1)
    assert load_config(path) == LlamaConfig.tiny()


def test_tied_embeddings_share_the_input_embedding(tmp_path):
    from safetensors.torch import save_file

    path = write_tiny_checkpoint(tmp_path / "ckpt")
    config = dataclasses.replace(LlamaConfig.tiny(), tie_word_embeddings=True)
    weights = tiny_weights(config)
    assert "lm_head.weight" not in weights
    save_file(weights, str(path / "model.safetensors"))
    _edit_config(path, tie_word_embeddings=True)
    for rank in range(2):
        model = load_model(path, rank, 2)
        assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")  # tokenizer_config.json has a template
    old = load_tokenizer(path)
    (path / "chat_template.jinja").write_text(CHATML)
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == CHATML != old.chat_template
    assert tok.apply_chat_template(messages) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The template writes every special token itself: no BOS is added in front.
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages), False)


def test_a_checkpoint_template_is_never_replaced_by_the_default(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", chat_template=None)
    (path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="no system role"):
        load_tokenizer(path).apply_chat_template([{"role": "user", "content": "x"}])
    bare = write_tiny_checkpoint(tmp_path / "bare", chat_template=None)
    assert load_tokenizer(bare).chat_template is None  # only then: the default
    assert load_tokenizer(bare).apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|user|>\nx\n<|assistant|>\n"


def test_stop_tokens_come_from_every_config_file(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    assert load_tokenizer(path).eos_token_ids == {257}
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 10]}))
    assert load_tokenizer(path).eos_token_ids == {257, 10}
    # A turn-ending token named only in tokenizer_config.json stops generation too.
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<s>"}))
    assert load_tokenizer(path).eos_token_ids == {256, 257, 10}
