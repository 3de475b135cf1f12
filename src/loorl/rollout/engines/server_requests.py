"""A `ServerEngine`'s requests: what one `/inference/v1/generate` request asks (a prompt's K samples,
token ids in, a full `SamplingParams`), which server each prompt goes to (`spread`), the requests in
flight (`Dispatch`: sent from threads, so `submit` returns at once), and a sample read from an answer
(`completion_of`)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from loorl.rollout.engines.server_pool import ServerPool
from loorl.types import Completion, SamplingConfig


def sampling_params(sampling: SamplingConfig, *, n: int, greedy: bool, max_new_tokens: int | None,
                    stop_token_ids: list[int], stop_texts: list[str]) -> dict:  # fmt: skip
    """The `sampling_params` of a request: every field that shapes the distribution set explicitly."""
    s = sampling
    return {
        "n": n,
        "temperature": 0.0 if greedy else s.temperature,
        "top_p": 1.0 if greedy else s.top_p,
        "top_k": 0 if greedy else s.top_k,
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "max_tokens": s.max_new_tokens if max_new_tokens is None else max_new_tokens,
        "stop_token_ids": stop_token_ids,
        "stop": stop_texts or None,
        "include_stop_str_in_output": True,
        "ignore_eos": False,
        "logprobs": 0,
        "detokenize": bool(stop_texts),
    }  # fmt: skip


def spread(n_prompts: int, n_servers: int) -> list[int]:
    """Which server each prompt goes to: contiguous blocks, as even as can be (a prompt's K samples are
    one request, so a group stays on one server)."""
    return [min(i * n_servers // max(n_prompts, 1), n_servers - 1) for i in range(n_prompts)]


def completion_of(choice: dict, cut) -> Completion:
    """One sample of a `/inference/v1/generate` answer: its ids, the sampler's log-probs, and its weight
    versions (`weight_versions` spans over its tokens: the oldest, and whether there were two)."""
    tokens = list(choice["token_ids"])
    logprobs = [step["logprob"] for step in (choice.get("logprobs") or {}).get("content") or []]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"a vLLM server answered {len(tokens)} tokens with {len(logprobs)} log-probs")
    versions = [int(s["version"]) for s in choice.get("weight_versions") or [] if str(s["version"]).isdigit()]
    completion = cut(tokens, logprobs)
    if versions:
        completion.version = min(versions)
        completion.spans_versions = len(set(versions)) > 1
    return completion


class Dispatch:
    """The requests in flight, by ticket: each prompt's request sent to its server from a thread
    (`send` returns at once), collected with `take`; a server that fails is left out and its prompts
    go to the others (`ServerPool.answer`)."""

    def __init__(self, servers: ServerPool) -> None:
        self.servers = servers
        self.threads: ThreadPoolExecutor | None = None
        self.tickets: dict[int, tuple[list[Future], float, list]] = {}
        self.next_ticket = 0

    def open(self) -> None:
        self.threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="loorl-server")

    def send(self, bodies: list[dict], stop) -> int:
        """Send each request (`bodies`, one per prompt, spread over the live servers); its ticket."""
        where = spread(len(bodies), len(self.servers.urls))
        urls = self.servers.urls
        futures = [self.threads.submit(self.servers.generate, urls[w], r) for w, r in zip(where, bodies)]
        ticket = self.next_ticket
        self.next_ticket += 1
        self.tickets[ticket] = (futures, time.perf_counter(), [bodies, stop])
        return ticket

    def take(self, ticket: int | None) -> tuple[list[dict], float, list[list[int]] | None, float]:
        """The answers of the requests of `ticket` (None: the oldest), when they were sent, their `stop`,
        and how long this call waited for them."""
        ticket = min(self.tickets) if ticket is None else ticket
        futures, start, (bodies, stop) = self.tickets.pop(ticket)
        wait_start = time.perf_counter()
        answers = [self.servers.answer(future, bodies[i]) for i, future in enumerate(futures)]
        return answers, start, stop, time.perf_counter() - wait_start

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
            self.threads = None
