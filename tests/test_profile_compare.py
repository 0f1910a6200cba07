"""benchmarks/profile_compare.py: kernel rows summed by kind and divided by the run's steps."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "profile_compare", ROOT / "benchmarks/profile_compare.py"
)
profile_compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_compare)

HEADER = "  ".join(
    ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "Self CUDA",
     "Self CUDA %", "CUDA total", "CUDA time avg", "# of Calls"]
)  # fmt: skip


def row(name: str, self_cuda: str) -> str:
    cells = [name, "0.00%", "0.000us", "0.00%", "0.000us", "0.000us", self_cuda, "1.00%",
             self_cuda, "1.000us", "10"]  # fmt: skip
    return "  ".join(f"{c:>14s}" for c in cells)


def test_kinds_summed_per_step(tmp_path: Path) -> None:
    path = tmp_path / "profile_ddtree-63_c1.txt"
    path.write_text(
        "\n".join([
            "ddtree-63_c1: 4 steps, 9.0 ms wall per step unprofiled",
            HEADER,
            row("nvjet_sm90_tst_192x64_64x6_2x1_v_bz_TNT", "8.000ms"),
            row("void cublasLt::splitKreduce_kernel<32, 16>", "400.000us"),
            row("_paged_tree_attention_kernel", "2.000ms"),
            row("_merge_splits_kernel", "0.400ms"),
            row("_tree_kernel", "100.000us"),
            row("aten::mm", "5.000ms"),  # a CPU-side row: its kernel is counted on its own row
            row("void some_other_kernel<float>", "40.000us"),
        ])
    )  # fmt: skip
    steps, per_step = profile_compare.read(path)
    assert steps == 4
    assert per_step == pytest.approx(
        {
            "GEMM (cuBLAS)": 2.1,
            "paged tree attention": 0.6,
            "DDTree Triton kernels": 0.025,
            "other": 0.01,
        }  # fmt: skip
    )
    text = profile_compare.table([path, path])
    assert "| ddtree-63_c1 | ddtree-63_c1 |" in text and "| all kernels | 2.735 | 2.735 |" in text
    profile_compare.plot([path, path], tmp_path / "split.png")
    assert (tmp_path / "split.png").stat().st_size > 0


def test_file_without_steps_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "profile_x.txt"
    path.write_text("no header\n")
    with pytest.raises(ValueError, match="steps"):
        profile_compare.read(path)
