#!/usr/bin/env bash
# Run last in a device call (`bash scripts/device/X.sh; bash scripts/device/pack_out.sh`): a call brings back
# at most 8 files from $OUT, none deeper than $OUT/a/b/file. When more are there, everything but up to 6
# top-level summaries (*.md, *.txt) goes into $OUT/results.tgz, which comes back whole.
set -uo pipefail
cd "${OUT:?no OUT}" || exit 1
total=$(find . -type f | wc -l)
deep=$(find . -mindepth 3 -type f | wc -l)
(( total <= 8 && deep == 0 )) && exit 0
mapfile -t keep < <(find . -maxdepth 1 -type f \( -name '*.md' -o -name '*.txt' \) | sort | head -6)
tar czf /tmp/results.tgz --exclude=./results.tgz "${keep[@]/#/--exclude=}" . && mv /tmp/results.tgz results.tgz
spared=(); for k in "${keep[@]}"; do spared+=(! -name "${k#./}"); done  # (an empty list adds nothing)
find . -mindepth 1 -maxdepth 1 ! -name results.tgz "${spared[@]}" -exec rm -rf {} +
echo "packed $total files into \$OUT/results.tgz ($(du -h results.tgz | cut -f1)); kept: ${keep[*]:-none}"
