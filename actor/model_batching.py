"""The model server's generation side, apart from HTTP: one thread owns the hf engine and runs the
queued requests in batches (`ModelServer`), and the server's counters render as Prometheus text.

`actor/model_server.py` puts it behind its OpenAI-compatible routes. A request is a `Job`: its
waiter is told through `Job.wake` (called from the generation thread) when a streamed step or the
whole reply is in, so an event loop can wait for it without a thread of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from longhorizon.actor.engines.base import EngineSettings, GenerationRequest
from longhorizon.actor.engines.hf import HFEngine
from longhorizon.common.config import SamplingConfig
from longhorizon.common.models import WeightsRefused
from longhorizon.common.wire import WeightsUpdate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; requests with equal settings share a batch."""

    max_tokens: int
    temperature: float
    top_p: float


class ServerStopping(RuntimeError):
    """A request the server could not finish because it is stopping (answered with a 503)."""


class ClientGone(RuntimeError):
    """The client closed its connection before its reply was ready: its generation stops and
    nothing is sent."""


@dataclass
class Job:
    """One request's prompts (a reply each), as the generation thread takes it."""

    prompts: list[list[int]]
    sampling: Sampling
    top_logprobs: int = 0
    steps: queue.Queue | None = None
    """For a streamed request: (prompt index, token, log-prob, top pairs) after every decoding
    step, then None once the job is done."""
    wake: Callable[[], None] | None = None
    """Called from the generation thread after each of a streamed job's steps and once the job is
    done, so that whoever waits for it need not poll."""
    images: tuple[bytes, ...] = ()
    """The prompts' images (a chat's, so every prompt's the same), shown to a vision-language model."""
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: threading.Event = field(default_factory=threading.Event)
    """Set when the client has left: the job's rows stop at the next decoding step, and a job
    still queued is never generated."""
    results: list = field(default_factory=list)
    error: BaseException | None = None


LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
METRIC_PREFIX = "longhorizon_serve_"


class Metrics:
    """The server's counters and latency histogram, rendered in Prometheus text format by prometheus_client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = {}
        """(method, endpoint, HTTP status) -> count."""
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.weight_loads = 0
        self.abandoned = 0
        # endpoint -> (count per bucket of LATENCY_BUCKETS_S and one over the last, sum of seconds)
        self._latency: dict[str, tuple[list[int], float]] = {}

    def count_request(self, method: str, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (method, endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            buckets, total = self._latency.get(endpoint, ([0] * (len(LATENCY_BUCKETS_S) + 1), 0.0))
            index = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if seconds <= bound), len(LATENCY_BUCKETS_S))
            buckets[index] += 1
            self._latency[endpoint] = (buckets, total + seconds)

    def count_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated_tokens

    def count_weight_load(self) -> None:
        with self._lock:
            self.weight_loads += 1

    def count_abandoned(self) -> None:
        with self._lock:
            self.abandoned += 1

    def render(self, *, weights_refused: int, queue_depth: int, in_flight: int, policy_version: int) -> str:
        """The Prometheus text exposition of every figure (prometheus_client writes it)."""
        with self._lock:
            requests = sorted(self.requests.items())
            latency = sorted((endpoint, list(buckets), total) for endpoint, (buckets, total) in self._latency.items())
            prompt_tokens, generated_tokens, weight_loads = self.prompt_tokens, self.generated_tokens, self.weight_loads
            abandoned = self.abandoned

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(METRIC_PREFIX + name, help_text, value=value)

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(METRIC_PREFIX + name, help_text, value=value)

        by_request = CounterMetricFamily(METRIC_PREFIX + "requests", "HTTP requests answered, by method, endpoint and status.",
                                         labels=["method", "endpoint", "status"])
        for (method, endpoint, status), count in requests:
            by_request.add_metric([method, endpoint, str(status)], count)
        durations = HistogramMetricFamily(METRIC_PREFIX + "request_duration_seconds",
                                          "Time from a request's arrival to the end of its reply.", labels=["endpoint"])
        for endpoint, buckets, total in latency:
            cumulative, points = 0, []
            for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), buckets):
                cumulative += count
                points.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            durations.add_metric([endpoint], points, sum_value=total)
        families = [
            by_request,
            counter("prompt_tokens", "Prompt tokens of the generation requests answered.", prompt_tokens),
            counter("generated_tokens", "Tokens generated and returned to clients.", generated_tokens),
            counter("requests_abandoned", "Generation requests whose client left before the reply; their generation "
                    "stopped.", abandoned),
            counter("weight_loads", "Weight loads that replaced the served weights.", weight_loads),
            counter("weights_refused", "Weight loads refused because the weights did not fit the model.",
                    weights_refused),
            gauge("queue_depth", "Generation requests waiting for the worker.", queue_depth),
            gauge("requests_in_flight", "Generation requests waiting or being generated.", in_flight),
            gauge("policy_version", "Version of the weights being served.", policy_version),
            durations,
        ]
        return generate_latest(_Snapshot(families)).decode()


class _Snapshot(Collector):
    """One rendering's figures as a collector, so prometheus_client writes the exposition: the
    counts live in `Metrics` (updated under its lock by the HTTP and generation threads)."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


class ModelServer:
    """The model, its tokenizer and the batching worker, independent of HTTP."""

    def __init__(
        self,
        model_dir: str,
        *,
        served_name: str = "",
        dtype: str = "float32",
        max_batch_size: int = 16,
        seed: int = 0,
        torch_threads: int = 1,
        batch_window_s: float = 0.002,
    ) -> None:
        self.model_dir = str(model_dir)
        self.served_name = served_name or Path(model_dir).name
        self.engine = HFEngine(
            EngineSettings(
                model_path=self.model_dir, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
                torch_threads=torch_threads,
            )
        )
        self.tokenizer = self.engine.tokenizer
        # A vision-language model's config keeps these in its language model's part.
        text_config = self.engine.model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 0) or 0)
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window_s = max(0.0, batch_window_s)
        self.weights_refused = 0
        """Weight loads refused because the weights did not fit the model."""
        self.metrics = Metrics()
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._stopping = threading.Event()
        self._worker = threading.Thread(target=self._run_batches, name="serve-model-batcher", daemon=True)
        self._worker.start()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the worker to take them into a batch."""
        return self._jobs.qsize()

    @property
    def in_flight(self) -> int:
        """Requests waiting or being generated."""
        return self._in_flight

    @property
    def running(self) -> bool:
        return self._worker.is_alive()

    def submit(self, prompts: list[list[int]], sampling: Sampling, top_logprobs: int = 0, stream: bool = False,
               wake: Callable[[], None] | None = None, images: Sequence[bytes] = ()) -> Job:
        """Queue one reply per prompt; the job's `done` is set when its results (or error) are in:
        the hf engine's GenerationResults (with `top_logprobs` > 0, results that also hold that
        many top tokens per position). A streamed job also gets every decoding step's tokens in
        `steps` as they are sampled. `wake()` is called (from the generation thread) after each
        step and at the end. `images` are every prompt's (a chat's images, as its prompt tokens
        hold them). A server that is stopping takes no more jobs (`ServerStopping`)."""
        job = Job(prompts, sampling, top_logprobs, queue.Queue() if stream else None, wake, tuple(images))
        with self._in_flight_lock:  # with stop(): a job is queued before the queue is emptied, or refused
            if self._stopping.is_set():
                raise ServerStopping("the server is stopping")
            self._in_flight += 1
            self._jobs.put(job)
        return job

    def abandon(self, job: Job) -> None:
        """The job's client has left: stop generating for it (counted once)."""
        if not job.abandoned.is_set() and not job.done.is_set():
            job.abandoned.set()
            self.metrics.count_abandoned()

    def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors folder in place, all or nothing: weights that do not fit the model
        (names, shapes, dtypes, finite values) raise `WeightsRefused` before any tensor is
        copied; they are counted (`weights_refused`) and the server keeps serving its version."""
        try:
            self.engine.update_weights(WeightsUpdate(version=version, path=path))
            self.metrics.count_weight_load()
        except WeightsRefused as refused:
            self.weights_refused += 1
            log.warning("refused weights v%d from %s, still serving v%d (%d refused so far): %s",
                        version, path, self.policy_version, self.weights_refused, refused)
            raise

    def stop(self) -> None:
        """Stop generating: the batch under way ends at its next decoding step and the requests
        still queued are answered with an error, so that the batcher thread has returned before
        the interpreter exits (a thread left inside torch then aborts the process)."""
        with self._in_flight_lock:
            self._stopping.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._fail(job, ServerStopping("the server is stopping"))
        self._jobs.put(None)
        self._worker.join(timeout=60)

    def _rows_to_end(self, owners: list[tuple[Job, int]]):
        """The hf engine's `cancelled` for a batch whose rows are (job, prompt index): every row
        ends once the server stops, a row alone once its job's client has left."""

        def rows() -> list[bool]:
            stopping = self._stopping.is_set()
            return [stopping or job.abandoned.is_set() for job, _ in owners]

        return rows

    def _fail(self, job: Job, error: BaseException) -> None:
        job.error = error
        self._finish(job)

    def _finish(self, job: Job) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
        job.done.set()
        if job.steps is not None:
            job.steps.put(None)
        if job.wake is not None:
            job.wake()

    def _run_batches(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            if first.abandoned.is_set():  # its client left while it waited
                self._fail(first, ClientGone("the client closed its connection"))
                continue
            jobs = [first]
            rows = len(first.prompts)
            # Requests that arrived while the last batch ran, or within the short window after
            # the first one, join this batch: clients' requests rarely arrive in the same instant.
            window_ends = time.monotonic() + self.batch_window_s
            while rows < self.max_batch_size:
                try:
                    job = self._jobs.get(timeout=max(0.0, window_ends - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                if job.abandoned.is_set():
                    self._fail(job, ClientGone("the client closed its connection"))
                    continue
                jobs.append(job)
                rows += len(job.prompts)
            by_sampling: dict[Sampling, list[Job]] = {}
            for job in jobs:
                by_sampling.setdefault(job.sampling, []).append(job)
            for sampling, group in by_sampling.items():
                requests = [
                    GenerationRequest(token_ids=prompt, episode_id=f"serve-{index}", images=list(job.images))
                    for job in group for index, prompt in enumerate(job.prompts)
                ]
                try:
                    # Only this thread generates, so setting the engine's sampling per batch is safe.
                    self.engine.sampling = SamplingConfig(
                        temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_tokens
                    )
                    # The top tokens cost little, so the batch computes the most any request wants.
                    top = max(job.top_logprobs for job in group)
                    owners = [(job, index) for job in group for index in range(len(job.prompts))]
                    results = []
                    for start in range(0, len(requests), self.max_batch_size):
                        rows = slice(start, start + self.max_batch_size)
                        results += self.engine._generate_batch(requests[rows], top, _step_sender(owners[rows]),
                                                               cancelled=self._rows_to_end(owners[rows]))
                    if self._stopping.is_set():  # cut short: not an answer to give
                        raise ServerStopping("the server is stopping")
                    for job in group:
                        job.results, results = results[: len(job.prompts)], results[len(job.prompts):]
                except ServerStopping as exc:
                    for job in group:
                        job.error = exc
                except Exception as exc:  # the waiting requests answer with a 500
                    log.exception("generation failed")
                    for job in group:
                        job.error = exc
                for job in group:
                    self._finish(job)


def _step_sender(owners: list[tuple[Job, int]]):
    """The hf engine's per-step callback for a batch whose rows are (job, prompt index): each
    streamed job gets its rows' new tokens; None when no job in the batch streams."""
    if not any(job.steps is not None for job, _ in owners):
        return None

    streamed = list({id(job): job for job, _ in owners if job.steps is not None}.values())

    def send(tokens: list[int], logprobs: list[float], tops: list[list]) -> None:
        for row, (job, index) in enumerate(owners):
            if job.steps is not None:
                job.steps.put((index, tokens[row], logprobs[row], tops[row][: job.top_logprobs]))
        for job in streamed:
            if job.wake is not None:
                job.wake()

    return send
