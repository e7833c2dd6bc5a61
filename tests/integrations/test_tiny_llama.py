"""The tiny non-hybrid Llama: every layer full attention, the tiny Gemma3's tokenizer and KV
shapes, byte-identical builds (the serving benchmark runs vLLM's NIXL host path on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (vLLM's venv has it)")

from kvstage.testing import tiny_gemma3  # noqa: E402
from kvstage.testing.tiny_llama import build_tiny_llama  # noqa: E402


def test_tiny_llama_is_full_attention_with_the_gemma_tokenizer(tmp_path: Path) -> None:
    llama = build_tiny_llama(tmp_path / "a")
    cfg = json.loads((llama / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "sliding_window" not in cfg or cfg["sliding_window"] is None
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        tiny_gemma3.NUM_LAYERS, tiny_gemma3.NUM_KV_HEADS, tiny_gemma3.HEAD_DIM)
    assert cfg["vocab_size"] == tiny_gemma3.VOCAB_SIZE
    gemma_tok = tiny_gemma3.build_word_tokenizer(tmp_path)
    assert (llama / "tokenizer.json").read_bytes() == (gemma_tok / "tokenizer.json").read_bytes()
    again = build_tiny_llama(tmp_path / "b")
    assert (again / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()
