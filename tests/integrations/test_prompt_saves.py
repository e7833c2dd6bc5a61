"""`PromptSaves`: which blocks each prefill step saves (no vLLM: the plan is plain Python).

Over random prompts, block sizes and chunkings, with a full-attention group, a sliding
group (the transfer keeps its last ``SW`` blocks, as vLLM's clip does) and a state group:
every block the decode READs is copied exactly once, never before the step that
completes it; a sliding group's dropped blocks are never copied; the last step copies at
most the blocks its own chunk touched (attention) plus the state blocks. The exact
entries per step for vLLM's real scheduler are in test_vllm_behaviour.py.
"""

from __future__ import annotations

import random

import pytest

from kvstage.pd.prompt_saves import BlockIds, PromptSaves

SW = 3  # blocks of the sliding group the transfer keeps


def clip(ids: BlockIds) -> BlockIds:
    full, sliding, state = ids
    return (list(full), list(sliding[-SW:]), list(state))


def block_ids(num_blocks: int, first: int = 0) -> BlockIds:
    """Distinct ids per group and position (group g's position p: 1 + 1000 g + p)."""
    return tuple([1 + 1000 * g + p for p in range(first, num_blocks)] for g in range(2)) + (
        [9000 + first],)


def run(prompt: int, bs: int, chunks: list[int], *, by_chunk: bool = True
        ) -> tuple[list[tuple[int, BlockIds]], BlockIds]:
    """Steps of one prompt: (tokens computed after the step, ids saved) per step that
    saved, and the final blocks."""
    saves = PromptSaves([bs, bs, None], clip, by_chunk=by_chunk)
    saves.add("r")
    computed, allocated, out = 0, 0, []
    final: BlockIds | None = None
    for n in chunks:
        need = -(-(computed + n) // bs)
        new = block_ids(need, allocated)
        if allocated:
            new = new[:2] + ([],)  # the state group has its one block from the start
        allocated = need
        computed += n
        save = saves.step("r", new, False, computed, prompt)
        if save is not None:
            out.append((computed, save.ids))
            if save.final is not None:
                final = save.final
    assert computed == prompt and final is not None and "r" not in saves
    return out, final


def chunking(rng: random.Random, prompt: int) -> list[int]:
    chunks, left = [], prompt
    while left:
        n = min(left, rng.randint(1, 80))
        chunks.append(n)
        left -= n
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_every_read_block_copied_once_never_early(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 32])
    prompt = rng.randint(1, 400)
    chunks = chunking(rng, prompt)
    steps, final = run(prompt, bs, chunks)
    copied: list[list[int]] = [[], [], []]
    for computed, ids in steps:
        for g in range(2):
            for b in ids[g]:  # complete when copied (the prompt's last block: at its end)
                assert min(((b - 1 - 1000 * g) + 1) * bs, prompt) <= computed
        for g in range(3):
            copied[g] += ids[g]
    for g in range(3):
        assert sorted(copied[g]) == sorted(final[g])  # each READ block once, nothing else
    assert final[1] == block_ids(-(-prompt // bs))[1][-SW:]
    # the last step: the blocks its chunk touched (the one it started inside included)
    # per attention group, plus the state block
    last_computed, last = steps[-1]
    first_touched = (prompt - chunks[-1]) // bs
    for g in range(2):
        assert len(last[g]) <= -(-prompt // bs) - first_touched
    assert last[2] == [9000] and last_computed == prompt


def test_last_step_is_bounded_by_its_chunk_not_the_prompt() -> None:
    """32 chunks of 64 tokens, 16-token blocks: 128 full-attention blocks in all; the
    last step copies the 4 its chunk completed, the window and the state block."""
    steps, final = run(2048, 16, [64] * 32)
    assert len(final[0]) == 128
    assert [len(g) for g in steps[-1][1]] == [4, SW, 1]
    assert [len(g) for g in steps[0][1]] == [4, 0, 0]  # the window is at the end


def test_a_chunk_cut_block_waits_for_the_step_that_completes_it() -> None:
    steps, _ = run(100, 16, [60, 40])
    assert steps[0] == (60, ([1, 2, 3], [], []))  # position 3 has 12 of 16 tokens
    assert steps[1][1][0] == [4, 5, 6, 7]


def test_save_by_chunk_off_saves_the_prompt_once() -> None:
    steps, final = run(300, 16, [64] * 4 + [44], by_chunk=False)
    assert len(steps) == 1 and steps[0][1] == final


def test_positions_not_ids_a_reused_id_is_copied_again() -> None:
    """A block saved early that the final clip drops after all (here: the request ends
    with one more block than its prompt needs) may be freed and given back to the same
    request at a later position, with new bytes: it is copied again there."""
    saves = PromptSaves([16], lambda ids: (ids[0][-4:],), by_chunk=True)
    saves.add("r")
    # 96 tokens: 6 blocks predicted, the window keeps positions 2..5; 48 tokens computed
    assert saves.step("r", ([5, 6, 7],), False, 48, 96) == (([7],), None)
    last = saves.step("r", ([8, 9, 10, 7],), False, 96, 96)  # id 7 again, at position 6
    assert last is not None and last.final == ([8, 9, 10, 7],)
    assert last.ids == ([8, 9, 10, 7],)  # position 2 is not READ; position 6 is new


def test_resumed_starts_over_and_drop_reports_queued_saves() -> None:
    saves = PromptSaves([16], lambda ids: ids, by_chunk=True)
    saves.add("r")
    assert saves.step("r", ([1, 2],), False, 32, 64) == (([1, 2],), None)
    # preempted: blocks freed; resumed with new ones, all positions again
    assert saves.step("r", ([7, 8],), True, 32, 64) == (([7, 8],), None)
    assert saves.drop("r") is True  # saves of it went to the worker
    saves.add("q")
    assert saves.step("q", ([3],), False, 8, 64) is None  # no block complete yet
    assert saves.drop("q") is False
    assert saves.drop("unknown") is False
    assert saves.step("unknown", ([1],), False, 16, 16) is None
