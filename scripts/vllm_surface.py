"""Print the vLLM surface kvstage's connector relies on, from a wheel or an installed tree.

    python scripts/vllm_surface.py --wheel /tmp/v033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/vllm_surface.py            # the vLLM installed in this interpreter

Nothing is imported from vLLM: the sources are parsed (`kvstage.integrations.vllm.surface`),
so a CUDA wheel is read on a CPU-only machine. Get a wheel without installing it with
``pip download --no-deps vllm==X.Y.Z -d DIR``. The output is the Python literal to paste
into ``SURFACES`` in tests/integrations/test_vllm_surface.py once the new version has been
checked (read what changed, run tests/system/vllm against it). ``--diff VERSION`` prints
only the entries that differ from that recorded version. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from kvstage.integrations.vllm.surface import (
    Source,
    package_version,
    read_surface,
    tree_source,
    wheel_source,
)


def installed_tree() -> Path | None:
    """The directory holding the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", help="a vLLM wheel (.whl) to read")
    parser.add_argument("--tree", help="a directory holding the vllm package")
    parser.add_argument("--diff", metavar="VERSION",
                        help="print only what differs from this recorded version")
    args = parser.parse_args(argv)
    source: Source
    if args.wheel:
        if not Path(args.wheel).is_file() or not args.wheel.endswith(".whl"):
            print(f"error: --wheel expects a .whl file, got {args.wheel!r}; get one with "
                  "`pip download --no-deps vllm==X.Y.Z -d DIR`", file=sys.stderr)
            return 2
        source = wheel_source(args.wheel)
    else:
        tree = Path(args.tree) if args.tree else installed_tree()
        if tree is None or not (tree / "vllm" / "__init__.py").is_file():
            print(f"error: no vllm package under {tree}; pass --tree DIR (the directory "
                  "that holds vllm/) or --wheel FILE", file=sys.stderr)
            return 2
        source = tree_source(tree)
    version = package_version(source)
    surface = read_surface(source)
    if args.diff:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.integrations.test_vllm_surface import SURFACES

        recorded = SURFACES.get(args.diff)
        if recorded is None:
            print(f"error: no recorded surface for {args.diff!r}; recorded: "
                  f"{sorted(SURFACES)}", file=sys.stderr)
            return 2
        for key in sorted(set(surface) | set(recorded)):
            if surface.get(key) != recorded.get(key):
                print(f"{key}\n  {args.diff}: {recorded.get(key)}\n  {version}: {surface.get(key)}")
        return 0
    body = ",\n".join(f"        {json.dumps(k)}: {json.dumps(v)}" for k, v in surface.items())
    print(f'    "{version}": {{\n{body},\n    }},')
    return 0


if __name__ == "__main__":
    sys.exit(main())
