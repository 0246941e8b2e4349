"""The persistent batch: what the runner keeps about each running request from one step to the next.

A running request owns a row from the step it is first computed in until it leaves the running set (finished,
aborted or preempted). The row holds what would otherwise be rebuilt from Python lists every step:

- its KV block table (a row of `block_table`), extended only by the blocks the scheduler added since the
  last step (a decode adds one every `block_size` steps); a request whose blocks were freed and allocated
  anew (preempted, then admitted again) has its row rewritten;
- for a request with penalties: how often each token occurs in its output (`counts`, [vocab] float32), and
  the tokens of its prompt (`prompt_mask`, [vocab] bool, for the repetition penalty), brought up to date with
  the tokens sampled since the last step in one batched write for all rows.

`sync(requests)` runs at the start of each step, so the step's inputs are gathers from these tables instead of
padded matrices built from every request's token lists. Penalty tables are allocated when the first request
with penalties arrives ([max_num_seqs, vocab]: 25 MiB for SmolLM2's 49,152-token vocabulary at 128 rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.core.request import Request, RequestStatus


def has_penalties(request: Request) -> bool:
    p = request.sampling_params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self._blocks = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.block_table = torch.from_numpy(self._blocks)  # [max_rows, max_blocks], shares the array's memory
        self._rows: dict[Request, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))
        self._num_blocks = [0] * max_rows  # entries of the row's table written
        self._block_list: list[list[int] | None] = [None] * max_rows  # the request's block_ids list they came from
        self._counted = [-1] * max_rows  # output tokens already in `counts` (-1: the row has no penalties)
        self._writes = 0  # writes to the block table so far
        # decode_tables' last answer: (writes, width, rows, tables).
        self._last_tables: tuple[int, int, list[int], torch.Tensor] | None = None
        self.counts: torch.Tensor | None = None  # [max_rows, vocab] float32
        self.prompt_mask: torch.Tensor | None = None  # [max_rows, vocab] bool

    def __len__(self) -> int:
        return len(self._rows)

    def sync(self, requests: Sequence[Request]) -> list[int]:
        """Bring the rows of `requests` up to date (adding rows for new ones) and return them, in order."""
        known = [self._rows.get(request) for request in requests]
        if len(self._rows) > len(known) - known.count(None):  # a row of a request not in this step: it may have left
            self._release_departed()
        rows: list[int] = []
        count_rows: list[int] = []
        count_tokens: list[int] = []
        for request, row in zip(requests, known, strict=True):
            if row is None:
                row = self._add(request)
            rows.append(row)
            blocks = request.block_ids
            if blocks is not self._block_list[row]:  # freed and allocated anew since the last step
                self._block_list[row] = blocks
                self._num_blocks[row] = 0
            done = self._num_blocks[row]
            if len(blocks) > done:
                self._blocks[row, done : len(blocks)] = blocks[done:]
                self._num_blocks[row] = len(blocks)
                self._writes += 1
            counted = self._counted[row]
            if counted >= 0 and len(request.output_token_ids) > counted:
                new = request.output_token_ids[counted:]
                count_rows += [row] * len(new)
                count_tokens += new
                self._counted[row] = len(request.output_token_ids)
        if count_rows:
            assert self.counts is not None
            self.counts.index_put_(
                (self._index(count_rows), self._index(count_tokens)),
                torch.ones(len(count_rows), device=self.device),
                accumulate=True,
            )
        return rows

    def decode_tables(self, rows: list[int], width: int) -> torch.Tensor:
        """[len(rows), width] int64 on the device: the block tables of `rows`; entries past a row's blocks are
        stale, never read (attention masks positions past each context length).

        A copy (later writes to the table do not change it), gathered by NumPy on the host. The last one is kept
        and handed out again while the rows, the width and the table are unchanged: in steady decoding that is
        every step but one in `block_size` (when some request's context crosses into a new block)."""
        last = self._last_tables
        if last is not None and last[0] == self._writes and last[1] == width and last[2] == rows:
            return last[3]
        table = torch.from_numpy(self._blocks[rows, :width])
        if self.device.type != "cpu":
            table = table.to(self.device)
        self._last_tables = (self._writes, width, rows, table)
        return table

    def output_counts(self, rows: list[int]) -> torch.Tensor:
        """[R, vocab] float32: how often each token occurs in each row's output."""
        assert self.counts is not None
        return self.counts.index_select(0, self._index(rows))

    def seen(self, rows: list[int]) -> torch.Tensor:
        """[R, vocab] bool: the tokens of each row's prompt or output."""
        assert self.prompt_mask is not None and self.counts is not None
        index = self._index(rows)
        return self.prompt_mask.index_select(0, index) | (self.counts.index_select(0, index) > 0)

    def _add(self, request: Request) -> int:
        row = self._free.pop()
        self._rows[request] = row
        self._block_list[row] = None
        self._num_blocks[row] = 0
        self._counted[row] = -1
        if has_penalties(request):
            if self.counts is None:
                self.counts = torch.zeros(len(self._counted), self.vocab, device=self.device)
                self.prompt_mask = torch.zeros(len(self._counted), self.vocab, dtype=torch.bool, device=self.device)
            assert self.prompt_mask is not None
            self.counts[row].zero_()
            self.prompt_mask[row].zero_()
            self.prompt_mask[row, self._index(request.prompt_token_ids)] = True
            self._counted[row] = 0  # its output so far is counted by the caller, `sync`
        return row

    def _release_departed(self) -> None:
        """Free the rows of requests that left the running set since the last step."""
        departed = [r for r in self._rows if r.status is not RequestStatus.RUNNING]
        for request in departed:
            row = self._rows.pop(request)
            self._block_list[row] = None
            self._free.append(row)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
