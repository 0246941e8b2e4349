"""The model runner: turns a scheduled step into one flat forward pass and samples the next tokens."""

from __future__ import annotations

import torch

from engine.core.outputs import RunnerOutput
from engine.core.request import Request, TokenLogprob
from engine.core.scheduler import SchedulerOutput
from engine.lora.batch import LoraBatch
from engine.lora.device_tier import DeviceAdapterTier
from engine.model.attention import AttentionMetadata, PrefillSeq
from engine.model.llama import LlamaForCausalLM
from engine.worker.sampler import Sampler
from kernels import lora_backend

NON_FINITE_LOGITS = ("the model computed non-finite logits (NaN or inf) for this request; its adapter's "
                     "weights are the usual cause")
NO_TOKEN_LEFT = ("no token had a finite, non-zero probability after min_tokens, stop_token_ids and the "
                 "penalties were applied")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler, device: torch.device, adapters: DeviceAdapterTier | None = None
                 ) -> None:
        self.model = model
        self.adapters = adapters
        self.kv_cache = kv_cache  # [num_layers, num_pages, 2, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.lora_backend = lora_backend(device)  # "torch" (CPU) or "triton" (CUDA), kernels/__init__.py

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Compute one step and sample a token for every request whose known tokens are all computed.

        A row whose logits are not finite (a broken adapter, an overflow) fails its own request in
        `RunnerOutput.errors` instead of sampling a garbage token; the other rows are unaffected (rows
        never mix: attention stays within a sequence, LoRA within a segment).
        """
        slots = [self._slot(r) for r in batch.requests]
        order = self._batch_order(batch, slots)
        requests = [batch.requests[i] for i in order]
        num_tokens = [batch.num_tokens[i] for i in order]
        input_ids, positions, attn, last_rows, sample_idx = self._prepare(requests, num_tokens)
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
                out = self.sampler(logits.float(), [requests[sample_idx[j]] for j in good])
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

    def _prepare(self, requests: list[Request], num_tokens: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        bs = self.block_size
        token_ids: list[int] = []
        pos_list: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []  # the row whose logits give each sampling request its next token
        sample_idx: list[int] = []  # which requests sample this step
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for i, (request, n) in enumerate(zip(requests, num_tokens)):
            start = request.num_computed_tokens
            end = start + n
            row = len(token_ids)
            token_ids.extend(request.token_ids(start, end))
            pos_list.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if end == request.num_tokens:
                last_rows.append(row + n - 1)
                sample_idx.append(i)
            if n == 1:
                decode_tables.append(blocks[: -(-end // bs)])
                decode_lens.append(end)
            else:
                table = torch.tensor(blocks[: -(-end // bs)], dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(row, n, end, table))
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        attn = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self._tensor(padded).reshape(len(padded), width),
            decode_context_lens=self._tensor(decode_lens),
            prefills=tuple(prefills),
        )
        return (self._tensor(token_ids), self._tensor(pos_list), attn,
                self._tensor(last_rows), sample_idx)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
