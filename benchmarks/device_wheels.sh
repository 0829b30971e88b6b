#!/bin/sh
# What benchmarks/gpu_check.py needs on a lent device machine beyond what that machine has
# (/work/.library/device/KINDS.md: torch 2.11, transformers 5.17, matplotlib, safetensors):
# transformers and its hub client and tokenizers at the versions gatelens pins, as wheels in
# .whl/ (ignored by git, ~17 MB). Run it here, in the repository's root, where pip reaches
# PyPI; then run gpu_check on the device as its docstring says ("On a lent device").
set -e
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    transformers==5.23.0 huggingface_hub==2.4.0 tokenizers==0.23.3
