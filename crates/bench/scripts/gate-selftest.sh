#!/usr/bin/env bash
# Shows that the instruction-count gate catches a slowdown: copies the work
# tree (its tracked files, as they are now) to a scratch directory, adds a
# busy loop to the NBD request decoder there (Request::decode), runs the
# gate's NBD codec benchmarks against the committed baselines and expects the
# gate to exit 1 and name `nbd_request_decode_validate`. The repository
# itself is not touched. Builds in the repository's target directory (or
# GATE_SELFTEST_TARGET_DIR), so only the workspace crates are compiled again
# (a few minutes in release).
#
#   crates/bench/scripts/gate-selftest.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
scratch=$(mktemp -d /tmp/gate-selftest.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$scratch")
decoder="$scratch/crates/coronafs/src/proto/request.rs"
perl -0pi -e 's/(        Ok\(Request \{\n            flags: be_u16\(b, 4\),)/        \/\/ gate self-test: a deliberate slowdown of the decoder.\n        for i in 0..64u32 {\n            std::hint::black_box(i);\n        }\n$1/' "$decoder"
grep -q "gate self-test" "$decoder" || { echo "selftest: could not patch $decoder" >&2; exit 2; }
echo "selftest: Request::decode in $scratch now spins 64 times per header"

set +e
(cd "$scratch" && CARGO_TARGET_DIR="${GATE_SELFTEST_TARGET_DIR:-$root/target}" cargo bench -p bench --bench gate -- 'gate::cases::nbd_codec::*') 2>&1 | tee "$scratch/gate.log"
rc=${PIPESTATUS[0]}
set -e
echo "selftest: the gate exited $rc"
if [ "$rc" -ne 1 ]; then
  echo "selftest: FAILED: expected exit 1 from the gate" >&2
  exit 1
fi
if ! grep -E '^nbd_request_decode_validate\.mixed .*REGRESSION' "$scratch/gate.log" >/dev/null; then
  echo "selftest: FAILED: the gate did not name nbd_request_decode_validate" >&2
  exit 1
fi
echo "selftest: ok: the gate failed and named nbd_request_decode_validate"
