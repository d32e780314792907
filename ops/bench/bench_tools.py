"""Tool calling on the default stack (SmolLM2-135M-Instruct and its draft), through the gateway
with the openai SDK and LangChain, batch 1, in this order:

1. A LangChain agent with two tools (get_weather, celsius_to_fahrenheit) on a two-step task: the
   loop binds the tools, names the tool each step needs (tool_choice), runs the calls the model
   makes, feeds the results back as ToolMessages, then asks for the answer (tool_choice none);
   done when both tools ran in order and the answer states the converted figure.
2. `--calls` chat requests over the ten tools of TOOLS (call i asks ASKS[i % 10]), tool_choice
   alternating required (all ten offered) and the named tool, each run greedy at k=0 and at k
   (tokens compared: identical?) and sampled (seed i) at k=0 and at k; every answer's calls must
   parse and validate (jsonschema) against the called tool's schema.
3. The overhead of tool calling at k=0 (grammar, rendering and parsing), `--overhead-pairs`
   times: a greedy required call (run twice, timed the second time, its prompt cached) against a
   plain completion of the same prompt text with as many tokens (/v1/completions, ignore_eos,
   cached too), back to back, neither with logprobs; the ratio of the summed times, and the
   median of the pairs' ratios (on a shared machine one pair caught by a burst of load moves
   the sum, not the median); and the same for the CPU time (user + system) the stack's
   processes spent on each request (requests run one at a time, so a process's CPU time between
   a request's start and end is that request's, heartbeats aside), which waiting for a core does
   not add to, though torch's threads spinning for a starved peer still do. The 1-minute load average is printed at the start and the end.

    PYTHONPATH=. .venv/bin/python ops/bench/bench_tools.py --calls 50 --out /tmp/tools.json

--target / --draft run it on another pair (e.g. a random pair with a chat template: a random
model is the grammar's hardest user, and fast); --no-agent skips step 1.
"""

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import jsonschema
import openai

from schemas.config import DEFAULT_DRAFT, default_target_model
from services.launch.stack import Stack, StackConfig


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


TEXT = {"type": "string", "maxLength": 40}
TOOLS_SPEC = [
    ("get_weather", "Current weather of a city", obj({"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    ("add_numbers", "Add two integers", obj({"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                              "b": {"type": "integer", "minimum": -1000, "maximum": 1000}})),
    ("search_web", "Search the web", obj({"query": TEXT, "max_results": {"type": "integer", "minimum": 1,
                                                                          "maximum": 10}})),
    ("send_email", "Send an email", obj({"to": TEXT, "subject": TEXT, "urgent": {"type": "boolean"}})),
    ("create_event", "Put an event in the calendar", obj({
        "title": TEXT, "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": TEXT, "maxItems": 3}})),
    ("convert_currency", "Convert an amount of money", obj({
        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        "from": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "to": {"enum": ["USD", "EUR", "GBP", "JPY"]}})),
    ("set_timer", "Start a timer", obj({"minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                                         "label": TEXT}, ["minutes"])),
    ("translate", "Translate a text", obj({"text": {"type": "string", "maxLength": 80},
                                           "target_language": {"enum": ["french", "spanish", "german"]}})),
    ("book_table", "Book a restaurant table", obj({
        "restaurant": TEXT, "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "options": obj({"outdoor": {"type": "boolean"}, "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})})),
    ("lookup_order", "Find an order by its number", obj({"order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}})),
]
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p in TOOLS_SPEC]
SCHEMAS = {n: p for n, _, p in TOOLS_SPEC}
ASKS = ["What's the weather like in Lisbon?", "What is 17 plus 25?", "Find recent news about solar panels.",
        "Email Bob that the meeting moved, it's urgent.", "Schedule a team lunch on March 3rd with Ann and Tom.",
        "How many euros is 250 dollars?", "Set a 15 minute timer for the pasta.",
        "Translate 'good morning' into Spanish.", "Book a table for four at Luigi's at 19:30, outside.",
        "Where is my order AB1234?"]


def validate(message) -> list[tuple[str, dict]]:
    """The message's calls, each parsed and validated against its tool's schema (raises if not)."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    if not calls:
        raise ValueError(f"no tool call in {message.content!r}")
    return calls


async def call(api, i: int, k: int, sampled: bool, logprobs: bool = True) -> dict:
    """Call i (module docstring, step 2) at k; logprobs: the tokens, to compare runs."""
    name = TOOLS_SPEC[i % 10][0]
    choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": name}}
    started = time.perf_counter()
    reply = await api.chat.completions.create(
        model="", messages=[{"role": "user", "content": ASKS[i % 10]}], tools=TOOLS, tool_choice=choice,
        parallel_tool_calls=False, temperature=0.8 if sampled else 0, seed=i, max_tokens=120, logprobs=logprobs,
        extra_body={"num_speculative_tokens": k})
    seconds = time.perf_counter() - started
    try:
        calls, error = validate(reply.choices[0].message), None
    except (ValueError, jsonschema.ValidationError) as exc:
        calls, error = None, str(exc)[:200]
    tokens = [t.token for t in reply.choices[0].logprobs.content] if logprobs else None
    return {"calls": calls, "error": error, "tokens": tokens,
            "completion_tokens": reply.usage.completion_tokens, "seconds": seconds,
            "finish_reason": reply.choices[0].finish_reason}


def stack_cpu_s(stack) -> float:
    """CPU seconds (user + system) the stack's processes have used so far (Linux /proc)."""
    ticks = 0
    for service in stack.processes.values():
        fields = Path(f"/proc/{service.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (stat's fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


async def plain(api, prompt: str, tokens: int) -> float:
    started = time.perf_counter()
    await api.completions.create(model="", prompt=prompt, max_tokens=tokens, temperature=0,
                                 extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
    return time.perf_counter() - started


def rendered_prompt(target: Path, i: int) -> str:
    """The prompt text the gateway sends for call i (services/gateway/tools.py chat_input)."""
    from services.gateway.request_bodies import ChatBody
    from services.gateway.tools import chat_input
    from text.tokenizer import load_tokenizer
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": ASKS[i % 10]}], "tools": TOOLS,
                                    "tool_choice": "required"})
    return chat_input(body, load_tokenizer(target))["prompt"]


async def agent(stack) -> dict:
    """The two-step LangChain task (module docstring, step 1); what each step did, and the answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):  # bounded, so a call always ends within max_tokens
        city: str = Field(max_length=30)

    class Celsius(BaseModel):
        celsius: int = Field(ge=-100, le=100)

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The current temperature of a city, in degrees Celsius."""
        return json.dumps({"city": city, "celsius": 21})

    @tool(args_schema=Celsius)
    def celsius_to_fahrenheit(celsius: int) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        return json.dumps({"fahrenheit": round(celsius * 9 / 5 + 32, 1)})

    tools = {t.name: t for t in (get_weather, celsius_to_fahrenheit)}
    chat = ChatOpenAI(model="", base_url=stack.openai_base_url, api_key=stack.api_key(), temperature=0,
                      max_tokens=60, max_retries=0)
    history = [HumanMessage("What is the temperature in Paris right now, in Fahrenheit? "
                            "Get the weather, then convert it.")]
    steps = []
    for name in ("get_weather", "celsius_to_fahrenheit"):
        message = await chat.bind_tools(list(tools.values()), tool_choice=name, strict=True).ainvoke(history)
        history.append(message)
        for tool_call in message.tool_calls:
            result = tools[tool_call["name"]].invoke(tool_call["args"])
            steps.append({"call": tool_call["name"], "args": tool_call["args"], "result": result})
            history.append(ToolMessage(result, tool_call_id=tool_call["id"]))
    history.append(HumanMessage("Now answer my question in one sentence."))
    answer = await chat.bind_tools(list(tools.values()), tool_choice="none").ainvoke(history)
    fahrenheit = json.loads(steps[-1]["result"])["fahrenheit"] if steps else None
    return {"steps": steps, "answer": answer.content,
            "completed": [s["call"] for s in steps] == ["get_weather", "celsius_to_fahrenheit"]
            and str(fahrenheit) in answer.content and "<tool_call>" not in answer.content}


async def bench(args: argparse.Namespace) -> dict:
    load_start = os.getloadavg()[0]
    config = StackConfig(target_model=str(args.target), draft_model=str(args.draft), gateways=1)
    async with Stack(config) as stack:
        api = openai.AsyncOpenAI(base_url=stack.openai_base_url, api_key=stack.api_key(), max_retries=0, timeout=600)
        agent_run = await agent(stack) if args.agent else None
        print(f"agent: {json.dumps(agent_run)}", flush=True)
        runs = {"greedy": [], "sampled": []}
        overhead = []
        for i in range(args.calls):
            for mode in ("greedy", "sampled"):
                at0 = await call(api, i, 0, mode == "sampled")
                atk = await call(api, i, args.k, mode == "sampled")
                runs[mode].append({"k0": at0, "k": atk, "same": at0["tokens"] == atk["tokens"]})
                print(f"call {i} {mode}: valid {at0['error'] is None}/{atk['error'] is None}, "
                      f"k=k0 {runs[mode][-1]['same']}", flush=True)
        for i in range(0, 2 * args.overhead_pairs, 2):  # required calls; the first run caches the prompt
            await call(api, i, 0, False, logprobs=False)
            cpu = stack_cpu_s(stack)
            again = await call(api, i, 0, False, logprobs=False)  # as the plain one: no logprobs
            tool_cpu, cpu = stack_cpu_s(stack) - cpu, stack_cpu_s(stack)
            plain_s = await plain(api, rendered_prompt(args.target, i), again["completion_tokens"])
            overhead.append({"tool_s": again["seconds"], "plain_s": plain_s, "tokens": again["completion_tokens"],
                             "tool_cpu_s": tool_cpu, "plain_cpu_s": stack_cpu_s(stack) - cpu,
                             "load_1min": os.getloadavg()[0]})
            print(f"overhead pair {i}: {overhead[-1]}", flush=True)
    summary = {mode: {"calls": 2 * len(r), "valid": sum((x["k0"]["error"] is None) + (x["k"]["error"] is None) for x in r),
                      "k_equals_k0": sum(x["same"] for x in r), "pairs": len(r)} for mode, r in runs.items()}
    tool_total, plain_total = sum(o["tool_s"] for o in overhead), sum(o["plain_s"] for o in overhead)
    ratios = [o["tool_s"] / o["plain_s"] for o in overhead]
    summary["overhead_k0"] = {"requests": len(overhead), "tool_s": tool_total, "plain_s": plain_total,
                              "ratio": tool_total / plain_total if plain_total else None,
                              "median_pair_ratio": statistics.median(ratios) if ratios else None}
    tool_cpu, plain_cpu = sum(o["tool_cpu_s"] for o in overhead), sum(o["plain_cpu_s"] for o in overhead)
    summary["overhead_k0_cpu"] = {"tool_cpu_s": tool_cpu, "plain_cpu_s": plain_cpu,
                                  "ratio": tool_cpu / plain_cpu if plain_cpu else None,
                                  "median_pair_ratio": statistics.median(o["tool_cpu_s"] / o["plain_cpu_s"]
                                                                         for o in overhead) if overhead else None}
    summary["load_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    summary["agent"] = agent_run
    return {"summary": summary, "runs": runs, "overhead": overhead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--overhead-pairs", type=int, default=25, help="tool / plain pairs of step 3")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--target", type=Path, default=Path(default_target_model()))
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    parser.add_argument("--agent", action=argparse.BooleanOptionalAction, default=True,
                        help="run the LangChain agent task too (it needs a model that answers sensibly)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    print(json.dumps(result["summary"], indent=2))
    for mode in ("greedy", "sampled"):
        for i, run in enumerate(result["runs"][mode]):
            for key in ("k0", "k"):
                if run[key]["error"]:
                    print(f"{mode} call {i} {key}: {run[key]['error']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
