"""``kv_transfer_params``: the prefill <-> decode contract, in one typed home.

Field names follow vLLM's NixlConnector, so vLLM's own disaggregation proxy (and any
client speaking its protocol) works unchanged: the prefill hop carries
``do_remote_decode: true`` with the other fields null, and the prefill's answer is
passed verbatim to the decode. kvbridge adds ``remote_epoch``, ``handshake_method``,
``remote_num_tokens``, ``remote_lease_ms``, ``remote_hold_key``,
``remote_output_token_ids`` and ``sent_token_ids`` (all optional).

Decoding is strict about types (``"false"`` is not a bool, ``"25600"`` and ``25600.9``
are not ports, block ids are integers >= 0) and lenient about unknown fields, which
newer vLLM versions may add. Every error is ``InvalidKVTransferParams``: the request's own
fault, a 400 that names ``kv_transfer_params``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvbridge.errors import InvalidKVTransferParams

__all__ = ["KVTransferParams", "LoadPlan"]

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
# A prompt of a million tokens in blocks of 16 is 62,500 blocks: far below this.
_BlockIds = Annotated[list[_BlockId], msgspec.Meta(max_length=1 << 20)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class KVTransferParams(msgspec.Struct, kw_only=True, frozen=True):
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: _Id | None = None
    remote_block_ids: _BlockIds | None = None
    remote_request_id: _Id | None = None
    remote_host: _Id | None = None
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    # kvbridge's own:
    remote_epoch: _Id | None = None
    handshake_method: Literal["zmq", "http", "etcd"] | None = None
    # prompt tokens whose KV the prefill computed and holds (vLLM infers it from the blocks)
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # how long the prefill holds the blocks, from its answer on: a decode gives up its
    # READs before then, so a block is never reused under a READ still in flight
    remote_lease_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # the hold's capability: a decode's READ-done and release notes (and a proxy's
    # /v1/kv/release) carry it, or the prefill ignores them
    remote_hold_key: _Id | None = None
    # the tokens the prefill sampled (its answer's first token): a proxy that streams it
    # to the client at once asks the decode to continue after it with ``sent_token_ids``
    remote_output_token_ids: Annotated[list[_TokenId], msgspec.Meta(max_length=64)] | None = None
    # output tokens the client already has (from the prefill): the decode treats them as
    # its own first outputs (sampling positions, max_tokens, usage, text) and continues
    sent_token_ids: Annotated[list[_TokenId], msgspec.Meta(max_length=64)] | None = None

    # -- decoding and encoding ---------------------------------------------------------------

    @classmethod
    def from_obj(cls, obj: Any) -> KVTransferParams | None:
        """Params from a decoded JSON value (``None`` stays ``None``)."""
        if obj is None or isinstance(obj, cls):
            return obj
        try:
            return msgspec.convert(obj, cls, strict=True)
        except msgspec.ValidationError as e:
            where = str(e).replace("$.", "kv_transfer_params.")
            raise InvalidKVTransferParams(f"invalid kv_transfer_params: {where}") from None
        except UnicodeEncodeError:
            # A lone surrogate (json.loads lets "\ud800" through): no such name or value is
            # ever valid, and msgspec cannot even look the key up.
            raise InvalidKVTransferParams(
                "invalid kv_transfer_params: a string holds a lone surrogate") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON object a response carries: every field that is set."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @classmethod
    def for_prefill(cls) -> dict[str, Any]:
        """What a proxy sends on the prefill hop: exactly vLLM's shape."""
        return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}

    # -- what a decode does with them ----------------------------------------------------------

    @property
    def loads_remote_kv(self) -> bool:
        """The decode should read the prompt's KV from a prefill (vLLM: an empty block list
        means the prefill computed no full block, so the decode computes the prompt)."""
        return self.do_remote_prefill and bool(self.remote_block_ids)

    def check(self) -> KVTransferParams:
        """Refuse combinations no engine can serve (types are checked by decoding)."""
        if self.do_remote_prefill and self.do_remote_decode:
            raise InvalidKVTransferParams(
                "invalid kv_transfer_params: do_remote_prefill and do_remote_decode are both true")
        if self.remote_block_ids and len(set(self.remote_block_ids)) != len(
                self.remote_block_ids):
            raise InvalidKVTransferParams(
                "invalid kv_transfer_params.remote_block_ids: a block id appears twice")
        if self.loads_remote_kv:
            missing = [name for name in ("remote_engine_id", "remote_host", "remote_port")
                       if getattr(self, name) is None]
            if missing:
                raise InvalidKVTransferParams(
                    f"invalid kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
        return self

    def plan_load(self, num_prompt_tokens: int, block_size: int) -> LoadPlan:
        """Which prompt tokens a decode may treat as loaded once its READs finish.

        Never more than the blocks cover: a list shorter than the prompt loads what is
        there and the rest is computed locally; a list longer than the prompt needs, or a
        token count beyond the prompt or the blocks, names another prompt: refused.
        """
        blocks = self.remote_block_ids or []
        needed = -(-num_prompt_tokens // block_size)
        if len(blocks) > needed:
            raise InvalidKVTransferParams(
                f"invalid kv_transfer_params.remote_block_ids: {len(blocks)} blocks for a "
                f"prompt of {num_prompt_tokens} tokens, which needs at most {needed} of {block_size} "
                "tokens (the params belong to another prompt?)")
        covered = min(len(blocks) * block_size, num_prompt_tokens)
        n = self.remote_num_tokens
        if n is not None:
            if n > num_prompt_tokens:
                raise InvalidKVTransferParams(
                    f"invalid kv_transfer_params.remote_num_tokens: {n} tokens computed for a "
                    f"prompt of {num_prompt_tokens} (the params belong to another prompt?)")
            if n > covered:
                raise InvalidKVTransferParams(
                    f"invalid kv_transfer_params.remote_num_tokens: {n} tokens but "
                    f"remote_block_ids hold at most {covered}")
            covered = n
        # Read only the blocks that hold covered tokens.
        return LoadPlan(num_tokens=covered, num_blocks=-(-covered // block_size))


class LoadPlan(msgspec.Struct, frozen=True):
    """``num_tokens`` prompt tokens arrive in the first ``num_blocks`` remote blocks."""

    num_tokens: int
    num_blocks: int
