"""`bench.chunked`: the chunk ranges the incremental-save bench saves."""

from __future__ import annotations

import pytest

from bench.chunked import chunk_ranges


@pytest.mark.parametrize("num_blocks", [4, 5, 16, 64, 710])
def test_chunks_cover_every_block_and_resave_only_cut_blocks(num_blocks: int) -> None:
    block_size = 16
    ranges = chunk_ranges(num_blocks, block_size)
    assert len(ranges) == 4
    assert ranges[0][0] == 0 and ranges[-1][1] == num_blocks
    saved = [b for a, z in ranges for b in range(a, z)]
    assert sorted(set(saved)) == list(range(num_blocks))
    again = sorted(b for b in set(saved) if saved.count(b) > 1)
    # a block is saved twice exactly when a boundary (at 20, 45, 75 % of the tokens)
    # falls inside it
    tokens = num_blocks * block_size
    cut = sorted({round(tokens * c) // block_size for c in (0.20, 0.45, 0.75)
                  if round(tokens * c) % block_size})
    assert again == cut


def test_a_prompt_of_64_blocks_has_three_cut_blocks() -> None:
    assert chunk_ranges(64, 16) == [(0, 13), (12, 29), (28, 48), (48, 64)]
