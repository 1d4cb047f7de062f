#!/bin/sh
# Every tier, and mlx4g32 with --boundary-protect 2, through the command line on the sample:
# build, inspect, ask. Usage: benchmarks/tiers_cli.sh [OUT_DIR] [MAX_TOKENS]   (transcript on stdout)
set -e
OUT=${1:-out/tiers-cli}
MAX=${2:-30}
BIN=${BIN:-.venv/bin}
Q="Who publishes revised versions of the GNU Lesser General Public License?"
mkdir -p "$OUT"
run() {  # run NAME BUILD-OPTIONS...
    name=$1; shift
    echo "### $name"
    echo "\$ cartridge build samples/lgpl-3.0.txt -o $OUT/$name.cart $*"
    "$BIN/cartridge" build samples/lgpl-3.0.txt -o "$OUT/$name.cart" --force "$@" 2>/dev/null
    echo "\$ cartridge inspect $OUT/$name.cart"
    "$BIN/cartridge" inspect "$OUT/$name.cart"
    echo "\$ cartridge ask $OUT/$name.cart \"$Q\" --max-tokens $MAX"
    "$BIN/cartridge" ask "$OUT/$name.cart" "$Q" --max-tokens "$MAX" 2>&1
    echo
}
for tier in fp16 bf16 int8 mlx4g32 fp8 mxfp4 nvfp4 turbo4 turbo3 turbo2; do
    run "$tier" --tier "$tier"
done
run mlx4g32-bp2 --tier mlx4g32 --boundary-protect 2
