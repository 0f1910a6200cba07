"""``ddtree soak``: drive a DDTree server with concurrent OpenAI clients, compare with no-spec.

Starts ``ddtree serve`` (DDTree) and, with ``--compare``, a no-spec server on free loopback
ports; N async clients send mixed requests until the time or request limit: random prompt
lengths, temperature 0 / 0.7 / 1 with top-p / top-k, max_tokens 1..``--max-tokens``, stop
strings, streaming or not, n = 2 for some sampled requests, and streams dropped mid-way. It
records errors, latency percentiles, the server's memory and vLLM's KV-cache usage over time,
and for every greedy request (n = 1, not dropped) whether DDTree's text and finish reason equal
the no-spec server's. Servers are stopped by PID. Writes ``OUT/soak.json`` and ``OUT/soak.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_TAKEN: set[int] = set()


def _free_port() -> int:
    """A free loopback port not handed out before in this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def stop_process_tree(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM ``proc``, wait for it and every child (vLLM's engine core holds the KV cache),
    SIGKILL what is left after ``timeout``."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=10)


def root_cause(log: str, limit: int = 4) -> str:
    """The distinct exception lines of a server log, first first: vLLM's "Engine core
    initialization failed" comes last, the worker's error behind it (e.g. no memory left for the
    KV cache) further up, out of a short tail."""
    found: list[str] = []
    for line in log.splitlines():
        match = re.search(r"\b[A-Z]\w*(?:Error|Exception): .*", line)
        if match and " WARNING " not in line and match.group(0) not in found:
            found.append(match.group(0))
    return "".join(f"{line}\n" for line in found[:limit])


def server_command(budget: int, args, port: int, method: str, under_test: bool) -> list[str]:
    """``ddtree serve`` for one soak server; ``args.attention_backend`` applies to the server
    under test only (the no-spec reference keeps vLLM's choice)."""
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--budget", str(budget)]
    if under_test and budget > 0 and args.budget_per_batch_size is not None:
        mode = args.budget_per_batch_size
        cmd += ["--budget-per-batch-size", mode if isinstance(mode, str) else json.dumps(mode)]
    cmd += ["--method", method, "--port", str(port), "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        cmd += ["--model", args.model] + (["--draft", args.draft] if args.draft else [])
    cmd += ["--", "--seed", "0", *args.vllm_args]
    if under_test and args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    return cmd


class Server:
    """``ddtree serve`` on a free loopback port (``budget`` 0: no speculative decoding)."""

    def __init__(self, budget: int, args, log: Path, method: str = "ddtree", under_test=True):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        cmd = server_command(budget, args, self.port, method, under_test)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                text = Path(self.log.name).read_text(errors="replace")
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} ({self.log.name}):\n"
                    f"{root_cause(text)}...\n{text[-3000:]}"
                )
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout} s: {self.log.name}")

    def metric(self, name: str) -> float | None:
        """A gauge from /metrics (summed over its label sets)."""
        try:
            text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        except OSError:
            return None
        values = [
            float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        ]
        return sum(values) if values else None

    def rss_mib(self) -> float:
        import psutil

        try:
            proc = psutil.Process(self.proc.pid)
            procs = [proc, *proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs) / 2**20
        except psutil.Error:
            return float("nan")

    def stop(self) -> None:
        """Stop by PID: SIGTERM, then SIGKILL after 60 s; waits for the engine processes too."""
        stop_process_tree(self.proc)
        self.log.close()


def _prompts(seed: int) -> list[str]:
    from ddtree.train.data import read_texts, stdlib_files

    files = stdlib_files(held_out=True)[:40]
    texts = [t for t in read_texts(files) if len(t) > 400]
    rng = random.Random(seed)
    out = []
    for _ in range(200):
        text = rng.choice(texts)
        start = rng.randrange(0, len(text) - 300)
        out.append(text[start : start + rng.randint(5, 300)])
    return out


def make_request(rng: random.Random, prompts: list[str], max_tokens: int) -> dict:
    """One random request: the OpenAI completion arguments + how to send it."""
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    req = {
        "prompt": rng.choice(prompts),
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": temperature,
        "extra_body": {},
    }
    if temperature > 0:
        if rng.random() < 0.5:
            req["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.5:
            req["extra_body"]["top_k"] = rng.choice([5, 50])
        if rng.random() < 0.3:
            req["n"] = 2
    if rng.random() < 0.3:
        req["stop"] = [rng.choice(["\n\n", "return", ":", "def "])]
    stream = rng.random() < 0.5
    drop = stream and rng.random() < 0.3  # disconnect after a few chunks
    return {"args": req, "stream": stream, "drop": drop}


async def send(client, model: str, request: dict) -> dict:
    """Send one request; ``{"texts", "reasons", "seconds", "error"}``."""
    start = time.perf_counter()
    args = request["args"]
    try:
        if request["stream"]:
            stream = await client.completions.create(model=model, stream=True, **args)
            texts, reasons, chunks = {}, {}, 0
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
                    if choice.finish_reason:
                        reasons[choice.index] = choice.finish_reason
                chunks += 1
                if request["drop"] and chunks >= 3:
                    await stream.close()  # the client goes away mid-stream
                    break
            n = args.get("n", 1)
            texts = [texts.get(i, "") for i in range(n)]
            reasons = [reasons.get(i) for i in range(n)]
        else:
            out = await client.completions.create(model=model, **args)
            choices = sorted(out.choices, key=lambda c: c.index)
            texts = [c.text for c in choices]
            reasons = [c.finish_reason for c in choices]
        return {
            "texts": texts,
            "reasons": reasons,
            "seconds": time.perf_counter() - start,
            "error": None,
        }
    except Exception as err:  # noqa: BLE001 - every failure is a finding, recorded
        return {
            "texts": None,
            "reasons": None,
            "seconds": time.perf_counter() - start,
            "error": f"{type(err).__name__}: {str(err)[:300]}",
        }


async def drive(args, server: Server, reference: Server | None) -> dict:
    import openai
    from tqdm import tqdm

    prompts = _prompts(args.seed)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    ref_client = None
    if reference is not None:
        ref_client = openai.AsyncOpenAI(
            base_url=reference.url + "/v1", api_key="none", max_retries=0
        )
    deadline = time.time() + args.duration
    results, samples = [], []
    issued = 0
    limit = args.max_requests if args.max_requests is not None else float("inf")
    bar = tqdm(total=args.max_requests, desc="soak requests")

    async def worker(index: int) -> None:
        nonlocal issued
        rng = random.Random(args.seed * 1000 + index)
        while time.time() < deadline and issued < limit:
            issued += 1
            request = make_request(rng, prompts, args.max_tokens)
            got = await send(client, model, request)
            record = {"request": request, **got}
            greedy = request["args"]["temperature"] == 0 and not request["drop"]
            if greedy and ref_client is not None and got["error"] is None:
                want = await send(ref_client, model, {**request, "stream": False})
                record["equal"] = (got["texts"], got["reasons"]) == (want["texts"], want["reasons"])
                if not record["equal"]:
                    record["no_spec"] = want
            results.append(record)
            bar.update(1)

    async def monitor() -> None:
        start = time.time()
        while time.time() < deadline and issued < limit:
            samples.append(
                {
                    "t": round(time.time() - start, 1),
                    "kv_usage": server.metric("vllm:kv_cache_usage_perc"),
                    "running": server.metric("vllm:num_requests_running"),
                    "rss_mib": round(server.rss_mib(), 1),
                }
            )
            await asyncio.sleep(1)

    samples.append(
        {
            "t": 0.0,
            "kv_usage": server.metric("vllm:kv_cache_usage_perc"),
            "running": 0,
            "rss_mib": round(server.rss_mib(), 1),
        }
    )
    await asyncio.gather(monitor(), *(worker(i) for i in range(args.clients)))
    bar.close()
    await asyncio.sleep(3)  # let dropped streams' aborts land
    after = {
        "kv_usage": server.metric("vllm:kv_cache_usage_perc"),
        "running": server.metric("vllm:num_requests_running"),
        "rss_mib": round(server.rss_mib(), 1),
    }
    return summarize(results, samples, after)


def summarize(results: list[dict], samples: list[dict], after: dict) -> dict:
    seconds = sorted(r["seconds"] for r in results if r["error"] is None)

    def pct(p: float) -> float | None:
        return round(seconds[min(len(seconds) - 1, int(p * len(seconds)))], 3) if seconds else None

    compared = [r for r in results if "equal" in r]
    return {
        "requests": len(results),
        "errors": [r["error"] for r in results if r["error"] is not None],
        "greedy_compared": len(compared),
        "greedy_mismatches": [r for r in compared if not r["equal"]],
        "dropped_streams": sum(r["request"]["drop"] for r in results),
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
        "start": samples[0] if samples else None,
        "after": after,
        "peak_kv_usage": max((s["kv_usage"] or 0.0 for s in samples), default=None),
        "timeline": samples,
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in summary["timeline"]]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(
        axes,
        ("kv_usage", "running", "rss_mib"),
        ("KV cache usage", "running requests", "server RSS (MiB)"),
        strict=True,
    ):
        ax.plot(t, [s[key] if s[key] is not None else float("nan") for s in summary["timeline"]])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    axes[0].set_title(
        f"ddtree soak: {summary['requests']} requests, "
        f"{len(summary['errors'])} errors, "
        f"{len(summary['greedy_mismatches'])} greedy mismatches"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target (default: the bundled pair)")
    parser.add_argument("--draft", default=None, help="DFlash drafter (with --model)")
    parser.add_argument("--budget", type=int, default=64, help="0: a no-spec server")
    from ddtree.cli import add_budget_mode

    add_budget_mode(parser)
    parser.add_argument(
        "--method",
        choices=("ddtree", "dflash"),
        default="ddtree",
        help="dflash: soak vLLM's DFlash chain (a baseline)",
    )
    parser.add_argument("--duration", type=float, default=600, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=None, help="default: no limit")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--compare", action="store_true", help="also start a no-spec server: compare greedy answers"
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM attention backend of the server under test only, e.g. TRITON_ATTN with "
        "--budget 0: how often a different attention kernel alone parts from no-spec",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)


def start_servers(args) -> tuple[Server, Server | None]:
    """The server under test and, with ``args.compare``, the no-spec reference; both ready."""
    args.out.mkdir(parents=True, exist_ok=True)
    servers = [Server(args.budget, args, args.out / "server_ddtree.log", args.method)]
    if args.compare:
        servers.append(Server(0, args, args.out / "server_nospec.log", under_test=False))
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers[0], servers[1] if args.compare else None


def soak(args, server: Server, reference: Server | None) -> int:
    """Drive running servers for ``args.duration`` s; write ``soak.json`` and ``soak.png``
    under ``args.out``; 0 when there was no error and no greedy mismatch."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(drive(args, server, reference))
    summary["command"] = " ".join(["ddtree", "soak", *sys.argv[2:]])
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, args.out / "soak.png")
    keys = (
        "requests",
        "greedy_compared",
        "dropped_streams",
        "latency_s",
        "start",
        "after",
        "peak_kv_usage",
    )
    print(json.dumps({k: summary[k] for k in keys}))
    print(
        f"errors: {len(summary['errors'])}, greedy mismatches: {len(summary['greedy_mismatches'])}"
    )
    ok = not summary["errors"] and not summary["greedy_mismatches"]
    return 0 if ok else 1


def run(args: argparse.Namespace, vllm_args: list[str]) -> int:
    args.vllm_args = vllm_args
    server, reference = start_servers(args)
    try:
        return soak(args, server, reference)
    finally:
        for each in (server, reference):
            if each is not None:
                each.stop()
