"""The Triton kernels of the V2 runner's glue and of the GDN tree path, compiled for sm_90
without a GPU (Triton + ptxas, ``benchmarks/compile_kernels.py``): what Triton's CPU
interpreter accepts but a GPU rejects. (An if/else that typed one variable int64 in one branch
and int32 in the other passed every interpreter test and killed every V2 engine at start-up.)"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_v2_glue_and_gdn_kernels_compile_for_sm90():
    import compile_kernels

    if not (compile_kernels.PTX_BIN / "cuobjdump").exists():
        pytest.skip("this Triton build has no ptxas / cuobjdump")
    compile_kernels.v2_glue_kernels(90)
    compile_kernels.gdn_kernels("bf16", 90)
