"""A request's state inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.engine.sampling import SamplingParams
from kvbridge.errors import LoadFailure
from kvbridge.kv_tags import TagChain
from kvbridge.params import KVTransferParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # ready to prefill once blocks are free
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # a connector is loading its prompt's KV
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, its blocks, and how much of it is already in the KV cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 seed: int, kv_transfer_params: KVTransferParams | None = None,
                 sent_token_ids: list[int] | None = None):
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        # Output tokens the client already has (the prefill sampled them): they count as
        # this request's first outputs, and generation continues after them.
        self.num_sent_tokens = len(sent_token_ids or ())
        self.token_ids = list(prompt_token_ids) + list(sent_token_ids or ())
        self.sampling = sampling
        self.seed = seed
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []
        # Tokens whose KV is in the cache: the next forward computes the rest.
        self.num_cached_tokens = 0
        self.num_remote_tokens = 0  # promised by the connector
        self.prefix_cached_tokens: int | None = None  # num_cached_tokens at the first prefill
        self.tag_chain: TagChain | None = None  # block tags, when the connector wants them
        self.aborted = False  # abort requested while a remote load writes into our blocks
        # When each phase before the first token began (time.monotonic()): "arrived",
        # "load_started", "kv_loaded", "scheduled"; see ``RequestOutput.times``.
        self.times: dict[str, float] = {}

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")


@dataclass
class RequestOutput:
    """News about one request from one engine step.

    ``finish_reason``: "stop" (EOS), "length" (max_tokens or max_model_len),
    "abort", or "error" (then ``error`` says why: its KV load failed). ``kv_transfer_params`` is
    what the connector's ``on_finished`` returned, on the final output only.
    ``num_cached_tokens``: prompt tokens whose KV was not computed here
    (loaded by the connector).
    """

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: LoadFailure | None = None
    kv_transfer_params: KVTransferParams | None = None
    num_cached_tokens: int = 0
    # On the output with the first token only: the request's phase start times (see
    # ``Sequence.times``) and "first_token", all time.monotonic().
    times: dict[str, float] | None = None
