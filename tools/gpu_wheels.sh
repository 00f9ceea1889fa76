#!/bin/sh
# Downloads into .whl the wheels that tokamax 0.0.17 (a peer of experiments.attention) needs on
# the GPU machine beyond what its image holds (the device tool's KINDS.md lists that), so that
# `tools/gpu_session.py` can install them there: `carry` .whl with the call. About 37 MB: xprof,
# which tokamax imports at import time, is 32 MB of it. The list is what a `import tokamax` needed
# on top of this project's virtual environment (2026-11-25); versions as in constraints.txt.
set -e
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for spec in tokamax==0.0.17 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 pydantic==2.14.4 \
            pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
            xprof==2.24.2 fire==0.7.1 termcolor==3.3.0; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
