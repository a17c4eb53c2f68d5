#!/usr/bin/env bash
# The Python package's part of the GPU bundle: installs the abi3 wheel and pytest's wheels offline
# into /tmp/site (once), then runs what is asked:
#   python/run.sh tests | bench [ARGS] | example NAME
set -eu
here=$(cd "$(dirname "$0")" && pwd)
site=/tmp/site
if [ ! -d "$site/tensor_queue" ]; then
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "$here"/*.whl "$here"/test-wheels/*.whl
fi
export PYTHONPATH=$site
what=$1; shift
case "$what" in
  tests)
    # A test that hangs fails alone (pytest-timeout, where installed) instead of ending the step;
    # faulthandler prints every thread's stack first.
    # The hostile peer the tests start is one of the bundle's binaries, not a cargo build's.
    export TQ_HOSTILE="$here/../bin/tq-hostile"
    timeout=()
    python3 -c 'import pytest_timeout' 2>/dev/null && timeout=(--timeout=90)
    exec python3 -m pytest -v -rs -p no:cacheprovider -o faulthandler_timeout=80 "${timeout[@]}" "$here/tests" "$@" ;;
  bench) exec python3 "$here/bench/bench_queues.py" "$@" ;;
  example) name=$1; shift; exec python3 "$here/examples/$name.py" "$@" ;;
  *) echo "usage: $0 tests|bench|example NAME" >&2; exit 2 ;;
esac
