"""Training data: the Python standard library of the running interpreter, as a fixed file list.

Modules in ``HELD_OUT_MODULES`` are never trained on; evaluation prompts come from them.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

HELD_OUT_MODULES = (
    "argparse",
    "bisect",
    "csv",
    "difflib",
    "fractions",
    "heapq",
    "json",
    "shlex",
    "statistics",
    "textwrap",
)
EXCLUDED_DIRS = ("test", "site-packages", "idlelib", "lib2to3", "__pycache__")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def stdlib_files(held_out: bool = False) -> list[Path]:
    """Sorted ``.py`` files of the stdlib: the training set, or (``held_out``) the eval set."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts):
            continue
        if (_module_name(rel) in HELD_OUT_MODULES) == held_out:
            files.append(path)
    if not files:
        raise RuntimeError(f"no Python files found under {root}")
    return files


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def token_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All texts tokenized and joined with ``eos_id``: long ``[n_tokens]``."""
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    """``batch`` random windows of ``length`` tokens: long ``[batch, length]``."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])
