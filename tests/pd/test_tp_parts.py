"""`kvstage.pd.tp_parts`: a page cut into parts, exactly (segments, signatures, refusals)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstage.errors import LayoutMismatch
from kvstage.pd.tp_parts import head_units, page_parts, state_units
from kvstage.specs import MambaSpec

H, N, C, F32 = 4, 2, 4, 4  # heads, tokens, elements per token and head, bytes per element
HEAD = N * C * F32  # one head of one kernel block, bytes


def cut(units: tuple[np.ndarray, np.ndarray], fields: list[tuple[str, int]], parts: int,
        page: int) -> list[tuple[tuple[int, int, int], ...]]:
    return list(page_parts([(units, fields)], parts, page, 1).groups[0].segments)


def test_head_major_page_is_one_range_per_part() -> None:
    page = H * HEAD
    units = head_units((8, H, N, C), (H * N * C, N * C, C, 1), F32, page, H)
    assert cut(units, [("heads", H)], 2, page) == [((0, 0, 2 * HEAD),),
                                                   ((2 * HEAD, 0, 2 * HEAD),)]
    assert cut(units, [("heads", H)], 4, page)[3] == ((3 * HEAD, 0, HEAD),)
    parts = page_parts([(units, [("heads", H)])], 2, page, 3)
    assert parts.groups[0].signature == (("heads", 2, HEAD),)
    assert (parts.part_bytes, parts.row_bytes) == (page // 2, 3 * page // 2)


def test_token_major_page_cuts_per_token() -> None:
    """LBNHC ([blocks, tokens, heads, C] in memory): a part is one range per token."""
    page = H * HEAD
    row = C * F32
    units = head_units((8, H, N, C), (N * H * C, C, H * C, 1), F32, page, H)
    assert cut(units, [("heads", H)], 2, page) == [
        ((0, 0, 2 * row), (H * row, 2 * row, 2 * row)),
        ((2 * row, 0, 2 * row), (H * row + 2 * row, 2 * row, 2 * row)),
    ]


def test_two_kernel_blocks_per_page() -> None:
    """vLLM's kernel blocks (a logical page = r kernel pages): a range per kernel block."""
    page = 2 * H * HEAD
    units = head_units((16, H, N, C), (H * N * C, N * C, C, 1), F32, page, H)
    assert cut(units, [("heads", H)], 2, page) == [
        ((0, 0, 2 * HEAD), (H * HEAD, 2 * HEAD, 2 * HEAD)),
        ((2 * HEAD, 0, 2 * HEAD), (H * HEAD + 2 * HEAD, 2 * HEAD, 2 * HEAD)),
    ]


def test_attention_view_without_its_heads_is_refused() -> None:
    with pytest.raises(LayoutMismatch, match="no dim of 4 heads at 1"):
        head_units((8, N, H, C), (H * N * C, H * C, C, 1), F32, H * HEAD, H)


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_mamba2_state_parts(layout: str) -> None:
    """conv rows x (2 heads x 4), B, C (2 groups x 3 state); SSM (2 heads, 4, 3), padded."""
    heads, head_dim, groups, state, width = 2, 4, 2, 3, 3
    rows = heads * head_dim + 2 * groups * state
    conv = (rows, width) if layout == "DS" else (width, rows)
    spec = MambaSpec(block_size=64, shapes=(conv, (heads, head_dim, state)),
                     dtypes=("float32", "float32"), conv_layout=layout)
    page = 1024
    units, fields = state_units(spec, page)
    assert fields == [("x", 2), ("B", 2), ("C", 2), ("ssm_heads", 2)]
    parts = page_parts([(units, fields)], 2, page, 1)
    seg = parts.groups[0].segments
    conv_bytes = rows * width * 4
    ssm_head = head_dim * state * 4
    if layout == "DS":  # each field's half is one range of rows
        row = width * 4
        assert seg[1] == (
            (head_dim * row, 0, head_dim * row),  # x rows 4..8
            ((8 + state) * row, head_dim * row, state * row),  # B group 1
            ((8 + 2 * state + state) * row, (head_dim + state) * row, state * row),  # C g1
            (conv_bytes + ssm_head, (head_dim + 2 * state) * row, ssm_head),  # SSM head 1
        )
    else:  # SD: per conv column, the part's x, B and C rows
        assert len(seg[0]) == 3 * width + 1
    assert sum(n for *_, n in seg[0]) == sum(n for *_, n in seg[1]) == (
        conv_bytes // 2 + heads * ssm_head // 2)
    assert parts.groups[0].signature[0] == ("x", 1, head_dim * width * 4)


def test_a_field_that_does_not_split_is_refused_in_one_line() -> None:
    page = 3 * HEAD
    units = head_units((8, 3, N, C), (3 * N * C, N * C, C, 1), F32, page, 3)
    with pytest.raises(LayoutMismatch) as err:
        page_parts([(units, [("heads", 3)])], 2, page, 1, model="m")
    assert str(err.value) == (
        "group 0 of 'm': field 'heads' holds 3 units per rank, which do not split into 2 "
        "equal parts; serve prefill and decode at TP sizes it divides")


def test_a_slice_of_tp1_has_the_signature_of_a_tp2_page() -> None:
    """What the handshake compares: prefill TP 1 cut in 2 == decode TP 2 whole."""
    p_page, d_page = H * HEAD, H // 2 * HEAD
    p_units = head_units((8, H, N, C), (H * N * C, N * C, C, 1), F32, p_page, H)
    d_units = head_units((8, H // 2, N, C), (H // 2 * N * C, N * C, C, 1), F32, d_page, H // 2)
    prefill = page_parts([(p_units, [("heads", H)])], 2, p_page, 5)
    decode = page_parts([(d_units, [("heads", H // 2)])], 1, d_page, 5)
    assert prefill.signature() == decode.signature()
    other = page_parts([(p_units, [("heads", H)])], 1, p_page, 5)
    assert other.signature() != decode.signature()
