"""Command line: ``ddtree serve | generate | train | tau | bench | soak``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


# Defaults of the sizes of ``ddtree train`` (the recipe) and of ``--tiny``, a seconds-long CPU
# smoke run of every stage; a flag given on the command line wins over both.
TRAIN_DEFAULTS = {
    "vocab_size": 8192,
    "target_steps": 1200,
    "drafter_steps": 4000,
    "distill_tokens": 3_000_000,
}
TINY_DEFAULTS = {"vocab_size": 512, "target_steps": 30, "drafter_steps": 20, "distill_tokens": 1024}
TINY_FILE_STRIDE = 20  # --tiny trains on every 20th training file (~0.5 M of ~11 M chars)


def _train(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ddtree.train.data import read_texts, stdlib_files, token_stream
    from ddtree.train.recipes import (
        DrafterRecipe,
        TargetRecipe,
        distill_stream,
        load_target,
        train_drafter,
        train_target,
    )
    from ddtree.train.tokenizer import EOS, MASK, train_tokenizer

    out = args.out
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    files = stdlib_files()
    if args.tiny:  # a spread-out sample: tokenizing all 11 M chars alone takes ~10 s on a CPU
        files = files[::TINY_FILE_STRIDE]
    texts = read_texts(files)
    print(f"training data: {len(texts)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} M chars")
    if args.what in ("tokenizer", "all"):
        tokenizer = train_tokenizer(texts, out / "tokenizer", vocab_size=args.vocab_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    if args.what == "tokenizer":
        return 0
    stream = token_stream(tokenizer, texts, tokenizer.convert_tokens_to_ids(EOS))
    print(f"token stream: {stream.numel() / 1e6:.2f} M tokens")
    if args.what in ("target", "all"):
        recipe = TargetRecipe(
            arch=args.arch, steps=args.target_steps, seed=args.seed, **_small(args, "target")
        )
        target = train_target(stream, tokenizer, out / "target", recipe, device)
    else:
        target = load_target(out / "target")
    if args.what in ("drafter", "all"):
        recipe = DrafterRecipe(
            steps=args.drafter_steps,
            seed=args.seed,
            num_layers=args.drafter_layers,
            intermediate_size=args.drafter_intermediate_size,
            lr=args.drafter_lr,
            time_limit=args.time_limit,
            **_small(args, "drafter"),
        )
        num_layers = target.config.get_text_config().num_hidden_layers
        if max(recipe.target_layer_ids) >= num_layers:  # the recipe's [1, 2, 4] needs 5+
            from ddtree.dflash import default_target_layer_ids

            recipe.target_layer_ids = default_target_layer_ids(num_layers, 3)
            print(f"drafter features: target layers {recipe.target_layer_ids}")
        mask_id = tokenizer.convert_tokens_to_ids(MASK)
        cache = args.distill_cache
        if cache is not None and cache.exists():
            stream = torch.load(cache)
            print(f"distilled stream: {stream.numel() / 1e6:.2f} M tokens from {cache}")
        elif args.distill_tokens > 0:  # train on the target's own outputs
            eos_id = tokenizer.convert_tokens_to_ids(EOS)
            stream = distill_stream(
                target,
                stream,
                args.distill_tokens,
                eos_id=eos_id,
                device=device,
                seed=args.seed,
                greedy_fraction=args.greedy_fraction,
                **_small(args, "distill"),
            )
            print(f"distilled stream: {stream.numel() / 1e6:.2f} M tokens")
            if cache is not None:  # written whole, then renamed: readers never see a part
                torch.save(stream, cache.with_suffix(".partial"))
                cache.with_suffix(".partial").rename(cache)
        train_drafter(stream, target, out / "drafter", recipe, mask_id, device)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _train_sizes(args: argparse.Namespace) -> None:
    """Fill the size flags left out with the recipe's defaults, or --tiny's."""
    for name, default in (TINY_DEFAULTS if args.tiny else TRAIN_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _small(args: argparse.Namespace, which: str) -> dict:
    """Recipe fields set by flags: --tiny's shapes of a seconds-long CPU smoke run of the
    whole recipe, then --target-layers, --batch and --seq-len over them."""
    given = {}
    if which in ("target", "drafter"):
        given = {"batch": args.batch, "seq_len": args.seq_len}
        if which == "target":
            given["num_layers"] = args.target_layers
    given = {name: value for name, value in given.items() if value is not None}
    if not args.tiny:
        return given
    return {**_tiny(args, which), **given}


def _tiny(args: argparse.Namespace, which: str) -> dict:
    if which == "target":
        shapes = {"hidden_size": 32, "num_layers": 6, "intermediate_size": 64}
        if args.arch == "qwen3_5":  # heads of 32: vLLM's CPU attention serves no smaller
            shapes.update(hidden_size=64, num_heads=2, num_kv_heads=1)
        return {**shapes, "seq_len": 64, "batch": 4, "warmup": 2}
    if which == "distill":  # one generate call of 16 x 64 tokens covers the default 1024
        return {"length": 64, "prompt_len": 16, "batch": 16}
    return {"seq_len": 64, "batch": 4, "anchors": 4, "warmup": 2}


def _tau(args: argparse.Namespace) -> int:
    from ddtree.bench.tau import run

    budgets = tuple(int(b) for b in args.budgets.split(","))
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    run(
        args.target,
        args.draft,
        args.out,
        args.plot,
        budgets=budgets,
        temperatures=temperatures,
        max_new_tokens=args.max_new_tokens,
        count=args.prompts,
    )
    return 0


MODELS = Path(__file__).resolve().parent.parent / "models"


def budget_mode(text: str) -> str | list:
    """``--budget-per-batch-size``: "auto", "fixed" or a JSON ``[[first, last, B], ...]``."""
    import json

    if text in ("auto", "fixed"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f'--budget-per-batch-size: "auto", "fixed" or a JSON schedule, not {text!r}'
        ) from None


def add_budget_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget-per-batch-size",
        type=budget_mode,
        default=None,
        help='ddtree_budget_per_batch_size: "auto" (on one GPU the default: budgets chosen by '
        'throughput), "fixed" (--budget at every batch size) or [[first, last, B], ...]',
    )


def serve_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The vLLM OpenAI server command line for ``ddtree serve``."""
    import json

    target = args.model or str(MODELS / "target")
    draft = args.draft or (None if args.model else str(MODELS / "drafter"))
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        target,
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    if draft is not None and args.budget > 0 and args.method == "dflash":
        # vLLM's own DFlash: the drafter's argmax chain, block_size - 1 tokens per step.
        from ddtree.dflash import read_config, read_settings

        block = read_settings(read_config(Path(draft) / "config.json")).block_size
        spec = {"method": "dflash", "model": draft, "num_speculative_tokens": block - 1}
        cmd += ["--speculative-config", json.dumps(spec), "--max-num-seqs", str(args.max_num_seqs)]
    elif draft is not None and args.budget > 0:
        spec = {"method": "ddtree", "model": draft, "ddtree_budget": args.budget}
        if args.budget_per_batch_size is not None:
            spec["ddtree_budget_per_batch_size"] = args.budget_per_batch_size
        cmd += ["--speculative-config", json.dumps(spec)]
        # Every running request may verify 1 + budget tokens in one step.
        batched = max(2048, (args.budget + 1) * args.max_num_seqs + 512)
        cmd += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(batched)]
    if "--served-model-name" not in extra:
        # Clients may name the model by its folder ("target") or by the path it was given.
        cmd += ["--served-model-name", Path(target).name, target]
    if not torch.cuda.is_available():
        # float32 keeps the CPU attention's KV layout readable by the tree attention.
        cmd += ["--dtype", "float32"]
        # On the CPU this is the share of memory kept for the KV cache (vLLM's default 0.92
        # fails as soon as anything else holds memory).
        cmd += ["--gpu-memory-utilization", "0.3"]
    return cmd + extra


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    import os

    if args.model is None and not (MODELS / "target").is_dir():
        raise SystemExit(f"ddtree serve: no --model given and no bundled pair in {MODELS}")
    if args.model is not None and args.draft is None and args.budget > 0:
        raise SystemExit("ddtree serve: --model needs --draft (a DFlash drafter) or --budget 0")
    if args.budget_per_batch_size is not None and (args.method != "ddtree" or args.budget <= 0):
        raise SystemExit(
            "ddtree serve: --budget-per-batch-size applies to --method ddtree with --budget > 0"
        )
    from ddtree.vllm_plugin import plugin_env

    cmd = serve_command(args, extra)
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execve(sys.executable, cmd, plugin_env())  # the plugin, also from a source checkout
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

    train = sub.add_parser("train", help="train the tokenizer, target and DFlash drafter")
    train.add_argument("what", choices=("tokenizer", "target", "drafter", "all"))
    train.add_argument("--out", type=Path, required=True, help="directory for the models")
    full, tiny = TRAIN_DEFAULTS, TINY_DEFAULTS
    train.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"default {full['vocab_size']} (--tiny: {tiny['vocab_size']})",
    )
    train.add_argument(
        "--target-steps",
        type=int,
        default=None,
        help=f"default {full['target_steps']} (--tiny: {tiny['target_steps']})",
    )
    train.add_argument(
        "--drafter-steps",
        type=int,
        default=None,
        help=f"default {full['drafter_steps']} (--tiny: {tiny['drafter_steps']})",
    )
    train.add_argument(
        "--distill-tokens",
        type=int,
        default=None,
        help="train the drafter on this many tokens of the target's own outputs (0: on the "
        f"data); default {full['distill_tokens']:,} (--tiny: {tiny['distill_tokens']})",
    )
    train.add_argument(
        "--greedy-fraction",
        type=float,
        default=0.5,
        help="share of distilled continuations decoded greedily (rest: T=0.8)",
    )
    train.add_argument(
        "--distill-cache",
        type=Path,
        default=None,
        help="load the distilled stream from this file, or save it there",
    )
    train.add_argument(
        "--arch",
        choices=("qwen3", "qwen3_5"),  # ddtree.train.recipes.ARCHS (not imported: transformers)
        default="qwen3",
        help="the target: qwen3 (dense) or qwen3_5 (hybrid Gated DeltaNet, Qwen3.6's layout)",
    )
    train.add_argument(
        "--target-layers",
        type=_positive_int,
        default=None,
        help="target layers (default: the recipe's 6)",
    )
    train.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        help="training windows per step, target and drafter (default: the recipe's 64 / 32)",
    )
    train.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="tokens per training window, target and drafter (default: the recipe's 512)",
    )
    train.add_argument("--drafter-layers", type=int, default=3)
    train.add_argument(
        "--drafter-intermediate-size",
        type=int,
        default=None,
        help="drafter MLP width (default: the target's)",
    )
    train.add_argument("--drafter-lr", type=float, default=1e-3)
    train.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: end drafter training early (saved, logged) once passed",
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    train.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long CPU smoke run: tiny shapes, step counts and data sample",
    )

    tau = sub.add_parser("tau", help="acceptance (tau) vs budget on held-out prompts")
    tau.add_argument("--target", type=Path, required=True)
    tau.add_argument("--draft", type=Path, required=True)
    tau.add_argument("--out", type=Path, required=True, help="JSON file to write")
    tau.add_argument("--plot", type=Path, default=None, help="PNG plot to write")
    tau.add_argument("--budgets", default="16,32,64,128,255,511,1023")
    tau.add_argument("--temperatures", default="0,1")
    tau.add_argument("--prompts", type=int, default=12)
    tau.add_argument("--max-new-tokens", type=int, default=96)

    serve = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with DDTree (the bundled pair by default); "
        "arguments after -- go to vLLM",
    )
    serve.add_argument("--model", default=None, help="target model (default: models/target)")
    serve.add_argument("--draft", default=None, help="DFlash drafter (default: models/drafter)")
    serve.add_argument("--budget", type=int, default=64, help="tree nodes per step; 0: no spec")
    add_budget_mode(serve)
    serve.add_argument(
        "--method",
        choices=("ddtree", "dflash"),
        default="ddtree",
        help="dflash: vLLM's own DFlash chain (a baseline)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-num-seqs", type=int, default=8)

    from ddtree.bench import vllm as bench_vllm

    bench = sub.add_parser(
        "bench", help="vLLM engines: no-spec vs DFlash chain vs DDTree (tokens/s, tau)"
    )
    bench_vllm.add_arguments(bench)
    from ddtree.bench import soak as soak_tool

    soak = sub.add_parser(
        "soak",
        help="drive the DDTree server with concurrent clients (loopback); "
        "arguments after -- go to vLLM",
    )
    soak_tool.add_arguments(soak)

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, extra)
    if args.command == "bench":
        return bench_vllm.run(args, argv[1:])
    if args.command == "soak":
        return soak_tool.run(args, extra)
    if args.command == "train":
        _train_sizes(args)
    handlers = {"generate": _generate, "train": _train, "tau": _tau}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
