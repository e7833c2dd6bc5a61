#!/usr/bin/env bash
# GPU check for kvstage, on a machine with an NVIDIA GPU, all within 9.5 minutes:
#   1. a venv with a CUDA build of torch (TORCH_SPEC, default torch==2.13.0 from the
#      default index, whose Linux wheels are CUDA builds); reuses whatever is there
#   2. pytest -m gpu
#   3. kvstage bench copy --device cuda: the seed regime (16 and 48 layers, 6 blocks,
#      groups 1 2 3 6, h2d and d2h), scattered ids with 32 KiB pages, the bandwidth
#      regime (60 blocks) whose memcpy row (pinned host <-> device copy_) is the PCIe
#      limit, op counts (Memcpy HtoD/DtoH as in the PR's table) and peak memory
#   4. the decode pipeline and the queued prefill saves on CUDA (copy streams + events):
#      their gpu tests run in step 2; `python -m bench.transfer --pipeline --device cuda`
#      (needs nixl-cu12, installed best effort) writes pipeline.json/png: sequential vs
#      pipelined decode time, and the d2h hidden behind a matmul stand-in at prefill;
#      the saves alone (`python -m bench.chunked --device cuda`) run without NIXL
#   5. across TP sizes: the head-split d2h into 2 slices and one region's h2d of a
#      Llama-3.1-8B-sized rank (`python -m bench.tp_copy --device cuda`): bytes of every
#      region checked against the device, copy calls counted, GB/s beside whole-page
#      copies and one pinned memcpy of the same bytes (its gpu test runs in step 2)
#   6. a short table of every timing, printed last
# Every step runs under `timeout`; a failed step is recorded and the next still runs.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu-check-out)
# Env:   PYTHON (python3), VENV (.venv-gpu), TORCH_SPEC, PIP_ARGS (e.g. offline:
#        "--no-index --find-links /wheels"; default: that with ./.whl when it exists),
#        BUDGET_S (560), ITERS (200). When PYTHON itself already has a CUDA torch (an
#        image with PyTorch, no network), it is used as it is and only the missing pure
#        packages (pyzmq, msgspec: carry their wheels in .whl) are installed into it.
set -uo pipefail # no -e: every step reports, the summary says what failed

cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${1:-${OUT:-gpu-check-out}}
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -z "${PIP_ARGS:-}" ] && [ -d .whl ]; then PIP_ARGS="--no-index --find-links .whl"; fi
PIP_ARGS=${PIP_ARGS:-}
BUDGET_S=${BUDGET_S:-560}
ITERS=${ITERS:-200}
PY="$VENV/bin/python"
if "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=$(command -v "$PYTHON")  # its CUDA torch as it is: a venv would not see it
fi
START=$SECONDS
FAILED=0
RESULTS=()
mkdir -p "$OUT_DIR"
# run kvstage from this checkout without installing it (works offline, no build step)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_S CMD...: run CMD under timeout, never past the overall budget
step() {
    local name=$1 limit=$2 t0=$SECONDS left rc
    shift 2
    left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 15)); then
        RESULTS+=("$name: SKIPPED (budget of ${BUDGET_S}s spent)")
        FAILED=1
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "== $name (timeout ${limit}s, $((SECONDS - START))s elapsed)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then
        RESULTS+=("$name: TIMEOUT after ${limit}s")
    else
        RESULTS+=("$name: rc=$rc in $((SECONDS - t0))s")
    fi
    ((rc == 0)) || FAILED=1
    return "$rc"
}

# pip-install only what is missing: torch (CUDA) first and alone, then the extras
setup() {
    set -e
    [ -x "$PY" ] || [ "$PY" = "$(command -v "$PYTHON")" ] \
        || "$PYTHON" -m venv --system-site-packages "$VENV"
    if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        # shellcheck disable=SC2086  # PIP_ARGS is a list of flags
        "$PY" -m pip install -q $PIP_ARGS "$TORCH_SPEC"
    fi
    if ! "$PY" -c 'import numpy, zmq, msgspec, pytest, pytest_timeout, hypothesis, matplotlib' \
        2>/dev/null; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q $PIP_ARGS numpy pyzmq msgspec pytest pytest-timeout \
            hypothesis matplotlib
    fi
    # the pipeline bench needs NIXL and xxhash; without them (offline) that step fails alone
    # shellcheck disable=SC2086
    "$PY" -c 'import nixl_cu12, xxhash' 2>/dev/null \
        || "$PY" -m pip install -q $PIP_ARGS nixl-cu12==1.5.1 xxhash \
        || echo "nixl-cu12/xxhash not installed: the pipeline step will fail" >&2
    "$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), (
    f"torch {torch.__version__} sees no CUDA device: no GPU, or a CPU build of torch is "
    "in the venv (pip keeps it): remove the venv, or pass a CUDA TORCH_SPEC/PIP_ARGS "
    "(e.g. PIP_ARGS='--index-url https://download.pytorch.org/whl/cu128')")
print(f"torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}")
EOF
}

gpu_tests() {
    "$PY" -m pytest -q -m gpu -p no:cacheprovider
    local rc=$?
    if ((rc == 5)); then
        echo "no tests are marked gpu yet: nothing to run (not a failure)"
        return 0
    fi
    return "$rc"
}

# an array, not a function: `timeout` runs commands, it cannot call shell functions
BENCH=("$PY" -m kvstage.cli bench copy --device cuda)

summary() {
    "$PY" - "$OUT_DIR" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':<10} {'case':<8} {'dir':<4} {'per_group':>10} {'coalesced':>10} {'fused':>9} "
      f"{'memcpy':>9} {'x coal':>7} {'fused GB/s':>10} {'memcpy GB/s':>11}")
for name in ("seed", "scattered", "bandwidth"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name:<10} (no results)")
        continue
    rows = json.loads(path.read_text())["timings"]
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["direction"]), {})[r["strategy"]] = r
    for (case, direction), s in by.items():
        fused = next((v for k, v in s.items() if k.startswith("fused") and k != "fused plan"), None)
        med = lambda k: s[k]["median_us"] if k in s else float("nan")
        gbps = lambda r: (r or {}).get("gbps") or float("nan")
        x = med("coalesced") / fused["median_us"] if fused else float("nan")
        print(f"{name:<10} {case:<8} {direction:<4} {med('per_group'):>10.1f} "
              f"{med('coalesced'):>10.1f} {fused['median_us'] if fused else float('nan'):>9.1f} "
              f"{med('memcpy'):>9.1f} {x:>6.1f}x {gbps(fused):>10.2f} {gbps(s.get('memcpy')):>11.2f}")
print("median us per request; memcpy = one pinned host <-> device copy_ of fused's bytes")
EOF
}

step nvidia-smi 20 nvidia-smi -L
step setup 240 bash -c "$(declare -f setup); PY='$PY' PYTHON='$PYTHON' VENV='$VENV' \
TORCH_SPEC='$TORCH_SPEC' PIP_ARGS='$PIP_ARGS' setup" || {
    echo "setup failed: no CUDA torch, nothing else can run" >&2
    printf '%s\n' "${RESULTS[@]}"
    exit 1
}
step pytest-gpu 60 bash -c "$(declare -f gpu_tests); PY='$PY' gpu_tests"
# pinned host memory sized exactly: host bytes == device pool bytes, torch's caching host
# allocator untouched, and what torch's own pin_memory=True reserves for the same pool
step pinned 60 "$PY" scripts/pinned_check.py --gib 3.2 --json "$OUT_DIR/pinned.json"
step seed 90 "${BENCH[@]}" --num-layers 16 48 --blocks-per-request 6 --groups 1 2 3 6 \
    --direction both --iters "$ITERS" --json "$OUT_DIR/seed.json" --plot "$OUT_DIR/seed.png"
step scattered 45 "${BENCH[@]}" --ids scattered --blocks-per-request 6 --groups 1 2 3 6 \
    --host-layout block_major mirror --direction both --iters "$ITERS" \
    --json "$OUT_DIR/scattered.json"
step bandwidth 45 "${BENCH[@]}" --blocks-per-request 60 --groups 1 3 --direction both --iters 50 \
    --json "$OUT_DIR/bandwidth.json"
step op-counts 45 "${BENCH[@]}" --blocks-per-request 6 --groups 1 2 3 6 --op-counts --memory \
    --no-timing --json "$OUT_DIR/op_counts.json"
step memory-gemma 45 "${BENCH[@]}" --preset gemma-3-1b --memory --no-timing --direction h2d \
    --json "$OUT_DIR/memory_gemma.json"
# the prefill's background saves alone (no NIXL): SaveQueue's copy stream, which the vLLM
# connector's chunk_saves uses on CUDA; 2048x2048 matmuls keep the stand-in GPU-bound
step saves 60 "$PY" -m bench.chunked --device cuda --matmul-n 2048 --sizes-mib 32,128,512 \
    --json "$OUT_DIR/saves.json"
if ! "$PY" -c 'import nixl_cu12' 2>/dev/null; then
    RESULTS+=("pipeline: SKIPPED (no nixl-cu12: its wheel is over what a device call carries)")
else step pipeline 120 "$PY" -m bench.transfer --pipeline --device cuda \
    --preset llama-3.1-8b --num-blocks 160 --sizes-mib 8 32 128 --iters 5 --markdown \
    --json "$OUT_DIR/pipeline.json" --plot "$OUT_DIR/pipeline.png"
fi
step tp-copy 60 "$PY" -m bench.tp_copy --device cuda --iters 50 --json "$OUT_DIR/tp_copy.json"
step summary 20 bash -c "$(declare -f summary); PY='$PY' OUT_DIR='$OUT_DIR' summary"

echo "== steps ($((SECONDS - START))s of ${BUDGET_S}s)"
printf '  %s\n' "${RESULTS[@]}"
exit "$FAILED"
