"""Prometheus metrics of one service instance, and its HTTP endpoint.

Each instance owns a `CollectorRegistry`, never prometheus-client's process-global one: tests
and the in-process bench run several services in one process. `serve_metrics(registry, port)`
serves it on `/metrics` while the service runs (port 0: no endpoint). One source per number:
- counts a service already keeps (its Counter, the handlers' stats, gauges such as queue depth
  and free KV slots) are read at scrape time from the same function that fills `$SRV.STATS`
  (`Metrics.watch_counts`); a key with a prefix of LABELLED becomes one labelled family
  (`finished_length` -> `specbus_scheduler_requests_finished_total{reason="length"}`), any other
  key `specbus_<role>_<key>_total`, or a gauge `specbus_<role>_<key>` when named as one;
- what no counter holds (latency histograms, acceptance by mode) lives in the prometheus objects
  made here, and `Metrics.stats()` adds their counts and sums to `$SRV.STATS`.
Label values are reasons, codes, stages and modes, never request ids, so series stay bounded.
Scrapes run in prometheus-client's HTTP thread: the count readers copy dicts in single C calls
(atomic under the GIL) and prometheus' own metrics are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from schemas.errors import ErrorCode, SpecbusError

NAMESPACE = "specbus"
# counter key prefix -> (family, label): the services name these counts `<prefix><value>`
LABELLED = {
    "refused_": ("requests_refused", "code"),
    "finished_": ("requests_finished", "reason"),
    "degraded_": ("degraded_steps", "reason"),
    "slots_": ("slots_freed", "reason"),
}
SCHEDULER_GAUGES = ("running", "queued", "generate_in_flight")
MODEL_SERVICE_GAUGES = ("free_slots", "used_slots", "in_flight")  # verifier and drafter
POSTPROCESSOR_GAUGES = ("active_requests",)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPTED_BUCKETS = tuple(range(17))  # accepted drafts per step: 0 .. MAX_SPECULATIVE_TOKENS
STAT_SUFFIXES = ("_total", "_count", "_sum")  # the samples $SRV.STATS carries (not buckets, not _created)

CountReader = Callable[[], Mapping[str, float]]


class CountsCollector:
    """Exposes a service's existing counts (module docstring) at scrape time."""

    def __init__(self, role: str, read: CountReader, gauges: Collection[str]):
        self.prefix = f"{NAMESPACE}_{role}_"
        self.read = read
        self.gauges = set(gauges)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for key, value in sorted(self.read().items()):
            if key in self.gauges:
                yield GaugeMetricFamily(self.prefix + key, f"{key} (also in $SRV.STATS)", value=value)
                continue
            labelled = next(((prefix, spec) for prefix, spec in LABELLED.items() if key.startswith(prefix)), None)
            if labelled is None:
                yield CounterMetricFamily(self.prefix + key, f"{key} (also in $SRV.STATS)", value=value)
                continue
            prefix, (family, label) = labelled
            if family not in families:
                families[family] = CounterMetricFamily(self.prefix + family, f"{prefix}<{label}> counts of $SRV.STATS",
                                                       labels=[label])
            families[family].add_metric([key.removeprefix(prefix)], value)
        yield from families.values()


class Metrics:
    """One service instance's registry: metrics made with counter()/histogram(), plus the
    service's existing counts once watch_counts() names where to read them."""

    def __init__(self, role: str):
        self.role = role
        self.prefix = f"{NAMESPACE}_{role}_"
        self.registry = CollectorRegistry()
        self.owned: list[MetricWrapperBase] = []
        self.read_counts: CountReader = dict

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        return self.own(Counter(self.prefix + name, documentation, labels, registry=self.registry))

    def histogram(self, name: str, documentation: str, buckets: tuple[float, ...],
                  labels: tuple[str, ...] = ()) -> Histogram:
        return self.own(Histogram(self.prefix + name, documentation, labels, registry=self.registry, buckets=buckets))

    def own(self, metric):
        self.owned.append(metric)
        return metric

    def watch_counts(self, read: CountReader, gauges: Collection[str]) -> None:
        """Expose read()'s keys (the service's $SRV.STATS counts) as counters, gauges for `gauges`."""
        self.read_counts = read
        self.registry.register(CountsCollector(self.role, read, gauges))

    def stats(self) -> dict[str, float]:
        """The $SRV.STATS data: the watched counts, then the totals, counts and sums of the
        metrics made here, keyed by their name less `specbus_<role>_` and with their labels,
        e.g. `draft_tokens_accepted_total{draft_mode=greedy,sampling=greedy}`."""
        data = dict(self.read_counts())
        for metric in self.owned:
            for family in metric.collect():
                for sample in family.samples:
                    if sample.name.endswith(STAT_SUFFIXES):
                        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                        data[sample.name.removeprefix(self.prefix) + (f"{{{labels}}}" if labels else "")] = sample.value
        return data


class SchedulerMetrics(Metrics):
    """Latencies and acceptance as the scheduler sees them (it commits every token)."""

    def __init__(self) -> None:
        super().__init__("scheduler")
        self.generated_tokens = self.counter("generated_tokens", "completion tokens committed")
        # client users are the deployment's configured few, so the label stays bounded
        self.requests_by_user = self.counter("user_requests", "GenerateRequests per client user: admitted, or "
                                             "refused (overloaded, or in another user's favour: fair_share)",
                                             ("user", "outcome"))
        self.time_to_first_token = self.histogram(
            "time_to_first_token_seconds", "admission to the commit of the first token", LATENCY_BUCKETS)
        self.inter_token_latency = self.histogram(
            "inter_token_latency_seconds",
            "time since the request's previous commit with tokens, divided over this commit's tokens; "
            "observed once per token after the first commit", LATENCY_BUCKETS)
        self.step_seconds = self.histogram("step_stage_seconds", "time of one step's stage (draft, verify, commit)",
                                           LATENCY_BUCKETS, ("stage",))
        modes = ("sampling", "draft_mode")  # sampling: greedy | sampled; draft_mode: the request's
        self.draft_proposed = self.counter("draft_tokens_proposed", "draft tokens sent to verification", modes)
        self.draft_accepted = self.counter("draft_tokens_accepted", "draft tokens the verifier accepted", modes)
        self.accepted_length = self.histogram("accepted_length", "accepted drafts per step of a row with drafts",
                                              ACCEPTED_BUCKETS, modes)

    def verified(self, greedy: bool, draft_mode: str, num_draft: int, num_accepted: int) -> None:
        """One row's verify step: num_draft drafts proposed, num_accepted of them accepted."""
        if not num_draft:
            return
        modes = ("greedy" if greedy else "sampled", draft_mode)
        self.draft_proposed.labels(*modes).inc(num_draft)
        self.draft_accepted.labels(*modes).inc(num_accepted)
        self.accepted_length.labels(*modes).observe(num_accepted)

    def committed(self, num_tokens: int, since_admitted_s: float, since_last_token_s: float | None) -> None:
        """A commit of num_tokens > 0; since_last_token_s None: the request's first tokens."""
        self.generated_tokens.inc(num_tokens)
        if since_last_token_s is None:
            self.time_to_first_token.observe(since_admitted_s)
            return
        for _ in range(num_tokens):
            self.inter_token_latency.observe(since_last_token_s / num_tokens)

    def step_timed(self, draft_s: float | None, verify_s: float, commit_s: float) -> None:
        """A step that verified rows; draft_s None when it sent no drafter a batch."""
        if draft_s is not None:
            self.step_seconds.labels("draft").observe(draft_s)
        self.step_seconds.labels("verify").observe(verify_s)
        self.step_seconds.labels("commit").observe(commit_s)


class ModelServiceMetrics(Metrics):
    """The verifier's or the drafter's: time per batch (KV slots are watched counts)."""

    def __init__(self, role: str):
        super().__init__(role)
        self.batch_seconds = self.histogram("batch_seconds", "time to answer one batch, model work included",
                                            LATENCY_BUCKETS)


@contextmanager
def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> Iterator[int | None]:
    """Serve registry on http://host:port/metrics until the block ends; yields the port, or None
    when port is 0 (no endpoint). A port that is taken or out of range: SpecbusError naming
    metrics_port."""
    if port == 0:
        yield None
        return
    if not 0 < port < 65536:
        raise SpecbusError(ErrorCode.invalid_field, f"metrics_port must be in [1, 65535] or 0 (off), got {port}",
                           "metrics_port")
    try:
        server, thread = start_http_server(port, host, registry=registry)
    except OSError as exc:
        raise SpecbusError(ErrorCode.invalid_field, f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
                           "metrics_port") from exc
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)
