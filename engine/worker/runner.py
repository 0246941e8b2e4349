"""The model runner: turns a scheduled step into one flat forward pass and samples the next tokens.

What lives across steps (block tables, penalty counts) is kept in the persistent batch
(engine/worker/input_batch.py), so building a step's inputs costs a few list operations per request, not padded
matrices rebuilt from every request's lists. A step's integer inputs are packed into one tensor (on CUDA through
a pinned host buffer and one non-blocking copy, `HostStaging`; in steady decoding on the CPU, written in place
into a buffer whose views are made once, `DecodeBuffers`): at a few running requests, each tensor built or cut
costs about as much as the rest of the step's bookkeeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from engine.core.outputs import RunnerOutput
from engine.core.request import Request, TokenLogprob
from engine.core.scheduler import SchedulerOutput
from engine.lora.device_tier import DeviceAdapterTier
from engine.lora.routes import ROUTES, LoraBatch, LoraRoute
from engine.lora.vocab_lora import VocabStep
from engine.model.attention import AttentionMetadata, PrefillSeq
from engine.model.decoder import CausalLM
from engine.worker.cuda_graphs import DecodeGraphs, Graph, GraphStep
from engine.worker.input_batch import InputBatch
from engine.worker.prompt_logprobs import HeadLora, PromptChunk, plan_chunk, score_prompt_chunks
from engine.worker.sampler import NO_TOKEN, NON_FINITE, RowTables, Sampler, SamplerOutput

NON_FINITE_LOGITS = (
    "the model computed non-finite logits (NaN or inf) for this request; its adapter's weights are the usual cause"
)
NO_TOKEN_LEFT = (
    "no token had a finite, non-zero probability after min_tokens, stop_token_ids, logit_bias, the penalties and "
    "the output constraint were applied"
)


@dataclass(slots=True)  # not frozen: one is made per step, and frozen makes __init__ several times slower
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None  # [S] int64: the rows whose logits are sampled; None: every row, in order
    sample_idx: list[int]  # [S]: the requests (in batch order) that sample this step
    prompt_chunks: list[PromptChunk] | None = None  # the prompt positions scored for prompt logprobs, if any


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        adapters: DeviceAdapterTier | None = None,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.kv_cache = kv_cache  # [num_layers, num_pages, 2, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        # how the steps' LoRA deltas are computed (model.backends.lora: loragate_kernels/backends.py)
        self.lora: LoraRoute[Any] | None = None if adapters is None else ROUTES[model.backends.lora](adapters.weights)
        max_len = max_model_len or model.config.max_position_embeddings
        self.batch = InputBatch(max_num_seqs, -(-max_len // block_size), model.config.vocab_size, device)
        self.staging = HostStaging(device) if device.type == "cuda" else None
        self.decode_buffers = DecodeBuffers() if device.type == "cpu" else None
        self.max_num_seqs = max_num_seqs
        self.graphs: DecodeGraphs | None = None  # enable_graphs (CUDA)

    def enable_graphs(self, scratch_page: int, make_graph: Callable[[], Graph], **options: Any) -> DecodeGraphs:
        """Replay steps of decodes alone from graphs (engine/worker/cuda_graphs.py); `scratch_page`: a page of the
        pool reserved for the padding rows' K/V."""
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.block_size,
            self.batch.block_table.numpy(),
            self.max_num_seqs,
            scratch_page,
            self.adapters,
            make_graph,
            **options,
        )
        return self.graphs

    def execute(self, batch: SchedulerOutput, interrupt: threading.Event | None = None) -> RunnerOutput:
        """Compute one step and sample a token for every request whose known tokens are all computed.

        A row whose logits are not finite (a broken adapter, an overflow) fails its own request in
        `RunnerOutput.errors` instead of sampling a garbage token; the other rows are unaffected (rows
        never mix: attention stays within a sequence, LoRA within a segment).

        Runs in inference mode. The engine thread stays in it for its whole loop (engine/core/async_engine.py):
        entering it costs about as much as building the step's inputs at one running request.

        `interrupt`, when set during the forward pass, ends it between two layers (engine/model/decoder.py's
        StepInterrupted propagates; nothing is sampled, so the step can be run again as it was). A step replayed
        from a CUDA graph (decodes alone, engine/worker/cuda_graphs.py) runs whole.
        """
        if torch.is_inference_mode_enabled():
            return self._execute(batch, interrupt)
        with torch.inference_mode():
            return self._execute(batch, interrupt)

    def _execute(self, batch: SchedulerOutput, interrupt: threading.Event | None) -> RunnerOutput:
        slots = [None if r.adapter is None else self._slot(r) for r in batch.requests]
        order = self._batch_order(batch, slots)
        if order is None:  # already in batch order
            requests, num_tokens = batch.requests, batch.num_tokens
        else:
            requests = [batch.requests[i] for i in order]
            num_tokens = [batch.num_tokens[i] for i in order]
            slots = [slots[i] for i in order]
        rows = self.batch.sync(requests)
        vocab = self._vocab_step(slots, num_tokens)
        # a captured graph has no embedding LoRA: a step with one runs eagerly
        step = self._prepare(requests, num_tokens, rows, graphs=vocab is None or not vocab.embeds)
        if isinstance(step, GraphStep):  # decodes alone, replayed from a captured graph
            assert self.graphs is not None
            hidden = self.graphs.run(step, self._graph_tiles(slots, num_tokens))
        else:
            lora = self._lora_segments(slots, num_tokens)
            if lora is not None:
                lora.vocab = vocab
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.attn, lora, interrupt)
        n = len(requests)
        sampled: list[int | None] = [None] * n
        logprobs: list[TokenLogprob | None] = [None] * n
        errors: dict[int, str] = {}
        scored: dict[int, tuple[int, list[TokenLogprob]]] = {}
        head = None if vocab is None or not vocab.heads else _head_lora(vocab, slots)  # LM-head LoRA, by batch index
        if step.prompt_chunks:  # only requests that asked for prompt logprobs
            by_order, failed = score_prompt_chunks(
                hidden, self.model.compute_logits, requests, step.prompt_chunks, head
            )
            scored = {i if order is None else order[i]: entries for i, entries in by_order.items()}
            errors.update((i if order is None else order[i], NON_FINITE_LOGITS) for i in failed)
        if not step.sample_idx:
            return RunnerOutput(sampled, logprobs, errors, scored)
        if step.sample_rows is None:  # every request samples, in order
            sampling, sampling_rows = requests, rows
        else:
            hidden = hidden[step.sample_rows]
            sampling = [requests[i] for i in step.sample_idx]
            sampling_rows = [rows[i] for i in step.sample_idx]
        out = self._sample(hidden, sampling, sampling_rows, head, step.sample_idx)
        if order is None and step.sample_rows is None and min(out.token_ids) >= 0:  # all sampled, in batch order
            return RunnerOutput(out.token_ids, out.logprobs, errors, scored)
        for i, token, logprob in zip(step.sample_idx, out.token_ids, out.logprobs, strict=True):
            j = i if order is None else order[i]  # its index in the scheduler's batch
            if token >= 0:
                sampled[j], logprobs[j] = token, logprob
            else:
                errors[j] = NON_FINITE_LOGITS if token == NON_FINITE else NO_TOKEN_LEFT
        return RunnerOutput(sampled, logprobs, errors, scored)

    def _sample(
        self, hidden: torch.Tensor, requests: list[Request], rows: list[int], head: HeadLora | None, owners: list[int]
    ) -> SamplerOutput:
        """The tokens of the sampling rows (hidden [S, hidden]; `owners`: their batch indices, for `head`, the rows'
        LM-head LoRA): where no row has one, every row's token is an argmax of its raw logits and the model has a
        screen of its head (engine/model/head_screen.py), from the screen, and from the full logits only for the rows
        it cannot vouch for; otherwise from the full logits."""
        screen = self.model.head_screen
        if screen is None or head is not None:
            return self._sample_logits(hidden, requests, rows, head, owners)
        banned = self.sampler.argmax_bans(requests, screen.vocab, hidden.device)
        if banned is None:
            return self._sample_logits(hidden, requests, rows, None, owners)
        screened = screen.tokens(hidden, banned)
        rest = [i for i, token in enumerate(screened) if token is None]
        tokens = [NO_TOKEN if token is None else token for token in screened]
        if rest:
            part = self._sample_logits(hidden[rest], [requests[i] for i in rest], [rows[i] for i in rest], None, [])
            for i, token in zip(rest, part.token_ids, strict=True):
                tokens[i] = token
        return SamplerOutput(tokens, [None] * len(tokens))

    def _sample_logits(
        self, hidden: torch.Tensor, requests: list[Request], rows: list[int], head: HeadLora | None, owners: list[int]
    ) -> SamplerOutput:
        logits = self.model.compute_logits(hidden)  # [S, vocab]
        if head is not None:
            head(logits, hidden, owners)
        return self.sampler(logits, requests, RowTables(self.batch, rows))

    def _slot(self, request: Request) -> int | None:
        if request.adapter is None:
            return None
        slot = self._tier().slot_of(request.adapter)
        assert slot is not None, "a running request's adapter is pinned on the device"
        return slot

    def _tier(self) -> DeviceAdapterTier:
        """The device adapter tier: a request names an adapter only on an engine that has one."""
        if self.adapters is None:
            raise RuntimeError("a request names an adapter, but the engine has no device adapter tier")
        return self.adapters

    @staticmethod
    def _batch_order(batch: SchedulerOutput, slots: list[int | None]) -> list[int] | None:
        """Decodes (one token) first, then prefill chunks, as AttentionMetadata requires; within each,
        rows grouped by adapter slot so every adapter forms as few segments as possible. None: the batch's
        own order is that order (decodes already grouped by slot: of the base model, of one adapter, ...)."""
        keys = [-1 if slot is None else slot for slot in slots]
        if batch.num_tokens.count(1) == len(keys) and keys == sorted(keys):
            return None
        decodes = sorted((i for i, n in enumerate(batch.num_tokens) if n == 1), key=keys.__getitem__)
        prefills = sorted((i for i, n in enumerate(batch.num_tokens) if n != 1), key=keys.__getitem__)
        return decodes + prefills

    def _segments(self, slots: list[int | None], num_tokens: list[int]) -> tuple[list[int], list[int]] | None:
        """Segments tiling the batch (starts, with the end; slots): consecutive requests with the same slot merge;
        rows without an adapter use the tier's null slot (rank 0 everywhere). None when no row has an adapter."""
        if slots.count(None) == len(slots):
            return None
        null = self._tier().null_slot
        starts = [0]
        seg_slots: list[int] = []
        for slot, n in zip(slots, num_tokens, strict=True):
            slot = null if slot is None else slot
            if seg_slots and seg_slots[-1] == slot:
                starts[-1] += n
            else:
                seg_slots.append(slot)
                starts.append(starts[-1] + n)
        return starts, seg_slots

    def _graph_tiles(
        self, slots: list[int | None], num_tokens: list[int]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """A graph step's LoRA row tiles as host lists (the graph copies them with its other inputs)."""
        segments = self._segments(slots, num_tokens)
        if segments is None:
            return None
        from loragate_kernels.triton.sgmv import segment_tiles

        return segment_tiles(*segments, skip_slot=self._tier().null_slot)

    def _vocab_step(self, slots: list[int | None], num_tokens: list[int]) -> VocabStep | None:
        """The step's embedding and LM-head LoRA (engine/lora/vocab_lora.py); None, after one check while no device
        slot holds any, when no row's adapter has one."""
        if self.adapters is None or not self.adapters.vocab.active:
            return None
        return self.adapters.vocab.step(slots, num_tokens)

    def _lora_segments(self, slots: list[int | None], num_tokens: list[int]) -> LoraBatch | None:
        """The step's LoraBatch (`_segments`), None when no row has an adapter."""
        segments = self._segments(slots, num_tokens)
        if segments is None:
            return None
        assert self.lora is not None  # `_segments` found rows with an adapter: the engine has a tier
        return self.lora.step(*segments, self._tier().null_slot)

    def _prepare(
        self, requests: list[Request], num_tokens: list[int], rows: list[int], graphs: bool = True
    ) -> StepInputs | GraphStep:
        """The step's inputs (a GraphStep only where `graphs`). Every integer input is written into one list and becomes
        one tensor (one copy to the device on CUDA); the tensors the model reads are views of it."""
        bs = self.block_size
        token_ids: list[int] = []
        pos_list: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []  # the row whose logits give each sampling request its next token
        sample_idx: list[int] = []  # which requests sample this step
        decode_rows: list[int] = []  # persistent-batch rows of the decodes
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, list[int]]] = []  # token_start, query_len, context_len, blocks
        prompt_chunks: list[PromptChunk] = []  # of requests that asked for prompt logprobs
        for i, (request, n) in enumerate(zip(requests, num_tokens, strict=True)):
            start = request.num_computed_tokens
            end = start + n
            blocks = request.block_ids
            if n == 1:  # a decode (batch order puts them first): one token, one slot
                # It samples (its token is the last one known), unless it only scores its prompt (max_tokens 0).
                if end == request.num_tokens and (request.output_token_ids or request.sampling_params.max_tokens):
                    last_rows.append(len(token_ids))
                    sample_idx.append(i)
                    token_ids.append(
                        request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
                    )
                else:  # a one-token chunk of a prompt (or of outputs computed again after a preemption)
                    if request.prompt_logprobs:
                        _add_chunk(prompt_chunks, plan_chunk(request, i, len(token_ids), start, end))
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
            if end == request.num_tokens and (request.output_token_ids or request.sampling_params.max_tokens):
                last_rows.append(row + n - 1)
                sample_idx.append(i)
            if request.prompt_logprobs:
                _add_chunk(prompt_chunks, plan_chunk(request, i, row, start, end))
            prefills.append((row, n, end, blocks[: -(-end // bs)]))
        num = len(token_ids)
        num_decodes = len(decode_lens)
        # In a step of decodes only, every row is sampled, in order: the logits need no gather.
        gather = len(last_rows) != num
        if num_decodes == num and not gather and graphs and self.graphs is not None and self.graphs.fits(num):
            return GraphStep(token_ids, pos_list, slots, decode_lens, decode_rows, sample_idx)
        if num_decodes == num and not gather and self.decode_buffers is not None:  # steady decoding on the CPU
            input_ids, positions, slot_mapping, context_lens = self.decode_buffers.write(
                token_ids + pos_list + slots + decode_lens, num
            )
            longest = max(decode_lens)
            tables = self.batch.decode_tables(decode_rows, -(-longest // bs))
            attn = AttentionMetadata(slot_mapping, num, tables, context_lens, (), longest)
            return StepInputs(input_ids, positions, attn, None, sample_idx)
        packed = token_ids + pos_list + slots + decode_lens
        if gather:
            packed += last_rows
        for *_, table in prefills:
            packed += table
        flat = self._tensor(packed)
        # Views of `flat`, cut by slicing (in the step loop, a few slices cost less than one `split`).
        ends = list(
            accumulate((num, num, num, num_decodes, len(last_rows) if gather else 0, *(len(p[3]) for p in prefills)))
        )
        longest = max(decode_lens, default=0)
        attn = AttentionMetadata(
            slot_mapping=flat[2 * num : ends[2]],
            num_decode_tokens=num_decodes,
            decode_block_tables=self.batch.decode_tables(decode_rows, -(-longest // bs)),
            decode_context_lens=flat[ends[2] : ends[3]],
            prefills=tuple(
                PrefillSeq(row, n, end, flat[ends[4 + j] : ends[5 + j]]) for j, (row, n, end, _) in enumerate(prefills)
            )
            if prefills
            else (),
            max_decode_context_len=longest,
        )
        return StepInputs(
            flat[:num],
            flat[num : 2 * num],
            attn,
            flat[ends[3] : ends[4]] if gather else None,
            sample_idx,
            prompt_chunks,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        if self.staging is not None:
            return self.staging.stage(values)
        if self.device.type == "cpu":  # NumPy builds it from the list in a third of torch.tensor's time
            return torch.from_numpy(np.array(values, dtype=np.int64))
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _head_lora(vocab: VocabStep, slots: list[int | None]) -> HeadLora:
    """Rows get their request's LM-head LoRA (prompt logprobs' and sampled ones): `slots` by batch index."""
    return lambda logits, hidden, owners: vocab.head(logits, hidden, [slots[i] for i in owners])


def _add_chunk(chunks: list[PromptChunk], chunk: PromptChunk | None) -> None:
    if chunk is not None:
        chunks.append(chunk)


def _token_at(request: Request, position: int) -> int:
    """The token at `position` of prompt + outputs."""
    n = len(request.prompt_token_ids)
    return request.prompt_token_ids[position] if position < n else request.output_token_ids[position - n]


class DecodeBuffers:
    """CPU: the integer inputs of a step of decodes that all sample (steady decoding), written in place into a
    buffer kept per batch size, whose views (input ids, positions, slots, context lengths) are made once.

    In the step loop, building a new tensor and cutting it into views costs more than the rest of building the
    step's inputs at a few running requests: each is a separate library call, and each call's code is cold after
    the forward pass (measured: ~16 µs per step at 1 running request, a sixth of the step overhead there).
    A step's views are written again at the next step of the same size: the CPU forward pass is synchronous, and
    nothing keeps a step's inputs past it. One buffer per size seen, at most max_num_seqs of them (264 KiB if every
    size up to 128 occurs)."""

    def __init__(self) -> None:
        self._by_size: dict[int, tuple[np.ndarray, tuple[torch.Tensor, ...]]] = {}

    def write(self, values: list[int], num: int) -> tuple[torch.Tensor, ...]:
        """`values`: 4 * num ints (input ids, positions, slots, context lengths); their four [num] views."""
        entry = self._by_size.get(num)
        if entry is None:
            buffer = torch.zeros(4 * num, dtype=torch.long)
            entry = self._by_size[num] = (buffer.numpy(), tuple(buffer.split(num)))
        entry[0][:] = values
        return entry[1]


class HostStaging:
    """CUDA: a step's integer inputs (one list, see `ModelRunner._prepare`) are written into a pinned host buffer
    and copied to the device without blocking the host. The buffer is written again at the next step once the
    copy of the step before is done (an event recorded after it). (On a CPU device it only copies through the
    buffer, which is how its bookkeeping is tested without a GPU.)"""

    def __init__(self, device: torch.device, size: int = 1 << 16) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffer = self._new_buffer(size)
        self._host = self._buffer.numpy()  # the same memory
        self._copied: torch.cuda.Event | None = None

    def _new_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.long, pin_memory=self._cuda)

    def stage(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        if n > self._buffer.numel():  # a bigger buffer; the old one lives on while its copy is in flight
            self._buffer = self._new_buffer(2 * n)
            self._host = self._buffer.numpy()
        elif self._copied is not None:
            self._copied.synchronize()
        self._host[:n] = values  # written through NumPy: no temporary tensor
        host = self._buffer[:n]
        device = host.to(self.device, non_blocking=True) if self._cuda else host.clone()
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return device
