"""The vLLM servers a `ServerEngine` samples from (`rollout.server`): the ones this run starts
(`rollout.server.launch`) or those it is given (`rollout.server.urls`), checked before training (they
answer, serve the run's tokenizer and context length), asked over HTTP, and left out when they stop
answering. The one module of the server engine that speaks HTTP (`requests`)."""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import requests

from loorl.errors import ConfigError, ServersLost
from loorl.rollout.engines.server_launch import LocalServer, wait_until_healthy

log = logging.getLogger(__name__)

# Tokenized here and by each server: the same ids, or another model's tokenizer. No whitespace: vLLM
# loads the tiny model's character tokenizer through transformers' AutoTokenizer, which (5.19) makes it
# a Qwen2Tokenizer that drops spaces (loorl's own loading keeps them: models.load.load_tokenizer).
# Prompts and completions travel as token ids, so only a stop string's detokenized match could differ.
PROBE_TEXT = "12+34=46"


class ServerPool:
    """The live servers (`urls`) and the processes of those this run started (`launched`).
    `settings`: the `rollout.server` section (`vllm_server.ServerSettings`); `on_lost(url)`: called
    for each server left out (the weight transfer forgets it)."""

    def __init__(self, settings, *, max_model_len: int, on_lost: Callable[[str], None] | None = None) -> None:
        self.settings, self.max_model_len, self.on_lost = settings, max_model_len, on_lost
        self.urls: list[str] = []  # the live servers
        self.launched: list[LocalServer] = []  # the ones this run started
        self.served_name: str | None = None
        self.last_lost: str | None = None

    def start(self, command_for: Callable[[int], list[str]], *, tokenizer) -> None:
        """Start the servers this run launches (`command_for(port)`: the command line of each) and
        check every server against the run's `tokenizer`."""
        s = self.settings
        urls = list(s.urls)
        if not urls:
            log_dir = Path(s.log_dir or tempfile.mkdtemp(prefix="loorl-servers-"))
            for i in range(s.launch):
                port = s.port + i
                if not port_free(port):
                    raise ConfigError(
                        f"rollout.server.port: port {port} of 127.0.0.1 is taken, and the run would launch a "
                        "server there: set rollout.server.port to a free one, or rollout.server.urls to "
                        "the server listening there"
                    )
                url = f"http://127.0.0.1:{port}"
                self.launched.append(LocalServer(command_for(port), url=url,
                                                 log_path=log_dir / f"server-{port}.log"))  # fmt: skip
                urls.append(url)
            for server in self.launched:
                wait_until_healthy(server.url, timeout=s.startup_timeout_s, server=server)
        elif s.wait_for_urls_s > 0:  # servers starting beside the run (scripts/cluster/servers.sbatch)
            for url in urls:
                wait_until_healthy(url.rstrip("/"), timeout=s.wait_for_urls_s)
        for url in urls:
            self.check(url.rstrip("/"), tokenizer)
        self.urls = [u.rstrip("/") for u in urls]

    def check(self, url: str, tokenizer) -> None:
        """One line before training for a server that does not answer, or serves another tokenizer."""
        try:
            models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
        except (requests.RequestException, KeyError, ValueError) as err:
            raise ConfigError(
                f"rollout.server.urls: {url} does not answer as a vLLM server ({type(err).__name__}: "
                f"{str(err)[:120]}); start one with scripts/cluster/serve.py, or fix the URL"
            ) from None
        name = models[0]["id"]
        if self.served_name not in (None, name):
            raise ConfigError(
                f"rollout.server.urls: {url} serves {name!r}, another server {self.served_name!r}"
            )
        self.served_name = name
        answer = requests.post(
            f"{url}/tokenize",
            json={"model": name, "prompt": PROBE_TEXT, "add_special_tokens": False},
            timeout=30,
        ).json()
        mine = tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
        if answer.get("tokens") != mine:
            raise ConfigError(
                f"rollout.server.urls: {url} serves {name!r}, whose tokenizer splits {PROBE_TEXT!r} into "
                f"{answer.get('tokens')} and this run's into {mine}: serve the run's model "
                "(scripts/cluster/serve.py)"
            )
        if models[0].get("max_model_len", self.max_model_len) < self.max_model_len:
            raise ConfigError(
                f"rollout.server.urls: {url} serves at most {models[0]['max_model_len']} tokens, and a "
                f"sample may need {self.max_model_len} (prompt + completion): restart it with a larger "
                "--max-model-len"
            )

    def post_all(self, path: str, **kwargs) -> None:
        for url in self.urls:
            answer = requests.post(f"{url}{path}", timeout=self.settings.request_timeout_s, **kwargs)
            if answer.status_code != 200:
                raise RuntimeError(f"vLLM server {url}{path}: HTTP {answer.status_code} {answer.text[:200]}")

    def generate(self, url: str, body: dict) -> dict:
        """One `/inference/v1/generate` request's answer, with the time it finished (`finished_at`)."""
        answer = requests.post(
            f"{url}/inference/v1/generate", json=body, timeout=self.settings.request_timeout_s
        )
        if answer.status_code != 200:
            raise RuntimeError(f"vLLM server {url}: HTTP {answer.status_code} {answer.text[:200]}")
        return answer.json() | {"finished_at": time.perf_counter()}

    def answer(self, future: Future, body: dict) -> dict:
        """The answer of a request sent with `generate`; where its server failed, the request sent again
        to the next live one (dead servers are dropped)."""
        try:
            return future.result()
        except requests.RequestException as err:
            while True:
                self.drop_dead(err)
                try:
                    return self.generate(self.urls[0], body)
                except requests.RequestException as again:
                    err = again

    def drop_dead(self, err: Exception | None = None) -> None:
        """Leave out every server that does not answer /health (one warning line each); with none left,
        one line (`ServersLost`): the checkpoints and metrics written so far are untouched."""
        for url in [u for u in self.urls if not healthy(u)]:
            self.urls.remove(url)
            if self.on_lost is not None:
                self.on_lost(url)
            why = f" ({type(err).__name__})" if err is not None else ""
            log.warning("rollout.server: %s stopped answering%s; going on with %d server(s)", url, why,
                        len(self.urls))  # fmt: skip
            self.last_lost = url
        if not self.urls:
            raise ServersLost(
                f"every vLLM rollout server stopped answering (the last: {self.last_lost}); the last "
                "checkpoint is whole: restart the servers and run the same command with resume_from=auto"
            )

    def close(self) -> None:
        """Stop the servers this run started; a later `start` starts them again."""
        for server in self.launched:
            server.stop()
        self.launched, self.urls = [], []


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=10).status_code == 200
    except requests.RequestException:
        return False
