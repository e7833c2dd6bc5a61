"""The tiny Gemma3's word-level tokenizer: what `vllm serve` and `vllm bench serve` load.

Token ids -> text -> token ids must round-trip exactly (the serving tests compare
completions token for token, and vLLM's random dataset decodes sampled ids to text and
encodes them back); the specials must be the config's bos/eos/pad ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs tokenizers (in .venv-vllm)")
transformers = pytest.importorskip("transformers", reason="needs transformers (in .venv-vllm)")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tok")
    # the ids the model's config names (build_tiny_gemma3 writes these; no weights here)
    (path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3_text", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
         "vocab_size": VOCAB_SIZE}))
    build_word_tokenizer(path)
    assert {p.name for p in Path(path).iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_specials_match_the_config(tokenizer: Any) -> None:
    t = tokenizer
    assert (t.pad_token_id, t.eos_token_id, t.bos_token_id, t.unk_token_id) == (0, 1, 2, 3)
    assert t.vocab_size == len(t) == VOCAB_SIZE
    assert t.num_special_tokens_to_add() == 0  # nothing is added to a prompt


def test_every_id_round_trips(tokenizer: Any) -> None:
    t = tokenizer
    ids = list(range(VOCAB_SIZE))
    assert t.encode(t.decode(ids, skip_special_tokens=False)) == ids
    rng = np.random.default_rng(0)
    for n in (1, 7, 300):
        sample = rng.integers(4, VOCAB_SIZE, size=n).tolist()  # no specials: skip is a no-op
        text = t.decode(sample)
        assert t(text).input_ids == sample
        assert text == " ".join(f"w{i}" for i in sample)
