"""The model runner: turns a scheduled step into one flat forward pass and samples the next tokens.

What lives across steps (block tables, penalty counts) is kept in the persistent batch
(engine/worker/input_batch.py), so building a step's inputs costs a few list operations per request and a
handful of tensor copies, not padded matrices rebuilt from every request's lists. On CUDA, the step's
integer inputs go through one pinned host buffer and non-blocking copies (`HostStaging`).
"""

from __future__ import annotations

import torch

from engine.core.outputs import RunnerOutput
from engine.core.request import Request, TokenLogprob
from engine.core.scheduler import SchedulerOutput
from engine.lora.batch import LoraBatch
from engine.lora.device_tier import DeviceAdapterTier
from engine.model.attention import AttentionMetadata, PrefillSeq
from engine.model.llama import LlamaForCausalLM
from engine.worker.input_batch import InputBatch
from engine.worker.sampler import Sampler
from kernels import lora_backend

NON_FINITE_LOGITS = ("the model computed non-finite logits (NaN or inf) for this request; its adapter's "
                     "weights are the usual cause")
NO_TOKEN_LEFT = ("no token had a finite, non-zero probability after min_tokens, stop_token_ids and the "
                 "penalties were applied")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler, device: torch.device, adapters: DeviceAdapterTier | None = None,
                 max_num_seqs: int = 128, max_model_len: int | None = None) -> None:
        self.model = model
        self.adapters = adapters
        self.kv_cache = kv_cache  # [num_layers, num_pages, 2, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.lora_backend = lora_backend(device)  # "torch" (CPU) or "triton" (CUDA), kernels/__init__.py
        max_len = max_model_len or model.config.max_position_embeddings
        self.batch = InputBatch(max_num_seqs, -(-max_len // block_size), model.config.vocab_size, device)
        self.staging = HostStaging(device) if device.type == "cuda" else None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Compute one step and sample a token for every request whose known tokens are all computed.

        A row whose logits are not finite (a broken adapter, an overflow) fails its own request in
        `RunnerOutput.errors` instead of sampling a garbage token; the other rows are unaffected (rows
        never mix: attention stays within a sequence, LoRA within a segment).
        """
        if self.staging is not None:
            self.staging.begin_step()
        slots = [self._slot(r) for r in batch.requests]
        order = self._batch_order(batch, slots)
        requests = [batch.requests[i] for i in order]
        num_tokens = [batch.num_tokens[i] for i in order]
        rows = self.batch.sync(requests)
        input_ids, positions, attn, last_rows, sample_idx = self._prepare(requests, num_tokens, rows)
        lora = self._lora_segments([slots[i] for i in order], num_tokens)
        hidden = self.model(input_ids, positions, self.kv_cache, attn, lora)  # [T, hidden]
        sampled: list[int | None] = [None] * len(order)
        logprobs: list[TokenLogprob | None] = [None] * len(order)
        errors: dict[int, str] = {}
        if sample_idx:
            logits = self.model.compute_logits(hidden[last_rows])  # [S, vocab]
            # A row's sum is finite exactly when all its logits are (they are far below overflow).
            finite = torch.isfinite(logits.sum(dim=-1)).tolist()  # [S]
            for j in (j for j, ok in enumerate(finite) if not ok):
                errors[order[sample_idx[j]]] = NON_FINITE_LOGITS
            good = [j for j, ok in enumerate(finite) if ok]
            if len(good) < len(finite):
                logits = logits[good]
            if good:
                chosen = [sample_idx[j] for j in good]
                out = self.sampler(logits.float(), [requests[i] for i in chosen],
                                   BatchTables(self.batch, [rows[i] for i in chosen]))
                vocab = logits.shape[1]
                for j, token, logprob in zip(good, out.token_ids, out.logprobs):
                    i = order[sample_idx[j]]
                    if not 0 <= token < vocab:  # every token had probability 0 (or NaN) after masking
                        errors[i] = NO_TOKEN_LEFT
                        continue
                    sampled[i] = token
                    logprobs[i] = logprob
        return RunnerOutput(sampled, logprobs, errors)

    def _slot(self, request: Request) -> int | None:
        if request.adapter is None:
            return None
        slot = self.adapters.slot_of(request.adapter)
        assert slot is not None, "a running request's adapter is pinned on the device"
        return slot

    @staticmethod
    def _batch_order(batch: SchedulerOutput, slots: list[int | None]) -> list[int]:
        """Decodes (one token) first, then prefill chunks, as AttentionMetadata requires; within each,
        rows grouped by adapter slot so every adapter forms as few segments as possible."""
        def key(i: int) -> int:
            return -1 if slots[i] is None else slots[i]
        decodes = sorted((i for i, n in enumerate(batch.num_tokens) if n == 1), key=key)
        prefills = sorted((i for i, n in enumerate(batch.num_tokens) if n != 1), key=key)
        return decodes + prefills

    def _lora_segments(self, slots: list[int | None], num_tokens: list[int]) -> LoraBatch | None:
        """Segments tiling the batch: consecutive requests with the same slot merge; rows without an
        adapter use the tier's null slot (rank 0 everywhere). None when no row has an adapter."""
        if all(slot is None for slot in slots):
            return None
        null = self.adapters.null_slot
        starts = [0]
        seg_slots: list[int] = []
        for slot, n in zip(slots, num_tokens):
            slot = null if slot is None else slot
            if seg_slots and seg_slots[-1] == slot:
                starts[-1] += n
            else:
                seg_slots.append(slot)
                starts.append(starts[-1] + n)
        plan = None
        if self.lora_backend == "triton":  # the step's row tiles, once for every layer and group
            from kernels.sgmv import plan_segments

            plan = plan_segments(starts, seg_slots, self.device, skip_slot=null)
        return LoraBatch(starts, seg_slots, self.adapters.weights, plan)

    def _prepare(self, requests: list[Request], num_tokens: list[int], rows: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        bs = self.block_size
        token_ids: list[int] = []
        pos_list: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []  # the row whose logits give each sampling request its next token
        sample_idx: list[int] = []  # which requests sample this step
        decode_rows: list[int] = []  # persistent-batch rows of the decodes
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for i, (request, n) in enumerate(zip(requests, num_tokens)):
            start = request.num_computed_tokens
            end = start + n
            blocks = request.block_ids
            if n == 1:  # a decode (batch order puts them first): one token, one slot
                if end == request.num_tokens:
                    last_rows.append(len(token_ids))
                    sample_idx.append(i)
                token_ids.append(_token_at(request, start))
                pos_list.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
                decode_rows.append(rows[i])
                decode_lens.append(end)
                continue
            row = len(token_ids)
            token_ids.extend(request.token_ids(start, end))
            pos_list.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if end == request.num_tokens:
                last_rows.append(row + n - 1)
                sample_idx.append(i)
            table = self._tensor(blocks[: -(-end // bs)])
            prefills.append(PrefillSeq(row, n, end, table))
        width = -(-max(decode_lens, default=0) // bs)
        attn = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self.batch.decode_tables(decode_rows, width),
            decode_context_lens=self._tensor(decode_lens),
            prefills=tuple(prefills),
        )
        inputs = (self._tensor(token_ids), self._tensor(pos_list), attn, self._tensor(last_rows), sample_idx)
        if self.staging is not None:
            self.staging.end_step()
        return inputs

    def _tensor(self, values: list[int]) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.stage(values)
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _token_at(request: Request, position: int) -> int:
    """The token at `position` of prompt + outputs."""
    n = len(request.prompt_token_ids)
    return request.prompt_token_ids[position] if position < n else request.output_token_ids[position - n]


class BatchTables:
    """The sampler's TokenTables (engine/worker/sampler.py) for rows of the persistent batch."""

    def __init__(self, batch: InputBatch, rows: list[int]) -> None:
        self.batch, self.rows = batch, rows

    def output_counts(self, index: list[int]) -> torch.Tensor:
        return self.batch.output_counts([self.rows[i] for i in index])

    def seen(self, index: list[int]) -> torch.Tensor:
        return self.batch.seen([self.rows[i] for i in index])


class HostStaging:
    """CUDA: a step's integer inputs are written into one pinned host buffer and copied to the device without
    blocking the host. Regions are handed out in order within a step and reused from the start at the next one,
    once the copies of the step before are done (an event recorded after them). (On a CPU device it only
    hands out regions, which is how its bookkeeping is tested without a GPU.)"""

    def __init__(self, device: torch.device, size: int = 1 << 16) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffer = self._new_buffer(size)
        self._used = 0
        self._copied: torch.cuda.Event | None = None

    def _new_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.long, pin_memory=self._cuda)

    def begin_step(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._used = 0

    def end_step(self) -> None:
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    def stage(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        if self._used + n > self._buffer.numel():  # a bigger buffer for the rest of this step; the old one
            self._buffer = self._new_buffer(2 * (self._used + n))  # lives on while its copies are in flight
            self._used = 0
        host = self._buffer[self._used:self._used + n]
        self._used += n
        host.copy_(torch.tensor(values, dtype=torch.long))
        return host.to(self.device, non_blocking=True)
