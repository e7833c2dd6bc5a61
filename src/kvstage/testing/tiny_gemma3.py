"""A tiny, randomly initialised hybrid Gemma3 text model, built locally (no hub access).

Contract: `build_tiny_gemma3(path)` writes a HuggingFace checkpoint (config + safetensors)
that vLLM loads with ``skip_tokenizer_init=True`` (prompts as token ids). The model is a
hybrid KV cache on purpose: 3 sliding-window layers + 1 full-attention layer, so vLLM
makes several KV cache groups whose layers alias one physical tensor, the case kvstage's
host buffers exist for. Weights come from a fixed seed, so two builds are byte-identical
and two engines loading one directory compute the same thing.

Needs ``transformers`` (vLLM pulls it); imported lazily so ``kvstage.testing`` does not.
"""

from __future__ import annotations

from pathlib import Path

# The shapes the tests and the bench rely on (block size is the engine's choice).
VOCAB_SIZE = 512
HIDDEN_SIZE = 64
NUM_LAYERS = 4  # layer_types below: 3 sliding-window, then 1 full attention
NUM_KV_HEADS = 1
HEAD_DIM = 64
SLIDING_WINDOW = 64  # tokens: 2 blocks of 32 (vLLM's CPU block size for this model)
MAX_POSITION_EMBEDDINGS = 1024


def build_tiny_gemma3(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny model to ``path`` (created if missing) and return it."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * (NUM_LAYERS - 1) + ["full_attention"],
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_gemma3(sys.argv[1] if len(sys.argv) > 1 else "tiny-gemma3"))
