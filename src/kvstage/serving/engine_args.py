"""The api_server flags a deployment's instances share, and the user's own on top.

Contract:
- `EngineArgs`: the flags every api_server of a deployment gets (None / False: vLLM's
  default, no flag); `DEFAULT_ENGINE_ARGS` is vLLM's defaults (what `PDCluster`,
  `single_instance` and `kvstage serve-pd` use unless told), `TINY_CPU_ENGINE_ARGS` the
  settings kvstage's CPU tests use for its tiny models.
- `with_user_flags(base, flags)`: ``base`` plus the user's api_server flags verbatim; a
  user flag replaces ``base``'s flag of the same name (never two of one flag on a command
  line, whose last would win silently); a flag kvstage sets per instance (`RESERVED_FLAGS`:
  its model, address, port, connector) raises `ServingError` in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvstage.serving.instances import ServingError

#: flags kvstage sets for each instance: the user's would break the router's view of it
RESERVED_FLAGS = {
    "--model": "give it as --model of serve-pd",
    "--host": "instances bind the address serve-pd gives them",
    "--port": "each instance gets its own port (the router's is --port of serve-pd)",
    "--kv-transfer-config": "serve-pd writes it (pass connector options as --kv-extra)",
    "--uds": "instances listen on TCP for the router",
}
#: the user's flag -> the EngineArgs field (and its "unset" value) it replaces
_FIELDS: dict[str, tuple[str, Any]] = {
    "--dtype": ("dtype", None), "--max-model-len": ("max_model_len", None),
    "--max-num-batched-tokens": ("max_num_batched_tokens", None),
    "--max-num-seqs": ("max_num_seqs", None), "--block-size": ("block_size", None),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", None), "--seed": ("seed", None),
    "--enforce-eager": ("enforce_eager", False),
    "--enable-prefix-caching": ("enable_prefix_caching", None),
    "--no-enable-prefix-caching": ("enable_prefix_caching", None),
}


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The api_server flags every instance of a deployment shares (None: vLLM's default)."""

    dtype: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    seed: int | None = None
    extra: tuple[str, ...] = ()  # further api_server flags, verbatim

    def argv(self) -> list[str]:
        out: list[str] = []
        for flag, value in (("--dtype", self.dtype), ("--max-model-len", self.max_model_len),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--max-num-seqs", self.max_num_seqs),
                            ("--block-size", self.block_size),
                            ("--kv-cache-memory-bytes", self.kv_cache_memory_bytes),
                            ("--seed", self.seed)):
            if value is not None:
                out += [flag, str(value)]
        if self.enforce_eager:
            out.append("--enforce-eager")
        if self.enable_prefix_caching is not None:
            out.append("--enable-prefix-caching" if self.enable_prefix_caching
                       else "--no-enable-prefix-caching")
        return out + list(self.extra)


#: the settings kvstage's CPU tests use for the tiny hybrid model (kvstage tiny-model)
TINY_CPU_ENGINE_ARGS = EngineArgs(
    dtype="float32", max_model_len=512, max_num_batched_tokens=120, max_num_seqs=16,
    block_size=32, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
    enable_prefix_caching=False, seed=0,
)


DEFAULT_ENGINE_ARGS = EngineArgs()


def flag_names(flags: Sequence[str]) -> list[str]:
    """The ``--name`` of every flag in ``flags`` (``--x=1`` and ``--x 1`` alike)."""
    return [f.split("=", 1)[0] for f in flags if f.startswith("--")]


def with_user_flags(base: EngineArgs, flags: Sequence[str]) -> EngineArgs:
    names = flag_names(flags)
    for name in names:
        why = RESERVED_FLAGS.get(name)
        if why is not None:
            raise ServingError(f"api_server flag {name} is set by kvstage for each instance "
                               f"({why}); remove it from the flags after --")
    cleared = dict(_FIELDS[n] for n in names if n in _FIELDS)
    return replace(base, **cleared, extra=(*base.extra, *flags))
