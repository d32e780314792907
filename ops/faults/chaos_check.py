"""The history of a chaos run (ops/faults/chaos.py) and the checker that judges it, Jepsen's way: the
workload records what every request's client saw, the nemesis records when each fault began
and was healed, and `check` reads only those records. No NATS, no processes: a pure function.

A request's Record: the spec it ran (an index into the workload), how it was sent (the specbus
client or the gateway's HTTP API), each chunk as it arrived, the error that ended it if one did,
and the HTTP status of a gateway request. A fault's FaultEvent: its name, the victims, when it
began and when it was healed (time.monotonic()).

The rules `check` holds the code to (docs/PROTOCOL.md#guarantees-under-faults):
- every request admitted ends: whole and byte-identical to the fault-free run of its spec
  (token ids, text, finish reason, chosen-token logprobs), or with a typed error (a code from
  schemas/errors.py) that says why; nothing is left without an end (`missing`);
- nothing duplicated: the chunks a caller reads are numbered 0, 1, 2, ... without a repeat or a
  gap, and a request taken over by another scheduler carries on where it was (its tokens equal
  the reference, so no step was served twice into its stream);
- no 5xx from the gateway for a request it admitted (an HTTP status it answered with, or an
  error event in its stream, of a server kind);
- a request refused before any chunk (`refused`: no scheduler listened, or queues full) was
  not admitted: counted, allowed;
- logprobs equal the fault-free run's, except that a chunk flagged `logprobs_timeout` may come
  without them (its side-channel record was held up: `identical-without-some-logprobs`);
- typed errors of admitted requests are reported apart: the goal is none, and
  `check(..., allow_errors=False)` fails on any.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

# What a request meets when it is not admitted: no scheduler listens (every one is dead or cut
# off), or the schedulers' queues are full. Typed, before any chunk: the caller may send again.
REFUSALS = ("unavailable", "overloaded")


@dataclass
class Record:
    """One request as its caller saw it (module docstring). chunks: (arrival, seq, tokens) each."""

    spec: int
    request_id: str
    via: str  # "client" | "gateway"
    started: float
    chunks: list[tuple[float, int, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)  # per token; None: the chunk came without
    finish_reason: str | None = None
    degraded: list[str] = field(default_factory=list)
    error_code: str | None = None  # a schemas.errors.ErrorCode value, or "untyped" for anything else
    error: str | None = None
    http_status: int | None = None
    ended: float | None = None

    def outcome_of(self) -> tuple:
        """What two runs of one spec must agree on, logprobs apart (`same_logprobs`)."""
        return self.token_ids, self.text, self.finish_reason

    def refused(self) -> bool:
        """Ended with an error before any chunk: not admitted (no scheduler to take it, or full)."""
        return not self.chunks and (self.error_code in REFUSALS or self.http_status in (429, 503))


@dataclass
class FaultEvent:
    name: str
    victims: list[str]
    began: float
    healed: float | None = None


@dataclass
class Verdict:
    counts: Counter
    problems: list[str]
    recoveries: list[dict]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> dict:
        return {"ok": self.ok, "counts": dict(self.counts), "problems": self.problems[:20],
                "recoveries": self.recoveries}


def same_logprobs(record: Record, reference: Record) -> bool | None:
    """True: equal; None: equal but for tokens whose chunk came without them, flagged
    `logprobs_timeout` (docs/PROTOCOL.md#guarantees-under-faults); False: different."""
    if len(record.logprobs) != len(reference.logprobs):
        return False
    if record.logprobs == reference.logprobs:
        return True
    present = all(got is None or got == want for got, want in zip(record.logprobs, reference.logprobs))
    return None if present and "logprobs_timeout" in record.degraded else False


def judge(record: Record, reference: Record | None) -> str:
    """One request's outcome: identical, identical-failover, identical-without-some-logprobs,
    refused (not admitted), error:<code>, changed, gapped, missing, 5xx."""
    if record.refused():
        return "refused"
    if record.http_status is not None and record.http_status >= 500:
        return "5xx"
    if record.ended is None:
        return "missing"
    seqs = [seq for _, seq, _ in record.chunks]
    if seqs != list(range(len(seqs))):
        return "gapped"
    if record.error_code is not None:
        return f"error:{record.error_code}"
    if reference is None or record.outcome_of() != reference.outcome_of():
        return "changed"
    logprobs = same_logprobs(record, reference)
    if logprobs is False:
        return "changed"
    if logprobs is None:
        return "identical-without-some-logprobs"
    return "identical-failover" if "failover" in record.degraded else "identical"


def recovery(fault: FaultEvent, records: list[Record]) -> dict:
    """How the streams in flight when the fault began came back: for each, the wait from the
    heal (for a kill: the fault itself) to its first chunk after it; `recover_s` is the longest,
    `first_token_s` the shortest wait from the fault's start to any chunk at all."""
    healed = fault.healed if fault.healed is not None else fault.began
    waits, after_fault = [], []
    for record in records:
        if record.started > fault.began or (record.ended is not None and record.ended < healed):
            continue
        later = [at for at, _, _ in record.chunks if at > healed]
        if later:
            waits.append(later[0] - healed)
        after = [at for at, _, _ in record.chunks if at > fault.began]
        if after:
            after_fault.append(after[0] - fault.began)
    return {"fault": fault.name, "victims": fault.victims, "held_s": round(healed - fault.began, 2),
            "in_flight": len(waits), "recover_s": round(max(waits), 2) if waits else None,
            "recover_median_s": round(statistics.median(waits), 2) if waits else None,
            "first_token_s": round(min(after_fault), 2) if after_fault else None}


def check(records: list[Record], references: dict[int, Record], faults: list[FaultEvent], *,
          allow_errors: bool = False) -> Verdict:
    """The verdict over a run (module docstring). references: spec -> its fault-free record."""
    counts, problems = Counter(), []
    for record in records:
        outcome = judge(record, references.get(record.spec))
        counts[outcome] += 1
        bad = outcome in ("changed", "gapped", "missing", "5xx") or (
            outcome.startswith("error:") and (not allow_errors or record.error_code == "untyped"))
        if bad:
            problems.append(f"{record.request_id} (spec {record.spec}, {record.via}): {outcome}"
                            + (f" {record.error}" if record.error else ""))
    return Verdict(counts, problems, [recovery(fault, records) for fault in faults])


def write_history(path: Path, records: list[Record], faults: list[FaultEvent], references: dict[int, Record]) -> None:
    """One JSON object a line: {"reference": ...} (each spec's fault-free run) first, then
    {"fault": ...} and {"request": ...} in time order."""
    lines = [(f.began, {"fault": asdict(f)}) for f in faults] + [(r.started, {"request": asdict(r)}) for r in records]
    lines = [(0.0, {"reference": asdict(r)}) for r in references.values()] + lines
    path.write_text("".join(json.dumps(entry) + "\n" for _, entry in sorted(lines, key=lambda line: line[0])))


def read_history(path: Path) -> tuple[list[Record], list[FaultEvent], dict[int, Record]]:
    """(requests, faults, references) of a history write_history wrote."""
    records, faults, references = [], [], {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "fault" in entry:
            faults.append(FaultEvent(**entry["fault"]))
            continue
        raw = entry.get("request") or entry["reference"]
        record = Record(**{**raw, "chunks": [tuple(c) for c in raw["chunks"]]})
        if "reference" in entry:
            references[record.spec] = record
        else:
            records.append(record)
    return records, faults, references
