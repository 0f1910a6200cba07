"""How many depth-2 candidates the fused tree kernel sorts at B=1024 (V=151,936, D=15, the
bench's `randn * 4` bf16 logits), for the bound it uses (the rank-0 column) and for stronger
ones: an extra rank-1 or rank-2 column, and the exact bound after the merge."""

import torch

torch.manual_seed(0)
B, D, V = 1024, 15, 151936


def kth(x: torch.Tensor) -> torch.Tensor:
    return x.sort(descending=True).values[B - 1]


def replay(lp: torch.Tensor) -> str:
    """Depth-2 candidate counts for ``lp [D, B]`` (each depth's top-B log-probs, descending)."""
    score, top = lp[0], lp[0]  # depth 1: the ranked tokens themselves
    cap = torch.clamp(B // (torch.arange(B) + 1), max=B)  # the torch beam's pruning
    pairs = score[:, None] + lp[1][None, :]
    allowed = torch.arange(B)[None, :] < cap[:, None]

    def count(bound: torch.Tensor) -> int:
        return int(((pairs >= bound) & allowed).sum())

    def column(r: int) -> torch.Tensor:
        return torch.where(cap > r, score + lp[1, r], torch.tensor(float("-inf")))

    b0 = kth(torch.cat([top, column(0)]))
    b1 = kth(torch.cat([top, column(0), column(1)]))
    b2 = kth(torch.cat([top, column(0), column(1), column(2)]))
    exact = kth(torch.cat([top, pairs[(pairs >= b0) & allowed]]))
    return (
        f"no raise {count(kth(top))}, rank-0 column {count(b0)}, +rank-1 {count(b1)}, "
        f"+rank-2 {count(b2)}, exact post-merge bound {count(exact)}"
    )


for trial in range(3):
    logits = (torch.randn(D, V) * 4).bfloat16().float()
    print(f"seed trial {trial}: " + replay(logits.log_softmax(-1).topk(B, -1).values))
