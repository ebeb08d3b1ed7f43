#!/usr/bin/env bash
# Long fuzzing runs of the fuzz tests (dataplane/tests/fuzz.rs, agent/tests/fuzz.rs): every
# target runs batch after batch of cases, each batch with a fresh random seed, until DURATION
# is spent, then a summary per target (cases, panics, hangs) is printed. No root needed.
#
#   scripts/fuzz.sh 10m                 # about ten minutes in all
#   scripts/fuzz.sh 1h nft_dump         # only the targets whose name contains nft_dump
#   FUZZ_THREADS=4 scripts/fuzz.sh 30m  # targets run 4 at a time (default: 2)
#
# DURATION: seconds, or a number with s, m or h. Exit status: 0 if no target panicked, hung or
# crashed; 1 otherwise. The full output goes to target/fuzz-logs/ (failures name the seed and
# the command that reproduces them). Debug builds are used on purpose: they check arithmetic
# overflow, which release builds do not.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,13s/^# \{0,1\}//p' "$0"
    exit 2
}
[[ $# -ge 1 ]] || usage
case "$1" in
    *h) total=$(( ${1%h} * 3600 )) ;;
    *m) total=$(( ${1%m} * 60 )) ;;
    *s) total=${1%s} ;;
    *[!0-9]*|'') usage ;;
    *) total=$1 ;;
esac
shift
filter=("$@")
threads=${FUZZ_THREADS:-2}

echo "building the fuzz tests ..."
build_log=$(mktemp)
if ! cargo test -p nftproxy-dataplane -p nftproxy --test fuzz --no-run \
        --message-format=json-render-diagnostics >"$build_log"; then
    rm -f "$build_log"
    echo "build failed" >&2
    exit 1
fi
# "package:executable" of each fuzz test binary.
declare -A package_of
binaries=()
while IFS= read -r line; do
    exe=$(grep -o '"executable":"[^"]*"' <<<"$line" | cut -d'"' -f4)
    pkg=$(grep -o '"package_id":"[^"]*"' <<<"$line" | sed 's/.*#\([^@"]*\)@.*/\1/')
    [[ -n $exe ]] || continue
    binaries+=("$exe")
    package_of[$exe]=$pkg
done < <(grep '"name":"fuzz"' "$build_log")
rm -f "$build_log"
[[ ${#binaries[@]} -ge 1 ]] || { echo "no fuzz test binaries found" >&2; exit 1; }

# Targets per binary (after the filter), to share the time out.
declare -A targets_of
count=0
for bin in "${binaries[@]}"; do
    # Every test of these binaries is a fuzz target but the regression cases.
    list=$("$bin" --list --format terse "${filter[@]}" 2>/dev/null | sed -n 's/: test$//p' \
        | grep -v '^regression' || true)
    n=$(printf '%s\n' "$list" | grep -c . || true)
    targets_of[$bin]=$n
    count=$(( count + n ))
done
[[ $count -ge 1 ]] || { echo "no fuzz target matches: ${filter[*]}" >&2; exit 1; }

# Each binary runs its targets `threads` at a time; a target gets the same share of the time
# whichever binary it is in.
rounds=0
for bin in "${binaries[@]}"; do
    rounds=$(( rounds + (targets_of[$bin] + threads - 1) / threads ))
done
per_target=$(( total / rounds ))
(( per_target >= 1 )) || per_target=1

logs=target/fuzz-logs
mkdir -p "$logs"
stamp=$(date +%Y%m%d-%H%M%S)
echo "fuzzing $count targets for about ${total}s: ${per_target}s each, $threads at a time"
start=$(date +%s)
failed=0
summaries=()
for bin in "${binaries[@]}"; do
    (( targets_of[$bin] > 0 )) || continue
    pkg=${package_of[$bin]}
    log="$logs/$stamp-$pkg.log"
    echo "  $pkg: ${targets_of[$bin]} targets, log $log"
    set +e
    NFTPROXY_FUZZ_SEED=random NFTPROXY_FUZZ_SECONDS=$per_target RUST_BACKTRACE=0 \
        "$bin" --nocapture --test-threads="$threads" "${filter[@]}" >"$log" 2>&1
    status=$?
    set -e
    mapfile -t lines < <(grep '^FUZZ-SUMMARY' "$log" || true)
    summaries+=("${lines[@]}")
    if grep -q '^FUZZ-FAILURE' "$log"; then
        failed=1
        grep -A3 '^FUZZ-FAILURE' "$log" | sed 's/^/    /'
    fi
    if (( status != 0 )) && ! grep -q '^FUZZ-FAILURE' "$log"; then
        # Not a failing target: the process itself died (a stack overflow aborts it).
        failed=1
        echo "    CRASH: the test process exited with status $status:"
        tail -5 "$log" | sed 's/^/    /'
    fi
done
elapsed=$(( $(date +%s) - start ))

field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p"; }
echo
printf '%-36s %10s %8s %7s %6s  %s\n' target cases seconds panics hangs reached
total_cases=0; total_panics=0; total_hangs=0
for line in "${summaries[@]}"; do
    [[ -n $line ]] || continue
    t=$(field target <<<"$line"); c=$(field cases <<<"$line"); ms=$(field ms <<<"$line")
    p=$(field panics <<<"$line"); h=$(field hangs <<<"$line")
    r=$(sed -n 's/.*reached=\[\(.*\)\].*/\1/p' <<<"$line")
    printf '%-36s %10s %8s %7s %6s  %s\n' "$t" "$c" "$(( ms / 1000 ))" "$p" "$h" "$r"
    total_cases=$(( total_cases + c )); total_panics=$(( total_panics + p ))
    total_hangs=$(( total_hangs + h ))
done
printf '%-36s %10s %8s %7s %6s\n' "all ${#summaries[@]} targets" "$total_cases" "$elapsed" \
    "$total_panics" "$total_hangs"
if (( failed )); then
    echo "FAILED: see $logs/$stamp-*.log"
    exit 1
fi
echo "no panics, no hangs, no crashes"
