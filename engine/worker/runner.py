"""The model runner: turns a scheduled step into one flat forward pass and samples the next tokens.

What lives across steps (block tables, penalty counts) is kept in the persistent batch
(engine/worker/input_batch.py), so building a step's inputs costs a few list operations per request, not padded
matrices rebuilt from every request's lists. A step's integer inputs are packed into one tensor (on CUDA through
a pinned host buffer and one non-blocking copy, `HostStaging`): at a few running requests, each small tensor
built costs about as much as the rest of the step's bookkeeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.core.outputs import RunnerOutput
from engine.core.request import Request, TokenLogprob
from engine.core.scheduler import SchedulerOutput
from engine.lora.batch import LoraBatch
from engine.lora.device_tier import DeviceAdapterTier
from engine.model.attention import AttentionMetadata, PrefillSeq
from engine.model.llama import LlamaForCausalLM
from engine.worker.input_batch import InputBatch
from engine.worker.sampler import NON_FINITE, RowTables, Sampler
from kernels import lora_backend

NON_FINITE_LOGITS = ("the model computed non-finite logits (NaN or inf) for this request; its adapter's "
                     "weights are the usual cause")
NO_TOKEN_LEFT = ("no token had a finite, non-zero probability after min_tokens, stop_token_ids and the "
                 "penalties were applied")


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None  # [S] int64: the rows whose logits are sampled; None: every row, in order
    sample_idx: list[int]  # [S]: the requests (in batch order) that sample this step


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

    def execute(self, batch: SchedulerOutput, interrupt: threading.Event | None = None) -> RunnerOutput:
        """Compute one step and sample a token for every request whose known tokens are all computed.

        A row whose logits are not finite (a broken adapter, an overflow) fails its own request in
        `RunnerOutput.errors` instead of sampling a garbage token; the other rows are unaffected (rows
        never mix: attention stays within a sequence, LoRA within a segment).

        Runs in inference mode. The engine thread stays in it for its whole loop (engine/core/async_engine.py):
        entering it costs about as much as building the step's inputs at one running request.

        `interrupt`, when set during the forward pass, ends it between two layers (engine/model/llama.py's
        StepInterrupted propagates; nothing is sampled, so the step can be run again as it was).
        """
        if torch.is_inference_mode_enabled():
            return self._execute(batch, interrupt)
        with torch.inference_mode():
            return self._execute(batch, interrupt)

    def _execute(self, batch: SchedulerOutput, interrupt: threading.Event | None) -> RunnerOutput:
        slots = [self._slot(r) for r in batch.requests]
        order = self._batch_order(batch, slots)
        requests = [batch.requests[i] for i in order]
        num_tokens = [batch.num_tokens[i] for i in order]
        rows = self.batch.sync(requests)
        step = self._prepare(requests, num_tokens, rows)
        lora = self._lora_segments([slots[i] for i in order], num_tokens)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.attn, lora, interrupt)  # [T, hidden]
        sampled: list[int | None] = [None] * len(order)
        logprobs: list[TokenLogprob | None] = [None] * len(order)
        errors: dict[int, str] = {}
        if step.sample_idx:
            if step.sample_rows is not None:
                hidden = hidden[step.sample_rows]
            logits = self.model.compute_logits(hidden)  # [S, vocab]
            out = self.sampler(logits, [requests[i] for i in step.sample_idx],
                               RowTables(self.batch, [rows[i] for i in step.sample_idx]))
            for i, token, logprob in zip(step.sample_idx, out.token_ids, out.logprobs):
                if token >= 0:
                    sampled[order[i]], logprobs[order[i]] = token, logprob
                else:
                    errors[order[i]] = NON_FINITE_LOGITS if token == NON_FINITE else NO_TOKEN_LEFT
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
        if all(n == 1 for n in batch.num_tokens) and all(slot is None for slot in slots):
            return list(range(len(slots)))  # decodes of the base model: any order is that order
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

    def _prepare(self, requests: list[Request], num_tokens: list[int], rows: list[int]) -> StepInputs:
        """The step's inputs. Every integer input is written into one list and becomes one tensor (one copy
        to the device on CUDA); the tensors the model reads are views of it."""
        bs = self.block_size
        token_ids: list[int] = []
        pos_list: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []  # the row whose logits give each sampling request its next token
        sample_idx: list[int] = []  # which requests sample this step
        decode_rows: list[int] = []  # persistent-batch rows of the decodes
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, list[int]]] = []  # token_start, query_len, context_len, blocks
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
            prefills.append((row, n, end, blocks[: -(-end // bs)]))
        num = len(token_ids)
        packed = token_ids + pos_list + slots + decode_lens + decode_rows + last_rows
        for *_, table in prefills:
            packed += table
        flat = self._tensor(packed)
        num_decodes = len(decode_lens)
        parts = flat.split([num, num, num, num_decodes, num_decodes, len(last_rows), *(len(p[3]) for p in prefills)])
        input_ids, positions, slot_mapping, context_lens, table_rows, last = parts[:6]
        if flat.device.type != "cpu":  # the block tables are kept on the host
            table_rows = torch.tensor(decode_rows, dtype=torch.long)
        width = -(-max(decode_lens, default=0) // bs)
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=self.batch.decode_tables(table_rows, width),
            decode_context_lens=context_lens,
            prefills=tuple(PrefillSeq(row, n, end, table) for (row, n, end, _), table in zip(prefills, parts[6:])),
        )
        # In a step of decodes only, every row is sampled, in order: the logits need no gather.
        sample_rows = None if len(last_rows) == num else last
        return StepInputs(input_ids, positions, attn, sample_rows, sample_idx)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.stage(values)
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _token_at(request: Request, position: int) -> int:
    """The token at `position` of prompt + outputs."""
    n = len(request.prompt_token_ids)
    return request.prompt_token_ids[position] if position < n else request.output_token_ids[position - n]


class HostStaging:
    """CUDA: a step's integer inputs (one list, see `ModelRunner._prepare`) are written into a pinned host buffer
    and copied to the device without blocking the host. The buffer is written again at the next step once the
    copy of the step before is done (an event recorded after it). (On a CPU device it only copies through the
    buffer, which is how its bookkeeping is tested without a GPU.)"""

    def __init__(self, device: torch.device, size: int = 1 << 16) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffer = self._new_buffer(size)
        self._copied: torch.cuda.Event | None = None

    def _new_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.long, pin_memory=self._cuda)

    def stage(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        if n > self._buffer.numel():  # a bigger buffer; the old one lives on while its copy is in flight
            self._buffer = self._new_buffer(2 * n)
        elif self._copied is not None:
            self._copied.synchronize()
        host = self._buffer[:n]
        host.copy_(torch.tensor(values, dtype=torch.long))
        device = host.to(self.device, non_blocking=True) if self._cuda else host.clone()
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return device
