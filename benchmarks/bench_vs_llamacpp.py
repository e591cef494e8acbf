"""lmplug vs llama.cpp on the same GGUF file and the same threads, in interleaved rounds.

    bash benchmarks/build_llamacpp.sh                 # once: llama.cpp's CPU tools into the cache
    python benchmarks/bench_vs_llamacpp.py --quick    # a short run
    python benchmarks/bench_vs_llamacpp.py --threads 1,2 --rounds 3 --json out.json
    python benchmarks/bench_vs_llamacpp.py --lmplug-set attention.backend=paged --sections decode,prefill
    python benchmarks/bench_vs_llamacpp.py --sizes --quick      # 135M / 1B / 3B files, Q4_0 Q8_0 Q4_K_M

Per thread count, each round runs both engines one after the other (so a noisy, shared machine
weighs on both alike) and the table gives medians over the rounds:

- decode: batch-1 decode tok/s of 64 tokens from an empty context (llama-bench ``-p 0 -n 64``;
  lmplug: a one-token prompt, then 64 greedy tokens, timed from the first to the last);
- prefill: prompt processing tok/s at 128 and 512 tokens (llama-bench ``-p 128,512 -n 0``;
  lmplug: a fresh random prompt each round, timed to its first token);
- cold: whole-process wall time of a one-token generation, and its peak RSS (``llama-completion``
  vs ``lmplug generate``), median of ``--cold-runs`` runs per round;
- batched: ``--batch`` sequences of ``--batch-prompt`` random prompt tokens each, then
  ``--decode-tokens`` tokens each, all at once: generation tok/s summed over the sequences
  (llama-batched-bench ``-npp P -ntg G -npl B``'s S_TG; lmplug: the engine's steps, timed from
  the step after which every sequence has its first token to the last);
- serve: aggregate output tok/s of ``--concurrency`` concurrent /v1/completions requests (fixed
  prompts, max_tokens 64, temperature 0, ignore_eos) sent by one client to ``llama-server
  --parallel N -c N*slot_ctx`` and to ``lmplug serve`` (with ``scheduler.max_num_seqs=N``, the
  same number of slots), plus each server's peak RSS.

``--sizes`` runs the decode, prefill (512), batched (8 sequences) and cold (RSS) sections on
random-weight GGUFs of the 135M, 1B and 3B shapes with the demo tokenizer (``sized_gguf.py``;
``--shapes``, ``--types``; Q4_K_M by ``llama-quantize`` from the Q8_0 file where it was built,
else the 1B and 3B shapes' approximation), written into the cache once, and adds per file the
weights read per token (every tensor but an untied embedding), the GB/s of weights each
engine's batch-1 decode reaches, and that as a share of the machine's read bandwidth
(``read_bandwidth.py``, measured at each thread count at the start and at the end of the run, in
4 KiB pages and in huge pages; the share is of both: llama.cpp reads the file's mapping in 4 KiB
pages, lmplug's kernels their copies in huge pages).
With ``--quick``: one round, 32 decode tokens.

``--phases``: at two threads or more, a quick read-bandwidth probe (``read_bandwidth.Probe``) runs
just before and just after each engine's decode run, and the table adds rows per bandwidth phase:
"high" where both probes read at least 1.4 times a one-thread probe, "low" where neither did (runs
across a change are left out there). On a VM the two-thread bandwidth can move between levels within
seconds as the host places the virtual CPUs (this 2-core EPYC: about 37 and 55-70 GB/s, one thread
about 36); the medians over all rounds then mix them in proportions that differ between the engines.

lmplug runs with its default config, plus ``--lmplug-set KEY=VALUE`` (as ``lmplug --set``).
llama.cpp's binaries come from ``--llama-bin-dir``, else ``$LLAMA_CPP_BIN``, else the cache
folder ``benchmarks/build_llamacpp.sh`` fills. Prints a table (both sides, the ratio
lmplug / llama.cpp, which direction is better), the load average before and after, and
with ``--json PATH`` writes every raw measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SECTIONS = ("decode", "prefill", "batched", "cold", "serve")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "bright", "stars", "watch", "quietly", "from", "far", "above", "silent", "town"]


# -- where things are --------------------------------------------------------------------------


def llama_bin_dir(option: str | None) -> Path:
    if option:
        return Path(option).expanduser()
    if os.environ.get("LLAMA_CPP_BIN"):
        return Path(os.environ["LLAMA_CPP_BIN"]).expanduser()
    cache = Path(os.environ.get("LMPLUG_CACHE") or Path.home() / ".cache" / "lmplug").expanduser()
    return cache / "llamacpp" / "bin"


def llama_tool(bin_dir: Path, name: str) -> str:
    path = bin_dir / name
    if not os.access(path, os.X_OK):
        raise SystemExit(f"bench_vs_llamacpp: {path} not found (or not executable); build llama.cpp with "
                         "`bash benchmarks/build_llamacpp.sh`, or point --llama-bin-dir / $LLAMA_CPP_BIN at "
                         "a folder holding llama-bench, llama-completion and llama-server")
    return str(path)


def gguf_file(model: str) -> Path:
    """The GGUF file both engines read: a path, or a model name in lmplug's cache."""
    from lmplug.loading.cache import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            raise SystemExit(f"bench_vs_llamacpp: {path} holds {len(files)} .gguf files; give --model FILE.gguf")
        path = files[0]
    if path.suffix != ".gguf":
        raise SystemExit(f"bench_vs_llamacpp: {path} is not a .gguf file; llama.cpp reads GGUF only")
    return path


def weight_bytes(model: Path) -> int:
    """Bytes a batch-1 decode step reads: every tensor, the token embedding only where it is
    also the output head (tied: no ``output.weight``), a lookup reading a row of it."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(model)).tensors}
    tied = "output.weight" not in tensors
    return sum(size for name, size in tensors.items() if tied or name != "token_embd.weight")


def lmplug_set_args(sets: list[str]) -> list[str]:
    return [a for item in sets for a in ("--set", item)]


# -- processes ---------------------------------------------------------------------------------


# A process's ru_maxrss counts the memory of what it was before exec: a child started straight from
# this script (vfork) reports this script's peak (the read-bandwidth buffer: over 1 GiB) when that
# is larger than its own. So the command runs in a grandchild forked by a small Python process,
# which reports the grandchild's wall seconds and ru_maxrss (KiB) on its stderr's last line.
MEASURE = ("import os, sys, time\n"
           "start = time.perf_counter()\n"
           "pid = os.fork()\n"
           "if pid == 0:\n"
           "    os.execvp(sys.argv[1], sys.argv[1:])\n"
           "_, status, usage = os.wait4(pid, 0)\n"
           "print(f'\\nmeasured {time.perf_counter() - start} {usage.ru_maxrss}', file=sys.stderr)\n"
           "sys.exit(os.waitstatus_to_exitcode(status))\n")


def run_timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one whole process (its own rusage: ``MEASURE``)."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"bench_vs_llamacpp: {' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    _, wall, maxrss = err.rstrip().rsplit("\n", 1)[-1].split()
    return float(wall), int(maxrss) / 1024


def threads_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class LmplugWorker:
    """A long-lived lmplug process (this script with --worker) that answers timing requests, so a
    round costs no model load and the engine stays warm, as llama-bench's does."""

    def __init__(self, model: Path, threads: int, sets: list[str]) -> None:
        cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--threads", str(threads),
               *[a for s in sets for a in ("--lmplug-set", s)]]
        self.proc = subprocess.Popen(cmd, env=threads_env(threads), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.ask({"op": "ready"})

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_vs_llamacpp: the lmplug worker ended ({self.proc.wait()}) on {request}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker_main(args: argparse.Namespace) -> int:
    """The --worker side: build the engine once, then time what stdin asks for (JSON lines)."""
    import torch

    from lmplug.cli import _overrides
    from lmplug.interfaces.params import SamplingParams
    from lmplug.llm import LLM

    torch.set_num_threads(args.threads[0])
    llm = LLM(**_overrides(argparse.Namespace(model=str(args.model), set=args.lmplug_set)))
    vocab = llm.engine.model_config.vocab_size

    def first_and_last(prompt: list[int], n: int) -> tuple[float, float, float, int]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        started = time.perf_counter()
        stamps: list[float] = []
        for out in llm.stream(prompt, params):
            stamps.extend([time.perf_counter()] * len(out.delta_token_ids))
        return started, stamps[0], stamps[-1], len(stamps)

    for line in sys.stdin:
        req = json.loads(line)
        rng = random.Random(req.get("seed", 0))  # a fresh prompt each round: no prefix-cache hits
        prompt = [rng.randrange(100, min(vocab, 30000)) for _ in range(req.get("n", 1))]
        if req["op"] == "decode":  # a one-token prompt, then `tokens` decode steps
            _, first, last, count = first_and_last(prompt[:1], req["tokens"] + 1)
            reply = {"tok_s": (count - 1) / (last - first)}
        elif req["op"] == "batched":
            reply = {"tok_s": batched(llm, rng, vocab, req)}
        elif req["op"] == "prefill":
            started, first, _, _ = first_and_last(prompt, 1)
            reply = {"tok_s": len(prompt) / (first - started)}
        else:
            reply = {"ready": True}
        print(json.dumps(reply), flush=True)
    return 0


def batched(llm, rng: random.Random, vocab: int, req: dict) -> float:
    """Generation tok/s of ``req["b"]`` sequences of ``req["n"]``-token prompts decoding
    ``req["tokens"]`` tokens each together, from the step that gave the last one its first token."""
    from lmplug.interfaces.params import SamplingParams

    engine, size, tokens = llm.engine, req["b"], req["tokens"]
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    for i in range(size):
        engine.add_request(f"batched-{req.get('seed', 0)}-{i}",
                           [rng.randrange(100, min(vocab, 30000)) for _ in range(req["n"])], params)
    counts: dict[str, int] = {}
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if first is None and len(counts) == size and min(counts.values()) >= 1:
            first, at_first = time.perf_counter(), sum(counts.values())
    return (sum(counts.values()) - at_first) / (time.perf_counter() - first)


def llama_batched(bin_dir: Path, model: Path, threads: int, size: int, prompt: int, tokens: int) -> float:
    """llama-batched-bench's generation tok/s (S_TG) for ``size`` parallel sequences."""
    cmd = [llama_tool(bin_dir, "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-c",
           str(size * (prompt + tokens) + 256), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens),
           "-npl", str(size), "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not rows:
        raise SystemExit(f"bench_vs_llamacpp: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return rows[-1]["speed_tg"]


def llama_bench(bin_dir: Path, model: Path, threads: int, prompts: list[int], tokens: int) -> dict:
    """llama-bench's tok/s: {"decode": tg, 128: pp128, ...} for what was asked (one repetition)."""
    cmd = [llama_tool(bin_dir, "llama-bench"), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json",
           "-p", ",".join(map(str, prompts)) if prompts else "0", "-n", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_vs_llamacpp: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    results = {}
    for row in json.loads(out.stdout):
        if row["n_gen"] > 0 and row["n_prompt"] == 0:
            results["decode"] = row["avg_ts"]
        elif row["n_prompt"] > 0 and row["n_gen"] == 0:
            results[row["n_prompt"]] = row["avg_ts"]
    return results


# -- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, env: dict) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        # its log into a file: a pipe nobody reads fills (64 KiB) and blocks the server's next write
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs; stop() closes it)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        self.model_id = self._wait_ready()

    def _wait_ready(self, timeout_s: float = 900) -> str:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_vs_llamacpp: {self.name} server exited ({self.proc.returncode}):\n"
                                 f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"bench_vs_llamacpp: {self.name} server not ready after {timeout_s:.0f} s")

    def batch(self, prompts: list[str], max_tokens: int) -> tuple[float, int]:
        """All prompts at once, one thread per request; (output tok/s, output tokens)."""
        import httpx

        def one(prompt: str) -> int:
            body = {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(self.url + "/v1/completions", json=body, timeout=1800)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = sum(pool.map(one, prompts))
        return tokens / (time.perf_counter() - started), tokens

    def stop(self, grace_s: float = 30) -> float:
        """Stop it (SIGTERM, then SIGKILL if it has not exited after ``grace_s``: a run here waited
        on llama-server's shutdown for 15 minutes when its log went to a pipe); its peak RSS in MiB
        (VmHWM, its own since exec: not the rusage, which would count this script's memory, see
        ``MEASURE``)."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"bench_vs_llamacpp: {self.name} server still running {grace_s:.0f} s after SIGTERM: killed",
                  file=sys.stderr)
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()
        return peak / 1024

    def log_tail(self, chars: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]


def serve_prompts(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(count)]


# -- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    bin_dir = llama_bin_dir(args.llama_bin_dir)
    needs = {"decode": "llama-bench", "prefill": "llama-bench", "batched": "llama-batched-bench",
             "cold": "llama-completion", "serve": "llama-server"}
    for section in args.sections:  # before any model loads: a missing binary is the first thing said
        llama_tool(bin_dir, needs[section])
    model = gguf_file(args.model)
    sets = args.lmplug_set
    raw: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        raw.setdefault(key, []).append(value)

    for threads in args.threads:
        worker = LmplugWorker(model, threads, sets) if {"decode", "prefill", "batched"} & set(args.sections) else None
        probe = phase_probe(args, threads, add)
        for rnd in range(args.rounds):
            if worker is not None:
                wanted = (args.prompt_sizes if "prefill" in args.sections else [])
                tokens = args.decode_tokens if "decode" in args.sections else 0
                if probe and tokens:  # the decode run alone between its two probes
                    with probed(probe, f"probe|{threads}|llama.cpp", add):
                        add(f"decode|{threads}|llama.cpp", llama_bench(bin_dir, model, threads, [], tokens)["decode"])
                    tokens = 0
                if wanted or tokens:
                    for key, value in llama_bench(bin_dir, model, threads, wanted, tokens).items():
                        add(f"{key}|{threads}|llama.cpp", value)
                if "decode" in args.sections:
                    with probed(probe, f"probe|{threads}|lmplug", add):
                        tok_s = worker.ask({"op": "decode", "tokens": args.decode_tokens})["tok_s"]
                    add(f"decode|{threads}|lmplug", tok_s)
                for n in wanted:
                    add(f"{n}|{threads}|lmplug", worker.ask({"op": "prefill", "n": n, "seed": rnd})["tok_s"])
            if "batched" in args.sections:
                add(f"batched|{threads}|llama.cpp", llama_batched(bin_dir, model, threads, args.batch, args.batch_prompt,
                                                                  args.decode_tokens))
                add(f"batched|{threads}|lmplug", worker.ask({"op": "batched", "b": args.batch, "n": args.batch_prompt,
                                                            "tokens": args.decode_tokens, "seed": rnd})["tok_s"])
            if "cold" in args.sections:
                for _ in range(args.cold_runs):
                    wall, rss = run_timed([llama_tool(bin_dir, "llama-completion"), "-m", str(model), "-p", "hi",
                                           "-n", "1", "--temp", "0", "-t", str(threads), "-no-cnv"])
                    add(f"cold|{threads}|llama.cpp", wall)
                    add(f"rss|{threads}|llama.cpp", rss)
                    wall, rss = run_timed([sys.executable, "-m", "lmplug.cli", "generate", "--model", str(model),
                                           "--max-tokens", "1", "--temperature", "0", *lmplug_set_args(sets),
                                           "hi"], env=threads_env(threads))
                    add(f"cold|{threads}|lmplug", wall)
                    add(f"rss|{threads}|lmplug", rss)
            print(f"threads {threads}: round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        if worker is not None:
            worker.close()
        if "serve" in args.sections:
            serve_round(args, bin_dir, model, threads, add)
    return raw


# -- bandwidth phases (--phases) ----------------------------------------------------------------

PHASE_FACTOR = 1.4  # a probe at this many times the one-thread bandwidth or more is the "high" phase


def phase_probe(args: argparse.Namespace, threads: int, add):
    """With --phases at two threads or more: a Probe at ``threads`` threads, and the run's phase
    threshold (PHASE_FACTOR times a one-thread probe) recorded as ``threshold|threads``."""
    if not args.phases or threads < 2 or "decode" not in args.sections:
        return None
    from read_bandwidth import Probe

    add(f"threshold|{threads}", phase_threshold())
    return Probe(threads)


def phase_threshold() -> float:
    """The lowest reading of the "high" phase: PHASE_FACTOR times the best of three one-thread probes."""
    from read_bandwidth import Probe

    one = Probe(1)
    return PHASE_FACTOR * max(one() for _ in range(3))


@contextlib.contextmanager
def probed(probe, key: str, add):
    """Around a timed run: the probe's reading just before and just after it, appended to
    ``key`` as a [before, after] pair (nothing without a probe)."""
    before = probe() if probe else None
    yield
    if probe:
        add(key, [before, probe()])


def phase_of(pair: list[float], threshold: float) -> str:
    """"high" when both probes around a run read at least ``threshold`` GB/s, "low" when neither
    did, "mixed" (left out of the phase rows) when the phase changed during the run."""
    high = [gbs >= threshold for gbs in pair]
    return "high" if all(high) else "low" if not any(high) else "mixed"


def phase_rows(raw: dict, args: argparse.Namespace, weight_bytes_per_token: float | None = None) -> list[dict]:
    """Per thread count with probes: batch-1 decode tok/s of each engine over its runs in the high
    and in the low bandwidth phase (medians; the ratio of the two medians), and with the weights'
    bytes a token, each engine's GB/s as a share of the mean probed bandwidth of its runs there."""
    rows = []
    for threads in args.threads:
        threshold = raw.get(f"threshold|{threads}")
        if not threshold:
            continue
        threshold = threshold[0]
        for phase in ("high", "low"):
            runs = {}
            for engine in ("llama.cpp", "lmplug"):
                pairs = raw.get(f"probe|{threads}|{engine}", [])
                runs[engine] = [(tok_s, sum(pair) / 2) for tok_s, pair in zip(raw.get(f"decode|{threads}|{engine}", []), pairs)
                                if phase_of(pair, threshold) == phase]
            if not runs["llama.cpp"] or not runs["lmplug"]:
                continue
            a, b = (statistics.median(t for t, _ in runs[e]) for e in ("llama.cpp", "lmplug"))
            side = ">=" if phase == "high" else "<"
            label = (f"decode tok/s, {phase} phase ({side} {threshold:.0f} GB/s; runs "
                     f"{len(runs['llama.cpp'])} / {len(runs['lmplug'])})")
            rows.append({"metric": label, "threads": threads, "llama.cpp": a, "lmplug": b, "ratio": b / a,
                         "better": "higher", "runs": len(runs["lmplug"])})
            if weight_bytes_per_token:
                share = {e: 100 * statistics.median(t * weight_bytes_per_token / 1e9 / gbs for t, gbs in runs[e])
                         for e in runs}
                rows.append({"metric": f"% of the probed read bandwidth, {phase} phase", "threads": threads,
                             "llama.cpp": share["llama.cpp"], "lmplug": share["lmplug"],
                             "ratio": share["lmplug"] / share["llama.cpp"], "better": "higher",
                             "runs": len(runs["lmplug"])})
    return rows


def serve_round(args, bin_dir: Path, model: Path, threads: int, add) -> None:
    n = args.concurrency
    llama_port, lmplug_port = free_port(), free_port()
    servers = [
        Server("llama.cpp", [llama_tool(bin_dir, "llama-server"), "-m", str(model), "-t", str(threads),
                             "--parallel", str(n), "-c", str(n * args.slot_ctx), "--host", "127.0.0.1",
                             "--port", str(llama_port)], llama_port, os.environ.copy()),
        Server("lmplug", [sys.executable, "-m", "lmplug.cli", "serve", "--model", str(model), "--port",
                          str(lmplug_port), "--set", f"scheduler.max_num_seqs={n}", *lmplug_set_args(args.lmplug_set)],
               lmplug_port, threads_env(threads)),
    ]
    try:
        prompts = serve_prompts(n)
        for server in servers:  # a warm-up batch each: first requests pay one-time costs
            server.batch(prompts[:2], 4)
        for _ in range(args.rounds):
            for server in servers:
                tok_s, _ = server.batch(prompts, args.max_tokens)
                add(f"serve|{threads}|{server.name}", tok_s)
    finally:
        for server in servers:
            add(f"serve_rss|{threads}|{server.name}", server.stop())


ROWS = [  # measurement key, label, higher is better
    ("decode", "decode tok/s (batch 1, {n} tokens)", True),
    ("prefill", "prefill tok/s ({n}-token prompt)", True),
    ("batched", "batched generation tok/s ({n} sequences)", True),
    ("cold", "cold start s (1-token generate)", False),
    ("rss", "peak RSS MiB (1-token generate)", False),
    ("serve", "serve output tok/s ({n} concurrent)", True),
    ("serve_rss", "peak RSS MiB (server)", False),
]


def table(raw: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    for threads in args.threads:
        for kind, label, higher in ROWS:
            keys = [str(p) for p in args.prompt_sizes] if kind == "prefill" else [kind]
            for key in keys:
                llama, ours = raw.get(f"{key}|{threads}|llama.cpp"), raw.get(f"{key}|{threads}|lmplug")
                if not llama or not ours:
                    continue
                n = {"decode": args.decode_tokens, "serve": args.concurrency, "batched": args.batch}.get(kind, key)
                a, b = statistics.median(llama), statistics.median(ours)
                rows.append({"metric": label.format(n=n), "threads": threads, "llama.cpp": a, "lmplug": b,
                             "ratio": b / a, "better": "higher" if higher else "lower", "runs": len(ours)})
    return rows


def print_table(rows: list[dict]) -> None:
    width = max([len(r["metric"]) for r in rows] + [6])
    print(f"{'metric':<{width}}  {'threads':>7}  {'llama.cpp':>10}  {'lmplug':>10}  {'lmplug/llama':>12}  better")
    for r in rows:
        print(f"{r['metric']:<{width}}  {r['threads']:>7}  {r['llama.cpp']:>10.2f}  {r['lmplug']:>10.2f}  "
              f"{r['ratio']:>11.2f}x  {r['better']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file, or a model name in the cache")
    p.add_argument("--llama-bin-dir", help="folder with llama-bench, llama-completion, llama-server "
                   "(default: $LLAMA_CPP_BIN, else the cache folder build_llamacpp.sh fills)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per thread count (medians)")
    p.add_argument("--cold-runs", type=int, default=2, help="cold starts per engine per round")
    p.add_argument("--prompt-sizes", default="128,512")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences of the batched section")
    p.add_argument("--batch-prompt", type=int, default=128, help="prompt tokens per batched sequence")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per serve request")
    p.add_argument("--slot-ctx", type=int, default=256, help="llama-server context per slot (-c N*this)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}")
    p.add_argument("--lmplug-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an lmplug config key for every lmplug run (as `lmplug --set`); repeatable")
    p.add_argument("--sizes", action="store_true", help="the sized random-weight files instead of --model "
                   "(sections decode, prefill, batched, cold unless --sections; prompt 512)")
    p.add_argument("--shapes", default="135m,1b,3b", help="--sizes: the shapes (sized_gguf.py)")
    p.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M", help="--sizes: the file types")
    p.add_argument("--quick", action="store_true", help="one round, one cold start each (--sizes: 32 decode tokens)")
    p.add_argument("--phases", action="store_true", help="at 2 threads or more, probe the read bandwidth "
                   "just before and after each decode run and add rows per bandwidth phase (a VM's "
                   "multi-thread bandwidth can move between levels within seconds)")
    p.add_argument("--json", metavar="PATH", help="write the table and raw measurements here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.threads = [int(t) for t in str(args.threads).split(",") if t]
        args.prompt_sizes = [int(n) for n in str(args.prompt_sizes).split(",") if n]
    except ValueError:
        p.error("--threads and --prompt-sizes take comma-separated integers, e.g. 1,2")
    if args.sizes:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--sections" not in given and not any(a.startswith("--sections=") for a in given):
            args.sections = "decode,prefill,batched,cold"
        if "--prompt-sizes" not in given and not any(a.startswith("--prompt-sizes=") for a in given):
            args.prompt_sizes = [512]
        args.shapes = [x for x in args.shapes.split(",") if x]
        args.types = [x for x in args.types.split(",") if x]
        shapes = {"135m", "1b", "3b"}
        if set(args.shapes) - shapes or set(args.types) - {"Q4_0", "Q8_0", "Q4_K_M"}:
            p.error(f"--shapes takes {', '.join(sorted(shapes))}; --types takes Q4_0, Q8_0, Q4_K_M")
        if args.quick:
            args.decode_tokens = 32
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.quick:
        args.rounds, args.cold_runs = 1, 1
    if min(args.threads, default=0) < 1 or args.rounds < 1 or args.cold_runs < 1 or args.concurrency < 1:
        p.error("--threads, --rounds, --cold-runs and --concurrency must be at least 1")
    return args


def sized_files(args: argparse.Namespace) -> list[Path]:
    """The --sizes files (written into the cache on first use), in --shapes x --types order."""
    import sized_gguf

    quantize = llama_bin_dir(args.llama_bin_dir) / "llama-quantize"
    quantize = str(quantize) if os.access(quantize, os.X_OK) else None
    files = []
    for shape in args.shapes:
        for kind in args.types:
            if kind == "Q4_K_M" and not quantize and sized_gguf.SHAPES[shape][1] % 256:
                print(f"bench_vs_llamacpp: {shape} Q4_K_M left out: no llama-quantize in "
                      f"{llama_bin_dir(args.llama_bin_dir)} and the approximation needs a hidden size "
                      "that is a multiple of 256", file=sys.stderr)
                continue
            started = time.perf_counter()
            files.append(sized_gguf.sized_file(shape, kind, quantize))
            if time.perf_counter() - started > 1:
                print(f"wrote {files[-1]} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return files


def bandwidth_rows(model: Path, raw: dict, args: argparse.Namespace,
                   bandwidth: dict[tuple[int, str], float]) -> list[dict]:
    """Per thread count: the GB/s of weights each engine's batch-1 decode reads, and that
    over the read bandwidth measured in each page size (the ratio column: lmplug / llama.cpp,
    as the others)."""
    size = weight_bytes(model)
    rows = []
    for threads in args.threads:
        llama, ours = raw.get(f"decode|{threads}|llama.cpp"), raw.get(f"decode|{threads}|lmplug")
        if not llama or not ours:
            continue
        a, b = (statistics.median(v) * size / 1e9 for v in (llama, ours))
        rows.append({"metric": f"weights GB/s (decode, {size / 1e6:.0f} MB a token)", "threads": threads,
                     "llama.cpp": a, "lmplug": b, "ratio": b / a, "better": "higher", "runs": len(ours)})
        for pages in ("4k", "huge"):
            bw = bandwidth[(threads, pages)]
            rows.append({"metric": f"% of read bandwidth, {pages} pages ({bw:.1f} GB/s)", "threads": threads,
                         "llama.cpp": 100 * a / bw, "lmplug": 100 * b / bw, "ratio": b / a, "better": "higher",
                         "runs": len(ours)})
    return rows


def sizes_main(args: argparse.Namespace) -> int:
    """--sizes: the side-by-side on each sized file, one table per file."""
    from read_bandwidth import PAGES, describe, read_bandwidth

    load_before = os.getloadavg()
    started = time.perf_counter()
    files = sized_files(args)
    measured = {(t, p): [read_bandwidth(t, pages=p)] for t in args.threads for p in PAGES}
    results = []
    for model in files:
        args.model = str(model)
        raw = run(args)
        results.append((model, raw))
    for (t, p), values in measured.items():
        values.append(read_bandwidth(t, pages=p))
    bandwidth = {t: statistics.mean(v) for t, v in measured.items()}
    report = []
    for model, raw in results:
        rows = table(raw, args) + bandwidth_rows(model, raw, args, bandwidth) + phase_rows(raw, args, weight_bytes(model))
        print(f"\n{model.name} ({model.stat().st_size / 1e6:.0f} MB)")
        print_table(rows)
        report.append({"model": str(model), "rows": rows, "raw": raw})
    print(f"\nllama.cpp {llama_version(llama_bin_dir(args.llama_bin_dir))} | lmplug sets: "
          f"{' '.join(args.lmplug_set) or 'none (default config)'} | {args.rounds} round(s), medians | read "
          f"bandwidth (start/end): {describe(measured)}")
    finish(args, load_before, started, {"files": report, "bandwidth": {f"{t}|{p}": v for (t, p), v in measured.items()}})
    return 0


def finish(args: argparse.Namespace, load_before: tuple, started: float, record: dict) -> None:
    """The load-average line, and with --json the record plus the loads and the arguments."""
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min): before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs; "
          f"{time.perf_counter() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({**record, "load_before": load_before, "load_after": load_after,
                                               "args": vars(args)}, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.sizes:
        return sizes_main(args)
    load_before = os.getloadavg()
    started = time.perf_counter()
    raw = run(args)
    rows = table(raw, args) + phase_rows(raw, args)
    print(f"model {gguf_file(args.model)} | llama.cpp {llama_version(llama_bin_dir(args.llama_bin_dir))} | "
          f"lmplug sets: {' '.join(args.lmplug_set) or 'none (default config)'} | "
          f"{args.rounds} round(s), medians")
    print_table(rows)
    finish(args, load_before, started, {"rows": rows, "raw": raw})
    return 0


def llama_version(bin_dir: Path) -> str:
    stamp = bin_dir / "VERSION"
    return f"b{stamp.read_text().split('.')[0]}" if stamp.is_file() else str(bin_dir)


if __name__ == "__main__":
    sys.exit(main())
