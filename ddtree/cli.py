"""Command line: ``ddtree generate`` (the transformers reference loop)."""

from __future__ import annotations

import argparse
import sys

import torch


def _generate(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.dflash import load_drafter
    from ddtree.generate import generate

    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    drafter = None
    if args.method != "ar":
        if args.draft is None:
            raise SystemExit(f"ddtree generate: --method {args.method} needs --draft DIR")
        drafter = load_drafter(args.draft, target.config, dtype=dtype)
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = args.prompt
    input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    result = generate(
        target,
        drafter,
        input_ids,
        args.method,
        budget=args.budget,
        chain_seed=not args.no_chain_seed,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_token_ids=stops,
        seed=args.seed,
    )
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    stages = ", ".join(f"{k} {v:.3f}s" for k, v in result.seconds.items())
    print(
        f"[{args.method}] {len(result.tokens)} tokens in {len(result.taus)} steps, "
        f"tau {result.tau:.2f}, finish {result.finish_reason}; {stages}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode one prompt with the transformers reference loop")
    gen.add_argument("--target", required=True, help="Hugging Face target model directory")
    gen.add_argument("--draft", help="DFlash drafter directory (z-lab format)")
    gen.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ddtree")
    gen.add_argument("--budget", type=int, default=64, help="DDTree nodes per step (B)")
    gen.add_argument("--no-chain-seed", action="store_true", help="do not force the argmax chain")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
