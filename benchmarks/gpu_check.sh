#!/usr/bin/env bash
# One prepared GPU check: `pytest -m gpu` plus the extraction, probe-sweep, retrieval and
# full-ranking (featcache against a plain PyTorch loop, both on the GPU) benchmarks at GPU
# sizes, each step bounded so the whole script ends within 9 minutes on one H200 (470 s of
# steps, each killed 10 s after its limit at worst). Results go to OUTDIR: extract.json,
# probe_sweep.json, retrieval.json, retrieval_full.json, a log per step and summary.json
# (mode, seconds, per-step rc / seconds / timed_out): 10 files.
#
#   benchmarks/gpu_check.sh OUTDIR            # on a CUDA machine
#   benchmarks/gpu_check.sh --dry OUTDIR      # same code paths on the CPU at tiny sizes
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh OUTDIR
#
# Needs featcache importable with its dependencies (PYTHON, default .venv/bin/python if
# present, else python3) and Fashion-MNIST at /usr/share/datasets/fashion-mnist (Debian's
# dataset-fashion-mnist). GPU_CHECK_BUDGET_S (default 470 s) bounds the five steps together;
# each step also has its own cap. Exit status: 0 when every step passed, else 1.
set -u

dry="${GPU_CHECK_DRY:-0}"
if [ "${1:-}" = "--dry" ]; then dry=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: $0 [--dry] OUTDIR" >&2
    exit 2
fi
out="$1"
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
budget="${GPU_CHECK_BUDGET_S:-470}"
mkdir -p "$out" || { echo "cannot create $out" >&2; exit 2; }
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/featcache-gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1

if ! "$PYTHON" -c "import featcache" 2>/dev/null; then
    echo "featcache is not importable with $PYTHON; install it first (pip install -e '.[cpu]' or '.[gpu]') or set PYTHON" >&2
    exit 2
fi
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    echo "Fashion-MNIST not found at /usr/share/datasets/fashion-mnist; apt-get install dataset-fashion-mnist" >&2
    exit 2
fi

if [ "$dry" = "1" ]; then
    mode=dry
    export CUDA_VISIBLE_DEVICES=""   # every automatic choice takes its CPU path
    # one BLAS/OpenMP thread: on a small shared CPU box, spinning BLAS threads made the
    # probe benchmark's scikit-learn loop ~30x slower (22 s vs 0.7 s for 10 tiny fits)
    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
    device=cpu
    # tiny sizes: the same scripts and code paths, seconds each
    extract_args=(--n 32 --input-size 64 --batch-size 16 --repeats 1 --workers 0)
    probe_args=(--n-train 200 --n-test 60 --input-size 64 --max-iter 50 --tol 1e-3)
    retrieval_args=(--n-query 60 --n-gallery 240 --naive-sample 10 --k 10)
    full_args=(--threads 1)
    caps=(75 60 120 60 60)
else
    mode=gpu
    if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "no CUDA GPU visible to torch; run with --dry for the CPU dry run" >&2
        exit 2
    fi
    device=cuda
    extract_args=(--n 4096 --input-size 224 --batch-size 256 --repeats 2)
    probe_args=(--n-train 10000 --n-test 2000 --input-size 112)
    retrieval_args=(--n-query 2000 --k 100 --naive-sample 200 --repeat 2)
    full_args=(--threads "$(nproc)")
    caps=(90 110 150 60 50)
fi
cache="$work/fmnist.zarr"

start=$(date +%s)
summary="$out/summary.jsonl"
: >"$summary"
failed=0

# run_step NAME CAP_S COMMAND...: bounded by min(CAP_S, what is left of the budget)
run_step() {
    local name="$1" cap="$2"
    shift 2
    local now left limit t0 rc secs
    now=$(date +%s)
    left=$((budget - (now - start)))
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, the ${budget}s budget is spent"
        printf '{"step": "%s", "mode": "%s", "rc": null, "seconds": 0, "timed_out": false, "skipped": true}\n' \
            "$name" "$mode" >>"$summary"
        failed=1
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    secs=$(($(date +%s) - t0))
    local timed_out=false
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
    # pytest -m gpu on a CPU box: every test is deselected or skipped (rc 5 = none collected)
    if [ "$name" = "pytest_gpu" ] && [ "$rc" -eq 5 ]; then rc=0; fi
    tail -n 3 "$out/$name.log"
    echo "== $name: rc=$rc in ${secs}s"
    printf '{"step": "%s", "mode": "%s", "rc": %d, "seconds": %d, "timed_out": %s, "skipped": false}\n' \
        "$name" "$mode" "$rc" "$secs" "$timed_out" >>"$summary"
    if [ "$rc" -ne 0 ]; then failed=1; fi
}

cd "$repo" || exit 2
export FEATCACHE_TEST_CACHE="$work/fixtures"
run_step pytest_gpu "${caps[0]}" "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests
run_step extract "${caps[1]}" "$PYTHON" benchmarks/extract_throughput.py --device "$device" \
    --data fashion-mnist "${extract_args[@]}" --tmp "$work" --json "$out/extract.json"
run_step probe_sweep "${caps[2]}" "$PYTHON" benchmarks/probe_sweep.py --cache "$cache" \
    --dataset fashion-mnist-small "${probe_args[@]}" --json "$out/probe_sweep.json"
run_step retrieval "${caps[3]}" "$PYTHON" benchmarks/retrieval.py --cache "$cache" \
    --dataset fashion-mnist-small --query test --gallery train "${retrieval_args[@]}" \
    --out "$out/retrieval.json"
run_step retrieval_full "${caps[4]}" "$PYTHON" benchmarks/retrieval_full.py --store "$cache" \
    --dataset fashion-mnist-small --device "$device" "${full_args[@]}" --json "$out/retrieval_full.json"

"$PYTHON" - "$summary" "$out/summary.json" "$mode" "$(($(date +%s) - start))" <<'EOF'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ok = all(s["rc"] == 0 for s in steps)
json.dump({"mode": sys.argv[3], "seconds": int(sys.argv[4]), "ok": ok, "steps": steps},
          open(sys.argv[2], "w"), indent=1)
EOF
rm -f "$summary"
echo "gpu_check ($mode): $([ "$failed" -eq 0 ] && echo passed || echo FAILED) in $(($(date +%s) - start))s; results in $out"
exit "$failed"
