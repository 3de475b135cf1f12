"""The log-prob pass's extra memory and time: the plain path over the whole logits against the
chunked one from hidden states (`loorl.algo.head_logprobs`), forward and backward, at several chunk
sizes. Memory is torch's memory tracker's peak of live tensors (the CPU has no allocator statistics);
time is the median of `--repeats` runs.

    python scripts/bench/bench_logprobs.py --rows 4 --length 512 --vocab 151936 --hidden 64
    python scripts/bench/bench_logprobs.py --rows 64 --length 48 --vocab 49152 --hidden 576   # SmolLM2's head

Prints a markdown table (docs/performance/memory.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from loorl.algo.head_logprobs import head_logprobs
from loorl.algo.logprobs import token_entropy, token_logprobs


def peak_mib(fn) -> float:
    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    n, t, v = args.rows, args.length, args.vocab
    hidden = torch.randn(n, t, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(v, args.hidden, generator=gen) * 0.1).requires_grad_()
    tokens = torch.randint(v, (n, t), generator=gen)

    def plain():
        logits = hidden @ weight.T  # [n, t, V]
        logp = token_logprobs(logits, tokens, temperature=args.temperature)
        with torch.no_grad():
            token_entropy(logits.detach(), tokens=tokens, temperature=args.temperature)
        logp.sum().backward()

    def chunked(size):
        def run():
            logp, _ = head_logprobs(
                hidden, weight, tokens, temperature=args.temperature, chunk_tokens=size, with_entropy=True
            )
            logp.sum().backward()

        return run

    batch_logits = n * t * v * 4 / 2**20
    print(f"{n} x {t} positions, vocabulary {v:,}, hidden {args.hidden}: the batch's float32 logits "
          f"are {batch_logits:,.0f} MiB; forward + backward, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")  # fmt: skip
    print("| path | chunk (tokens) | one chunk's logits (MiB) | peak (MiB) | seconds |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| plain (whole logits) | - | - | {peak_mib(plain):,.0f} | {seconds(plain, args.repeats):.2f} |")
    for size in args.chunks:
        run = chunked(size)
        chunk = size * v * 4 / 2**20
        peak, took = peak_mib(run), seconds(run, args.repeats)
        print(f"| chunked | {size} | {chunk:,.0f} | {peak:,.0f} | {took:.2f} |")


if __name__ == "__main__":
    main()
