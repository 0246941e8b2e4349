"""Attention over a paged KV cache for a flat batch of tokens from many sequences.

KV cache layout, one tensor for the whole model:
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)
A token at position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`; its flat slot is `block_id * block_size + offset`.

The flat batch puts the decode tokens (sequences computing exactly one new token) first, then the
prefill chunks (sequences computing several tokens, possibly a chunk of a longer prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """A sequence computing `query_len` tokens this step: flat rows [token_start, token_start+query_len).

    Those tokens sit at positions [context_len - query_len, context_len); every earlier position
    already has K/V in the cache, reachable through `block_table`.
    """

    token_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot where each token's K/V is written
    num_decode_tokens: int  # rows [0, num_decode_tokens) are decodes, one per sequence
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decode_tokens] int64: tokens in context incl. the new one
    prefills: tuple[PrefillSeq, ...]  # the remaining rows, in order
