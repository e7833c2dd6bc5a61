"""Specs of one layer's KV cache pages: attention (full, sliding window, MLA) and state
(`MambaSpec`: Mamba1/2, gated delta net, short conv, linear attention).

Frozen keyword-only dataclasses, as vLLM's ``kv_cache_interface``: groups are bucketed by
spec equality (which includes the class), derived byte sizes are properties
(``page_size_bytes``). `kvstage.layout` groups them and re-exports every name here.

A state spec's page is opaque to kvstage: a request holds one running-state slot (plus
speculative scratch slots) whatever its length, and a copy moves whole slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """kvstage's name of a torch dtype (ValueError for one it does not copy)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(
            f"dtype {dtype} is not one kvstage copies; expected one of {sorted(DTYPES)}"
        )
    return name


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{owner}.{name} must be a positive int, got {value!r}; "
                f"pass e.g. {name}=16"
            )


class _Dtyped:
    """``torch_dtype`` and ``dtype_bytes`` of a spec's ``dtype`` name (a field of the
    attention specs, derived from the states' dtypes for `MambaSpec`)."""

    @property
    def dtype(self) -> str:
        raise NotImplementedError

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(_Dtyped):
    """Base of the attention specs: K and V of ``num_kv_heads`` heads of ``head_size`` per
    token. Use a concrete subclass (`FullAttentionSpec`, `SlidingWindowSpec`, `MLASpec`);
    as in vLLM's ``kv_cache_interface``, groups are bucketed by spec equality, which
    includes the class."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require_positive(
            type(self).__name__,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{type(self).__name__}.dtype must be one of {sorted(DTYPES)}, "
                f"got {self.dtype!r}"
            )

    @property
    def num_kv_planes(self) -> int:
        """2 (K and V); MLA stores a single latent plane."""
        return 2

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer, planes first."""
        return (self.num_kv_planes, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (llama-3.1-8b: 2*16*8*128*2 = 64 KiB)."""
        return math.prod(self.block_shape) * self.dtype_bytes

    def max_blocks_per_request(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention: every token of the request is attended, so every block moves."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: only the last ``sliding_window`` tokens are attended."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("SlidingWindowSpec", sliding_window=self.sliding_window)

    @property
    def blocks_per_window(self) -> int:
        """vLLM's exchange clip: cdiv(window, block_size) + 1 (512 / 16 -> 33)."""
        return cdiv(self.sliding_window, self.block_size) + 1

    def max_blocks_per_request(self, num_tokens: int) -> int:
        return min(super().max_blocks_per_request(num_tokens), self.blocks_per_window)


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """Multi-head latent attention: one plane of ``head_size`` = latent + rope dims."""

    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(f"MLASpec.num_kv_heads must be 1, got {self.num_kv_heads}")

    @property
    def num_kv_planes(self) -> int:
        return 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.head_size)


#: vLLM's ``MambaAttentionBackendEnum`` kinds kvstage knows (what each layer keeps per state
#: slot): Mamba1 (conv, ssm), Mamba2 (conv, ssm), gated delta net (conv, recurrent),
#: short conv (conv), linear attention (one state).
MAMBA_TYPES = ("mamba1", "mamba2", "gdn_attention", "short_conv", "linear_attention")
#: conv state orientation inside a state page: DS (dim, state_len), vLLM's
#: ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, which vLLM's NIXL connector requires; SD the other.
CONV_LAYOUTS = ("DS", "SD")


@dataclass(frozen=True, kw_only=True)
class MambaSpec(_Dtyped):
    """A state group's layer (vLLM's ``MambaSpec``): per state slot, the states of
    ``shapes[i]`` and ``dtypes[i]`` laid one after the other in a page of
    ``page_size_bytes`` (``page_size_padded`` when vLLM pads it to the attention page).

    A request holds ONE running-state slot (plus ``num_speculative_blocks`` scratch slots),
    whatever its length (vLLM's ``mamba_cache_mode`` "none"): the slot is rewritten in place
    by every chunk, so what a decode needs is the slot after the prefill's last chunk.
    ``block_size`` is the tokens one slot stands for in vLLM's block table (its
    ``max_model_len`` in "none" mode); it never sizes a copy.
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    conv_layout: str = "DS"
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        _require_positive("MambaSpec", block_size=self.block_size)
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes; pass e.g. shapes=((96, 3), (4, 16, 16)), "
                "dtypes=('float32', 'float32')"
            )
        for shape in self.shapes:
            if not shape or any(not isinstance(n, int) or n <= 0 for n in shape):
                raise ValueError(f"MambaSpec.shapes must hold positive ints, got {shape!r}")
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(
                    f"MambaSpec.dtypes must be in {sorted(DTYPES)}, got {dtype!r}"
                )
        if self.mamba_type not in MAMBA_TYPES:
            raise ValueError(
                f"MambaSpec.mamba_type must be one of {MAMBA_TYPES}, got {self.mamba_type!r}"
            )
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(
                f"MambaSpec.conv_layout must be one of {CONV_LAYOUTS}, got {self.conv_layout!r}"
            )
        if self.num_speculative_blocks < 0:
            raise ValueError(
                f"MambaSpec.num_speculative_blocks must be >= 0, got {self.num_speculative_blocks}"
            )
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise ValueError(
                f"MambaSpec.page_size_padded {self.page_size_padded} is smaller than the "
                f"states it holds ({self.state_bytes} B)"
            )

    @property
    def state_bytes(self) -> int:
        """Bytes of the states of one slot, without padding (vLLM's
        ``state_content_size_bytes``)."""
        return sum(
            math.prod(shape) * DTYPES[d].itemsize
            for shape, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one slot of one layer (padded to the attention page in a hybrid pool)."""
        return self.page_size_padded if self.page_size_padded is not None else self.state_bytes

    @property
    def dtype(self) -> str:
        """The states' common dtype; "uint8" (bytes) when they differ."""
        return self.dtypes[0] if len(set(self.dtypes)) == 1 else "uint8"

    @property
    def num_kv_planes(self) -> int:
        """One opaque page per slot (no K/V split)."""
        return 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.page_size_bytes // self.dtype_bytes,)

    @property
    def num_state_blocks(self) -> int:
        """Slots a request holds: the running state plus the speculative scratch slots."""
        return 1 + self.num_speculative_blocks

    def max_blocks_per_request(self, num_tokens: int) -> int:
        del num_tokens  # the state does not grow with the prompt
        return self.num_state_blocks

    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state inside a slot (conv first, as vLLM lays them)."""
        out, at = [], 0
        for shape, d in zip(self.shapes, self.dtypes, strict=True):
            out.append(at)
            at += math.prod(shape) * DTYPES[d].itemsize
        return tuple(out)

    @classmethod
    def mamba2(
        cls, *, block_size: int, intermediate_size: int, n_groups: int, num_heads: int,
        head_dim: int, state_size: int, conv_kernel: int, dtype: str = "bfloat16",
        ssm_dtype: str | None = None, tp_size: int = 1, page_size_padded: int | None = None,
    ) -> MambaSpec:
        """A Mamba2 layer's states as vLLM shapes them (``mamba2_state_shape``, DS conv):
        conv ``(conv_dim / tp, conv_kernel - 1)`` with conv_dim = intermediate +
        2 x n_groups x state, ssm ``(num_heads / tp, head_dim, state_size)``."""
        groups = n_groups + (0 if n_groups % tp_size == 0 else tp_size - n_groups)
        conv_dim = intermediate_size + 2 * groups * state_size
        return cls(
            block_size=block_size,
            shapes=((conv_dim // tp_size, conv_kernel - 1),
                    (num_heads // tp_size, head_dim, state_size)),
            dtypes=(dtype, ssm_dtype or dtype), page_size_padded=page_size_padded,
            mamba_type="mamba2",
        )

    @classmethod
    def gated_delta_net(
        cls, *, block_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
        head_v_dim: int, conv_kernel: int, dtype: str = "bfloat16",
        ssm_dtype: str | None = None, tp_size: int = 1, page_size_padded: int | None = None,
    ) -> MambaSpec:
        """A gated delta net layer's states (``gated_delta_net_state_shape``, DS conv):
        conv ``(conv_dim / tp, conv_kernel - 1)`` with conv_dim = 2 x k_heads x k_dim +
        v_heads x v_dim, recurrent ``(v_heads / tp, head_v_dim, head_k_dim)``."""
        conv_dim = 2 * head_k_dim * num_k_heads + head_v_dim * num_v_heads
        return cls(
            block_size=block_size,
            shapes=((conv_dim // tp_size, conv_kernel - 1),
                    (num_v_heads // tp_size, head_v_dim, head_k_dim)),
            dtypes=(dtype, ssm_dtype or dtype), page_size_padded=page_size_padded,
            mamba_type="gdn_attention",
        )

    def padded_to(self, page_size_bytes: int) -> MambaSpec:
        """This spec with its page padded to ``page_size_bytes`` (vLLM's unification)."""
        return replace(self, page_size_padded=page_size_bytes)


#: any group's spec
KVSpec = AttentionSpec | MambaSpec
