"""Which of a prompt's blocks the prefill saves at each step (``kvstage_save_by_chunk``).

Contract
--------
`PromptSaves` is the prefill scheduler's bookkeeping (no vLLM import, no thread): for
each request handed to a decode (``do_remote_decode``) it accumulates the block ids vLLM
scheduled per KV cache group and, each step the request runs, says what to copy to the
host buffer in that step's d2h (`Save`):

- Partial prefill (the prompt does not complete this step; only with ``by_chunk``): every
  block of an attention group (``block_sizes[g]`` tokens per block) that this step
  COMPLETES, whose position the final transfer keeps, and that was not saved yet. A block a
  chunk boundary cuts is not complete and waits for a later step (vLLM's own host path
  saves each step's NEW blocks, so such a block keeps its first part's bytes only). Which
  positions the transfer keeps is asked of ``clip`` (vLLM's
  ``get_exchange_clipped_blocks``) over position numbers for the whole prompt: a sliding
  window's early blocks, dropped by the transfer and freed by vLLM as the prompt
  advances, are never copied. State groups (``block_sizes[g]`` None: Mamba and other
  per-request state) change at every chunk and are saved at the end only.
- Last step (the prompt completes): ``final`` = ``clip`` of every block the request holds
  (what the decode READs; the checksum digests these), ``ids`` = the positions of ``final``
  not saved yet: at most the blocks the last chunk completed or touched, plus the state
  groups' blocks. ``clip`` must keep a suffix of each group (vLLM 0.32.0: a sliding group's
  last blocks, the whole list otherwise; asserted).
- Positions, not ids, are remembered: an id vLLM freed (out of the window) and gave back
  to the same request at a later position is copied again there.
- A resumed request (preempted, its blocks freed) starts over: every position again.
- `drop(rid)`: the request ended before its last step (aborted); True when a copy of it
  may still be queued on the worker (the worker then waits for it: `chunk_saves`).

Null blocks (id 0, vLLM's placeholder) are never copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

NULL_BLOCK = 0
BlockIds = tuple[list[int], ...]
Clip = Callable[[BlockIds], BlockIds]


class Save(NamedTuple):
    """One step's save of one request: ``ids`` to copy now (per group); ``final`` the
    blocks the decode will READ, on the prompt's last step only (else None)."""

    ids: BlockIds
    final: BlockIds | None


@dataclass
class _Prompt:
    groups: list[list[int]] | None = None  # block ids per group, as scheduled so far
    saved: list[set[int]] = field(default_factory=list)  # positions saved, per group
    cursor: list[int] = field(default_factory=list)  # positions below were considered
    kept_from: list[int] | None = None  # first position the final clip keeps, per group
    queued: bool = False  # a save of it went to the worker before its last step


class PromptSaves:
    """Per-request save bookkeeping of the prefill scheduler (module doc)."""

    def __init__(self, block_sizes: Sequence[int | None], clip: Clip, *, by_chunk: bool) -> None:
        self.block_sizes = list(block_sizes)
        self.clip = clip
        self.by_chunk = by_chunk
        self._prompts: dict[str, _Prompt] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._prompts

    def add(self, rid: str) -> None:
        """``rid`` (re)scheduled: its blocks follow in the step's scheduler output."""
        self._prompts.setdefault(rid, _Prompt())

    def drop(self, rid: str) -> bool:
        """Forget ``rid``; True if a save of it may still be queued on the worker."""
        p = self._prompts.pop(rid, None)
        return p is not None and p.queued

    def step(self, rid: str, new_block_ids: BlockIds | None, resumed: bool,
             computed: int, num_prompt: int) -> Save | None:
        """``rid`` runs this step: its new blocks (all of them if ``resumed``), tokens
        computed once the step ran, the prompt's length. What to save now, or None."""
        p = self._prompts.get(rid)
        if p is None:
            return None
        if new_block_ids is not None:
            if p.groups is None or resumed:  # a resumed request lists all its blocks
                p.groups = [list(g) for g in new_block_ids]
                p.saved = [set() for _ in p.groups]
                p.cursor = [0] * len(p.groups)
            else:
                for acc, new in zip(p.groups, new_block_ids, strict=True):
                    acc.extend(new)
        if computed < num_prompt:
            if not self.by_chunk or p.groups is None:
                return None
            ids = self._complete(p, computed, num_prompt)
            if not any(ids):
                return None
            p.queued = True
            return Save(ids, None)
        del self._prompts[rid]
        if not p.groups:
            return None
        final = self.clip(tuple(p.groups))
        if len(final) != len(p.groups):  # vLLM transfers some groups only: no early saves
            return Save(tuple([b for b in g if b != NULL_BLOCK] for g in final), final)
        now: list[list[int]] = []
        for g, (blocks, kept) in enumerate(zip(p.groups, final, strict=True)):
            start = len(blocks) - len(kept)
            assert start >= 0 and blocks[start:] == list(kept), "the clip keeps a suffix"
            now.append([b for pos, b in enumerate(kept, start)
                        if b != NULL_BLOCK and pos not in p.saved[g]])
        return Save(tuple(now), final)

    def _complete(self, p: _Prompt, computed: int, num_prompt: int) -> BlockIds:
        """The blocks this step completed that the final clip keeps and are not saved."""
        assert p.groups is not None
        if p.kept_from is None:
            p.kept_from = self._kept_from(num_prompt)
        out: list[list[int]] = []
        for g, blocks in enumerate(p.groups):
            size = self.block_sizes[g]
            if size is None:
                out.append([])
                continue
            done = min(computed // size, len(blocks))
            new = []
            for pos in range(max(p.cursor[g], p.kept_from[g]), done):
                if blocks[pos] != NULL_BLOCK:
                    new.append(blocks[pos])
                    p.saved[g].add(pos)
            p.cursor[g] = max(p.cursor[g], done)
            out.append(new)
        return tuple(out)

    def _kept_from(self, num_prompt: int) -> list[int]:
        """Per group, the first block position the final clip keeps, asked of ``clip``
        over position numbers of the whole prompt (state groups: never saved early)."""
        sizes = self.block_sizes
        positions = tuple(list(range(-(-num_prompt // s))) if s else [] for s in sizes)
        kept = self.clip(positions)
        return [k[0] if k else len(pos) for k, pos in zip(kept, positions, strict=True)]
