"""Prometheus metrics: the four real services as asyncio tasks over a real nats-server, tiny random
checkpoints, each serving /metrics on its own free port; two generations through the real
client, then every endpoint scraped over HTTP and compared with what the client saw and with
`$SRV.STATS`. The metric helpers alone, without NATS, at the end."""

import asyncio
import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.config import DrafterConfig, PostprocessorConfig, SchedulerConfig, VerifierConfig, load_config
from schemas.errors import SpecbusError
from services.client import Client, make_request
from services.launch.processes import free_port
from services.launch.stack import StackConfig
from services.drafter.drafter import run_drafter
from services.postprocessor.postprocessor import run_postprocessor
from services.scheduler.scheduler import run_scheduler
from services.verifier.verifier import run_verifier
from services.runtime.metrics import LABELLED, Metrics, SchedulerMetrics, serve_metrics
from tests.conftest import wait_for_heartbeats
from tests.tiny_checkpoints import write_model_dirs

DASHBOARD = Path(__file__).resolve().parents[3] / "ops/grafana/specbus-dashboard.json"
VOCAB = 60  # the test tokenizer's: every generated id decodes
MAX_SLOTS = 4
MAX_TOKENS = 10
RUNNERS = {"scheduler": (run_scheduler, SchedulerConfig), "verifier": (run_verifier, VerifierConfig),
           "drafter": (run_drafter, DrafterConfig), "postprocessor": (run_postprocessor, PostprocessorConfig)}


@pytest.fixture(scope="module")
def decodable_model_dirs(tmp_path_factory):
    """model_dirs whose models' vocabulary is the tokenizer's: every generated id decodes."""
    return {name: str(path) for name, path in write_model_dirs(tmp_path_factory.mktemp("models"), VOCAB).items()}


def scrape_once(port: int) -> dict[str, float]:
    """/metrics as {name{label=value,...}: value}, labels sorted: the $SRV.STATS key style."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


async def scrape(port: int) -> dict[str, float]:
    return await asyncio.to_thread(scrape_once, port)


async def stats(nc, role: str) -> dict:
    reply = await nc.request(f"$SRV.STATS.{role}", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


def stats_key(name: str, role: str, data: dict) -> str:
    """The $SRV.STATS key of a scraped sample: the same name less `specbus_<role>_` for the
    metrics' own samples, the service's counter key for counts it already kept."""
    short = name.removeprefix(f"specbus_{role}_")
    if short in data:
        return short
    bare, _, labels = short.partition("{")
    bare = bare.removesuffix("_total")
    for prefix, (family, label) in LABELLED.items():
        if bare == family:
            return prefix + labels.removeprefix(f"{label}=").removesuffix("}")
    return bare


class Services:
    """The four services as tasks, each with its stop event and a metrics port."""

    def __init__(self, nats_url, model_dirs):
        self.nats_url, self.model_dirs = nats_url, model_dirs
        self.ports = {}
        for role in RUNNERS:  # distinct: a port released at once may be handed out again
            self.ports[role] = free_port(set(self.ports.values()))
        self.running: list[tuple[asyncio.Event, asyncio.Task]] = []

    def start(self):
        models = {"target_model": self.model_dirs["target"], "draft_model": self.model_dirs["draft"],
                  "tokenizer": self.model_dirs["target"]}
        for role, (run, config_cls) in RUNNERS.items():
            settings = {"max_slots": MAX_SLOTS, "max_seq_len": 64} if role in ("verifier", "drafter") else {}
            # the suffix index off: every draft token counted here is the drafter's
            settings |= {"draft_timeout_s": 5.0, "suffix_max_tokens": 0} if role == "scheduler" else {}
            settings |= {k: v for k, v in models.items() if k in config_cls.__dataclass_fields__}
            config = load_config(config_cls, env={}, nats_url=self.nats_url, instance_id=f"{role}-m",
                                 heartbeat_interval_s=0.1, metrics_port=self.ports[role], **settings)
            stop = asyncio.Event()
            self.running.append((stop, asyncio.create_task(run(config, stop), name=role)))

    async def stop(self):
        for stop, task in reversed(self.running):
            stop.set()
            await asyncio.wait_for(task, timeout=30)


@pytest.fixture
async def services(nats_server, decodable_model_dirs):
    services = Services(nats_server.url, decodable_model_dirs)
    yield services
    await services.stop()


async def test_each_service_serves_metrics_matching_the_requests_and_srv_stats(nats_server, nc, services):
    services.start()
    await wait_for_heartbeats(nc, [f"{role}-m" for role in RUNNERS])
    greedy = make_request([3, 14, 15, 9, 26], request_id="m-greedy", max_tokens=MAX_TOKENS, temperature=0.0,
                          ignore_eos=True, num_speculative_tokens=4, logprobs=1)
    sampled = make_request([5, 35, 8], request_id="m-sampled", max_tokens=MAX_TOKENS, temperature=0.9, seed=7,
                           ignore_eos=True, num_speculative_tokens=3, draft_mode="sample")
    async with Client(nats_server.url) as client:
        results = await asyncio.gather(client.generate(greedy), client.generate(sampled))
    for result in results:
        assert result.finish_reason == "length" and len(result.token_ids) == MAX_TOKENS
        assert not result.degraded, result.degraded  # no timeouts: the counts below are exact
    usage = {result.request_id: result.usage for result in results}

    async with asyncio.timeout(10):  # finished requests' slots are released on the next batches
        while (await scrape(services.ports["verifier"]))["specbus_verifier_free_slots"] != MAX_SLOTS \
                or (await scrape(services.ports["drafter"]))["specbus_drafter_free_slots"] != MAX_SLOTS:
            await asyncio.sleep(0.05)
    scraped = {role: await scrape(port) for role, port in services.ports.items()}

    scheduler = scraped["scheduler"]
    assert scheduler["specbus_scheduler_admitted_total"] == 2
    assert scheduler['specbus_scheduler_requests_finished_total{reason=length}'] == 2
    assert scheduler["specbus_scheduler_generated_tokens_total"] == 2 * MAX_TOKENS
    assert scheduler["specbus_scheduler_queued"] == 0 and scheduler["specbus_scheduler_running"] == 0
    assert scheduler["specbus_scheduler_time_to_first_token_seconds_count"] == 2
    # the first commit of each request holds its one prefill token; every later token has an ITL
    assert scheduler["specbus_scheduler_inter_token_latency_seconds_count"] == 2 * (MAX_TOKENS - 1)
    assert scheduler["specbus_scheduler_step_stage_seconds_count{stage=verify}"] >= MAX_TOKENS / 5
    assert scheduler["specbus_scheduler_step_stage_seconds_count{stage=draft}"] > 0
    for request_id, modes in (("m-greedy", "draft_mode=greedy,sampling=greedy"),
                              ("m-sampled", "draft_mode=sample,sampling=sampled")):
        proposed = scheduler[f"specbus_scheduler_draft_tokens_proposed_total{{{modes}}}"]
        accepted = scheduler[f"specbus_scheduler_draft_tokens_accepted_total{{{modes}}}"]
        assert (proposed, accepted) == (usage[request_id].draft_tokens_proposed,
                                        usage[request_id].draft_tokens_accepted) and proposed > 0
        assert scheduler[f"specbus_scheduler_accepted_length_sum{{{modes}}}"] == accepted
    total_proposed = sum(u.draft_tokens_proposed for u in usage.values())
    total_accepted = sum(u.draft_tokens_accepted for u in usage.values())

    verifier = scraped["verifier"]
    assert verifier["specbus_verifier_used_slots"] == 0
    assert verifier["specbus_verifier_drafts_proposed_total"] == total_proposed
    assert verifier["specbus_verifier_drafts_accepted_total"] == total_accepted
    assert verifier["specbus_verifier_tokens_emitted_total"] >= 2 * MAX_TOKENS
    assert verifier["specbus_verifier_slots_freed_total{reason=released}"] == 2
    assert verifier["specbus_verifier_batch_seconds_count"] == verifier["specbus_verifier_batches_total"] > 0

    drafter = scraped["drafter"]
    assert drafter["specbus_drafter_used_slots"] == 0
    assert drafter["specbus_drafter_draft_tokens_total"] == total_proposed
    assert drafter["specbus_drafter_slots_freed_total{reason=released}"] == 2

    post = scraped["postprocessor"]
    assert post["specbus_postprocessor_active_requests"] == 0
    for dropped in ("late_records", "duplicate_records", "unjoined_records", "logprobs_timeouts"):
        assert post[f"specbus_postprocessor_{dropped}_total"] == 0, dropped

    for role, samples in scraped.items():
        data = await stats(nc, role)
        counts = {name: value for name, value in samples.items()
                  if name.startswith(f"specbus_{role}_") and "_bucket" not in name and "_created" not in name}
        compared = {name: data.get(stats_key(name, role, data)) for name in counts}
        assert compared == counts, role

    panels = json.loads(DASHBOARD.read_text())["panels"]
    queried = {name for panel in panels for target in panel["targets"]
               for name in re.findall(r"specbus_\w+", target["expr"])}
    exposed = {name.partition("{")[0] for samples in scraped.values() for name in samples}
    # these families appear with the first refusal / degraded step; none happened here
    assert queried - exposed == {"specbus_scheduler_requests_refused_total", "specbus_scheduler_degraded_steps_total"}


def test_counts_kept_by_a_service_become_counters_gauges_and_labelled_families():
    counts = {"admitted": 3, "finished_length": 2, "finished_error": 1, "refused_overloaded": 4, "queued": 5}
    metrics = Metrics("scheduler")
    metrics.watch_counts(lambda: counts, gauges=["queued"])
    families = {family.name: family for family in metrics.registry.collect()}
    assert families["specbus_scheduler_admitted"].type == "counter"
    assert families["specbus_scheduler_queued"].type == "gauge"
    finished = {s.labels["reason"]: s.value for s in families["specbus_scheduler_requests_finished"].samples}
    assert finished == {"length": 2, "error": 1}
    assert families["specbus_scheduler_requests_refused"].samples[0].labels == {"code": "overloaded"}
    counts["finished_length"] = 9  # read at scrape time: the service's counter is the one source
    assert metrics.registry.get_sample_value("specbus_scheduler_requests_finished_total", {"reason": "length"}) == 9
    assert metrics.stats() == counts


def test_each_instance_has_its_own_registry_and_stats_carry_the_histogram_counts():
    first, second = SchedulerMetrics(), SchedulerMetrics()  # same names, one process: no clash
    first.committed(1, since_admitted_s=0.2, since_last_token_s=None)
    first.committed(3, since_admitted_s=0.5, since_last_token_s=0.3)
    first.verified(greedy=False, draft_mode="sample", num_draft=4, num_accepted=2)
    first.verified(greedy=True, draft_mode="greedy", num_draft=0, num_accepted=0)  # k=0 step: not a draft step
    data = first.stats()
    assert data["time_to_first_token_seconds_count"] == 1 and data["inter_token_latency_seconds_count"] == 3
    assert data["inter_token_latency_seconds_sum"] == pytest.approx(0.3)
    assert data["generated_tokens_total"] == 4
    assert data["draft_tokens_proposed_total{draft_mode=sample,sampling=sampled}"] == 4
    assert data["accepted_length_count{draft_mode=sample,sampling=sampled}"] == 1
    assert not any("sampling=greedy" in key for key in data)
    assert second.stats()["generated_tokens_total"] == 0


def test_metrics_endpoint_is_off_at_port_zero_and_a_taken_port_names_the_field():
    registry = Metrics("drafter").registry
    with serve_metrics(registry, 0) as port:
        assert port is None
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(SpecbusError, match="cannot serve metrics") as caught:
            with serve_metrics(registry, taken.getsockname()[1]):
                pass
    assert caught.value.field == "metrics_port"
    with pytest.raises(SpecbusError, match="metrics_port must be in"):
        with serve_metrics(registry, 70000):
            pass
    with pytest.raises(ValueError, match="metrics_port_base"):
        StackConfig(metrics_port_base=-1)
