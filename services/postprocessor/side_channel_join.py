"""The side-channel join (docs/PROTOCOL.md#side-channel-join): which SideChannelRecord a Commit
gets, by (request_id, batch_id).

`EarlyRecords` holds the records of requests that have no commit here yet: MAX_EARLY_RECORDS
in all (the oldest is evicted), each until `expire` finds it older than the TTL.
`RequestRecords` holds one request's records until the commit with their batch_id settles
them: at most MAX_RECORDS_PER_REQUEST waiting, the prompt-logprob records the first chunk
collects, and the batches already joined or timed out (a record for one of those is late or a
duplicate). `record_fits` says whether a joined record covers its commit.

Neither counts nor logs: each operation returns the records it drops as `DroppedRecord`s (the
Counters field they count in and the log event), and the postprocessor counts them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from schemas.commits import Commit, SideChannelRecord
from schemas.generation import LogprobOptions
from services.postprocessor.logprob_format import wants_token_logprobs

MAX_RECORDS_PER_REQUEST = 64  # records waiting for their commit; more means a broken sender
MAX_EARLY_RECORDS = 4096  # records for requests whose first commit has not come yet

Arrival = tuple[SideChannelRecord, float]  # a record and when it arrived (time.monotonic())


@dataclass
class DroppedRecord:
    """A record the join cannot use: `counter` is the postprocessor's Counters field it counts
    in; `event` the log event (None: `<counter, singular>_dropped`)."""

    record: SideChannelRecord
    counter: str
    event: str | None = None


class EarlyRecords:
    """Records whose request has had no commit here yet, by request id and batch id."""

    def __init__(self, limit: int = MAX_EARLY_RECORDS):
        self.limit = limit
        self.by_request: dict[str, dict[int, Arrival]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, record: SideChannelRecord, now: float) -> list[DroppedRecord]:
        """Buffer a record; a second one for the same batch is a duplicate, and past `limit` the
        oldest record of any request makes room."""
        waiting = self.by_request.setdefault(record.request_id, {})
        if record.batch_id in waiting:
            return [DroppedRecord(record, "duplicate_records")]
        dropped = []
        if self.count >= self.limit:
            request_id, batch_id, (oldest, _) = min(
                ((rid, bid, entry) for rid, by_batch in self.by_request.items() for bid, entry in by_batch.items()),
                key=lambda item: item[2][1])
            self._forget(request_id, batch_id)
            dropped.append(DroppedRecord(oldest, "unjoined_records", "early_record_evicted"))
            waiting = self.by_request.setdefault(record.request_id, {})
        waiting[record.batch_id] = (record, now)
        self.count += 1
        return dropped

    def take(self, request_id: str) -> list[Arrival]:
        """Every record buffered for request_id (its first commit came), removed from here."""
        waiting = self.by_request.pop(request_id, {})
        self.count -= len(waiting)
        return list(waiting.values())

    def expire(self, now: float, ttl_s: float) -> list[DroppedRecord]:
        """Drop the records that arrived more than ttl_s before now."""
        dropped = []
        for request_id in list(self.by_request):
            for batch_id, (record, arrived) in list(self.by_request[request_id].items()):
                if now - arrived > ttl_s:
                    self._forget(request_id, batch_id)
                    dropped.append(DroppedRecord(record, "unjoined_records", "early_record_expired"))
        return dropped

    def _forget(self, request_id: str, batch_id: int) -> None:
        del self.by_request[request_id][batch_id]
        self.count -= 1
        if not self.by_request[request_id]:
            del self.by_request[request_id]


@dataclass
class RequestRecords:
    """One request's side of the join. `waiting`: records by batch_id, not claimed yet;
    `prompt`: records with prompt logprobs, kept for the first chunk; `joined` / `timed_out`:
    batches whose chunk went out with / without its record."""

    waiting: dict[int, Arrival] = field(default_factory=dict)
    prompt: list[SideChannelRecord] = field(default_factory=list)
    joined: set[int] = field(default_factory=set)
    timed_out: set[int] = field(default_factory=set)

    def stray_kind(self, batch_id: int, last_batch_id: int | None) -> str | None:
        """Why a record for this batch can no longer be used, as a Counters field (None: it can).
        last_batch_id: the batch of the last commit processed."""
        if batch_id in self.joined:
            return "duplicate_records"
        if batch_id in self.timed_out or (last_batch_id is not None and batch_id <= last_batch_id):
            return "late_records"  # its chunk (or the first chunk, for prompt logprobs) is out
        return None

    def add(self, record: SideChannelRecord, arrived: float, *, last_batch_id: int | None,
            first_chunk_sent: bool) -> list[DroppedRecord]:
        """Keep a record for its commit (and, before the first chunk, for the prompt logprobs);
        past MAX_RECORDS_PER_REQUEST the one of the earliest batch makes room."""
        batch_id = record.batch_id
        stray = "duplicate_records" if batch_id in self.waiting else self.stray_kind(batch_id, last_batch_id)
        if stray is not None:
            return [DroppedRecord(record, stray)]
        dropped = []
        if len(self.waiting) >= MAX_RECORDS_PER_REQUEST:
            dropped.append(DroppedRecord(self.waiting.pop(min(self.waiting))[0], "unjoined_records", "record_evicted"))
        if record.prompt_logprobs is not None and not first_chunk_sent:
            self.prompt.append(record)
        self.waiting[batch_id] = (record, arrived)
        return dropped

    def prompt_covered(self, commit: Commit, options: LogprobOptions) -> bool:
        """The first commit of a request whose options ask prompt logprobs waits until records
        cover every prompt position after the first; any other commit is never held for them."""
        if commit.seq != 0 or options.prompt_logprobs is None or commit.prompt_token_ids is None:
            return True
        covered = set()
        for record in self.prompt:
            covered.update(range(record.prompt_offset, record.prompt_offset + record.prompt_logprobs.n))
        return covered.issuperset(range(1, len(commit.prompt_token_ids)))

    def settle(self, commit: Commit, record: SideChannelRecord | None) -> list[DroppedRecord]:
        """Mark this commit's batch joined (record given) or timed out, and drop records of
        earlier batches: no later commit can claim them (batch ids increase with the steps of a
        request)."""
        dropped = []
        if record is not None:
            self.joined.add(commit.batch_id)
        elif commit.expect_side_channel:
            self.timed_out.add(commit.batch_id)
        unused = self.waiting.pop(commit.batch_id, None)
        if record is None and unused is not None:  # the commit expects none (e.g. a replayed commit)
            dropped.append(DroppedRecord(unused[0], "unjoined_records", "record_not_expected"))
        for batch_id in [b for b in self.waiting if b < commit.batch_id]:
            stale, _ = self.waiting.pop(batch_id)
            if len(stale.token_ids):
                dropped.append(DroppedRecord(stale, "unjoined_records", "stale_record"))
            else:  # a prefill chunk's record: its prompt logprobs were collected already
                self.joined.add(batch_id)
        return dropped

    def clear(self) -> list[DroppedRecord]:
        """The request ended: forget every record; those with tokens were never joined."""
        dropped = [DroppedRecord(record, "unjoined_records", "record_never_joined")
                   for record, _ in self.waiting.values() if len(record.token_ids)]
        self.waiting.clear()
        self.prompt.clear()
        return dropped


def record_fits(record: SideChannelRecord, commit: Commit) -> bool:
    """The record covers the commit's tokens (the same ids first) with every part it asked."""
    num_tokens = len(commit.token_ids)
    options = commit.logprobs
    return (len(record.token_ids) >= num_tokens
            and np.array_equal(record.token_ids[:num_tokens], commit.token_ids)
            and (not num_tokens or not wants_token_logprobs(options) or record.logprobs is not None)
            and (not num_tokens or not options.sampling_mask or record.masks is not None))
