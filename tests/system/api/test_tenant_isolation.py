"""No tenant stalls another: on one stack (nats-server, scheduler, verifier, drafter,
postprocessor and gateway, each a process, the tiny pair) with two API keys, bob's hostile
requests fail fast where his input is at fault, and alice's short request, timed while each
attack runs, stays within ATTACK_FACTOR times its own control latency (measured in the same
run, before the attacks) plus one step's slack. Attacks: grammars that break the grammar
matcher, refused at admission (a 400 naming the field) or, one that breaks only after some
output, failing bob's own row in the verifier (never the batch alice's row is in, never a
retry); a flood of long prompts in one request (fair share of prefill:
services/scheduler/step_planner.py) or of long prompts' prompt logprobs (fair share of the side
channel's bytes); a response past its prompt logprob values (a 400).
The bounds are generous and relative (this machine may be busy); no traceback storm is checked
in the verifier's log. What the gateway serves without a key (/health, /metrics, the OpenAPI
docs) shows nobody's prompt, user or key (public by design: docs/PROTOCOL.md#tenant-isolation).
"""

import asyncio
import statistics
import time
import urllib.request

import openai
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_S = 300.0  # the most any request here waits before the test fails
ATTACK_FACTOR = 2.0  # alice's latency under attack, in her control latencies
SLACK_S = 2.0  # plus this: the step in flight when alice arrives, on a machine that may be busy
CONTROL = {"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
WIDE = "start: " + " | ".join('"w%dz"' % i for i in range(3000))  # an Earley row past its limit at once
LATE = "start: " + " ".join(['("a" | "b")'] * 24) + " wide\nwide: " + " | ".join('"w%dz"' % i for i in range(3000))
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}
SELF_ONLY = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
FLOOD_PROMPTS, FLOOD_LEN = 16, 2000  # bob's prefill flood: 16 prompts of 2000 token ids, max_tokens 1


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(start_stack, tiny_pair):
    async with start_stack(*tiny_pair, gateways=1, client_users=("alice", "bob")) as running:
        yield running


def api(stack, user: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key(user), max_retries=0,
                              timeout=WAIT_S)


@pytest.fixture(scope="module")
def model(tiny_pair):
    return tiny_pair[0].name


async def control_s(alice: openai.AsyncOpenAI, model: str) -> float:
    started = time.monotonic()
    done = await alice.completions.create(model=model, **CONTROL)
    assert done.usage.completion_tokens == CONTROL["max_tokens"]
    return time.monotonic() - started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def baseline_s(stack, model) -> float:
    """alice's control latency with nobody else on the stack (the median of five, after a warm-up)."""
    alice = api(stack, "alice")
    await control_s(alice, model)
    return statistics.median([await control_s(alice, model) for _ in range(5)])


async def scheduler_stats(stack) -> dict:
    import json
    reply = await stack.nc.request("$SRV.STATS.scheduler", b"", timeout=5)
    return json.loads(reply.data)["endpoints"][0]["data"]


def check_bound(under_s: float, baseline_s: float, attack: str) -> None:
    bound = ATTACK_FACTOR * baseline_s + SLACK_S
    print(f"{attack}: alice {under_s:.3f} s under attack, control {baseline_s:.3f} s, bound {bound:.3f} s")
    assert under_s <= bound, f"{attack}: alice took {under_s:.3f} s, over {bound:.3f} s"


@pytest.mark.parametrize("spec", [{"grammar": WIDE}, {"json": RECURSIVE}, {"json": SELF_ONLY}],
                         ids=["wide", "recursive", "self_only"])
async def test_a_grammar_that_breaks_the_matcher_is_a_400_naming_the_field(stack, model, spec):
    bob = api(stack, "bob")
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        await bob.completions.create(model=model, prompt="x", max_tokens=16,
                                     extra_body={"structured_outputs": spec, "timeout_s": 60})
    assert refused.value.body["param"] == "structured_outputs" and refused.value.body["code"] == "invalid_field"
    assert "grammar fails after" in refused.value.body["message"]
    assert time.monotonic() - started < 30.0, "refused at admission, not at its deadline"


async def test_a_grammar_that_breaks_later_fails_its_own_request_only(stack, model, baseline_s):
    """LATE passes admission's probe and breaks the matcher after 24 tokens: bob's request fails
    with the field named, at once rather than at its deadline; alice is served meanwhile, and the
    verifier logs the failure once per batch, with no traceback."""
    bob, alice = api(stack, "bob"), api(stack, "alice")
    started = time.monotonic()
    attacks = [asyncio.create_task(bob.completions.create(
        model=model, prompt="x", max_tokens=64, temperature=0.0,
        extra_body={"structured_outputs": {"grammar": LATE}, "timeout_s": 30})) for _ in range(4)]
    under_s = await control_s(alice, model)
    results = await asyncio.gather(*attacks, return_exceptions=True)
    failed_s = time.monotonic() - started
    for result in results:
        assert isinstance(result, openai.APIStatusError), result
        assert result.body["param"] == "structured_outputs" and result.body["code"] == "invalid_field", result.body
    assert failed_s < 20.0, f"bob's requests ended after {failed_s:.1f} s: at their deadline, not their failure"
    check_bound(under_s, baseline_s, "late grammar")
    log = (stack.log_dir / "verifier-0.log").read_text()
    assert "Traceback" not in log and log.count("verify_rows_failed") <= len(attacks)
    stats = await scheduler_stats(stack)
    assert not stats.get("verify_failures"), "no verify batch failed whole"


async def test_a_prefill_flood_does_not_hold_the_other_tenants_request(stack, model, baseline_s):
    """bob sends 16 prompts of 2000 token ids in one request (max_tokens 1); while they prefill,
    alice's short request starts at once and gets its fair share of every step. bob's request is
    then dropped (the gateway cancels what a client leaves): the test needs his flood only while
    alice's request runs."""
    bob, alice = api(stack, "bob"), api(stack, "alice")
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(FLOOD_LEN)] for i in range(FLOOD_PROMPTS)]
    started = time.monotonic()
    flood = asyncio.create_task(bob.completions.create(model=model, prompt=prompts, max_tokens=1, temperature=0.0))
    while (await scheduler_stats(stack)).get("running", 0) < 2 and time.monotonic() - started < WAIT_S:
        await asyncio.sleep(0.05)
    under_s = await control_s(alice, model)
    assert not flood.done(), "bob's flood ran all the while alice's request did"
    flood.cancel()
    await asyncio.gather(flood, return_exceptions=True)
    check_bound(under_s, baseline_s, "prefill flood")


async def test_prompt_logprobs_on_long_prompts_do_not_hold_the_other_tenants_request(stack, model, baseline_s):
    """bob asks top-20 prompt logprobs of 3 prompts of 1000 token ids (63,000 values, within the
    cap): while alice's request runs beside them, his chunks carry at most a fair share of each
    step's side-channel bytes (services/scheduler/step_planner.py), so she stays within her bound."""
    bob, alice = api(stack, "bob"), api(stack, "alice")
    prompts = [[(11 * i + j) % 4000 + 10 for j in range(1000)] for i in range(3)]
    started = time.monotonic()
    heavy = asyncio.create_task(bob.completions.create(model=model, prompt=prompts, max_tokens=1, temperature=0.0,
                                                       extra_body={"prompt_logprobs": 20}))
    while (await scheduler_stats(stack)).get("running", 0) < 2 and time.monotonic() - started < WAIT_S:
        await asyncio.sleep(0.05)
    under_s = await control_s(alice, model)
    done = await heavy
    assert [len(choice.model_extra["prompt_logprobs"]) for choice in done.choices] == [1000] * 3
    check_bound(under_s, baseline_s, "prompt logprobs")


async def test_a_response_past_its_prompt_logprob_values_is_a_400(stack, model):
    bob = api(stack, "bob")
    prompts = [[10 + i] * FLOOD_LEN for i in range(FLOOD_PROMPTS)]
    with pytest.raises(openai.BadRequestError) as refused:
        await bob.completions.create(model=model, prompt=prompts, max_tokens=1, echo=True, logprobs=20,
                                     extra_body={"prompt_logprobs": 20})
    assert refused.value.body["param"] == "prompt_logprobs"


async def test_timeout_s_zero_is_a_400(stack, model):
    with pytest.raises(openai.BadRequestError) as refused:
        await api(stack, "bob").completions.create(model=model, prompt="x", max_tokens=1,
                                                   extra_body={"timeout_s": 0})
    assert refused.value.body["param"] == "timeout_s"


async def test_what_answers_without_a_key_shows_no_tenant(stack, model):
    """/health, /metrics and the OpenAPI docs answer without a key, by design (the load
    balancer's probe and the Prometheus scrape hold no tenant key); they carry aggregate counts
    and the API's shape only: no prompt, user name or key of anybody."""
    secret = "zebra-canary-7731"
    await api(stack, "alice").completions.create(model=model, prompt=secret, max_tokens=2)
    root = stack.openai_base_url.removesuffix("/v1")
    for path in ("/health", "/metrics", "/openapi.json", "/docs", "/redoc"):
        with urllib.request.urlopen(root + path, timeout=30) as response:
            body = response.read().decode()
        assert response.status == 200, path
        for private in (secret, "alice", "bob", stack.api_key("alice"), stack.api_key("bob")):
            assert private not in body, (path, private)


async def test_every_service_that_follows_grammars_warmed_them_before_it_served(stack):
    """The first structured-output request pays no warm-up: the scheduler, the verifier and the
    drafter compiled a grammar at start."""
    for instance_id in ("scheduler-0", "verifier-0", "drafter-0"):
        assert "grammars_warmed" in (stack.log_dir / f"{instance_id}.log").read_text(), instance_id
