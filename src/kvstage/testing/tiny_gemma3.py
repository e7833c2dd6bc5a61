"""A tiny, randomly initialised hybrid Gemma3 text model, built locally (no hub access).

Contract: `build_tiny_gemma3(path)` writes a HuggingFace checkpoint (config + safetensors)
that vLLM loads with ``skip_tokenizer_init=True`` (prompts as token ids), plus a word-level
tokenizer (`build_word_tokenizer`: tokenizer.json + tokenizer_config.json) for what needs
text, ``vllm serve`` and ``vllm bench serve``: one whitespace-separated word per token id,
so ids -> text -> ids round-trips for every id (decoded with special tokens kept). The model is a
hybrid KV cache on purpose: 3 sliding-window layers + 1 full-attention layer, so vLLM
makes several KV cache groups whose layers alias one physical tensor, the case kvstage's
host buffers exist for. Weights come from a fixed seed, so two builds are byte-identical
and two engines loading one directory compute the same thing.

Needs ``transformers`` (vLLM pulls it); imported lazily so ``kvstage.testing`` does not.
"""

from __future__ import annotations

import json
from pathlib import Path

# The shapes the tests and the bench rely on (block size is the engine's choice).
VOCAB_SIZE = 512
HIDDEN_SIZE = 64
NUM_LAYERS = 4  # layer_types below: 3 sliding-window, then 1 full attention
NUM_KV_HEADS = 1
HEAD_DIM = 64
SLIDING_WINDOW = 64  # tokens: 2 blocks of 32 (vLLM's CPU block size for this model)
MAX_POSITION_EMBEDDINGS = 1024
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID, "<unk>": UNK_ID}


def shared_config_kwargs(*, num_kv_heads: int = NUM_KV_HEADS) -> dict[str, object]:
    """The config fields both tiny models share (KV shapes, specials, dtype). 2 query heads:
    ``num_kv_heads`` 1 (the default) is replicated at tensor-parallel size 2, 2 is split."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )


def save_tiny_model(model_cls: type, config: object, path: str | Path, seed: int, *,
                    cast_to: str | None = None) -> Path:
    """Seed, build ``model_cls(config)`` (weights cast to ``cast_to``, e.g. "bfloat16",
    after the float32 init), write it and the word-level tokenizer to ``path``."""
    import torch

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config)
    if cast_to is not None:
        model = model.to(getattr(torch, cast_to))
    model.save_pretrained(out, safe_serialization=True)
    build_word_tokenizer(out)
    return out


def build_tiny_gemma3(path: str | Path, *, seed: int = 0,
                      num_kv_heads: int = NUM_KV_HEADS) -> Path:
    """Write the tiny model to ``path`` (created if missing) and return it. ``num_kv_heads=2``
    is the tensor-parallel variant (1 KV head per rank at size 2)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **shared_config_kwargs(num_kv_heads=num_kv_heads),
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * (NUM_LAYERS - 1) + ["full_attention"],
    )
    return save_tiny_model(Gemma3ForCausalLM, config, path, seed)


def word(token_id: int) -> str:
    """The word of a non-special token id (``w<id>``)."""
    return f"w{token_id}"


def build_word_tokenizer(path: str | Path) -> Path:
    """Write a WordLevel tokenizer with `VOCAB_SIZE` ids into ``path`` (must exist).

    Ids 0-3 are the specials the config names (pad, eos, bos) plus unk; every other id is
    the word ``w<id>``. No normalizer, no post-processor (nothing added to a prompt) and no
    decoder, so decoding joins words with one space and encoding splits on whitespace: the
    text of any id sequence encodes back to it. A tokenizer that splits inside a word
    (``Whitespace`` does, at ``<``) would not.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(path)
    vocab = dict(SPECIAL_TOKENS)
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_gemma3(sys.argv[1] if len(sys.argv) > 1 else "tiny-gemma3"))
