"""What the scheduler's messages may hold under the bus's max_payload: the byte estimates its
batches and a request's first commit are sized by, and the one room formula every batch uses.

Every estimate is an upper bound, so a message kept within `PayloadRoom` is never refused by the
server: MESSAGE_OVERHEAD_BYTES covers what a message needs beyond the arrays counted (keys, ids,
numbers, options), ROW_OVERHEAD_BYTES the same per row, RELEASE_BYTES one released slot's
request id. A batch's request carries its rows and its releases; its answer carries the rows'
results only. Pure functions and one small class, no NATS.
"""

from dataclasses import dataclass

from schemas.generation import LogprobOptions, RowSampling
from schemas.bus.protocol import MAX_DRAFT_SUPPORT
from schemas.steps import VerifyRow

MESSAGE_OVERHEAD_BYTES = 4096
ROW_OVERHEAD_BYTES = 1024
RELEASE_BYTES = ROW_OVERHEAD_BYTES // 8
TOKEN_BYTES = 4  # one int32 token id
PROPOSAL_ENTRY_BYTES = 8  # one id and its probability of a sparse proposal
# one position's side record: its share of the record's overhead, its logprob, rank and logz
SIDE_POSITION_BYTES = ROW_OVERHEAD_BYTES // 8 + 12


@dataclass
class PayloadRoom:
    """Bytes left for rows in one batch's request and in its answer; None: unchecked (the
    server's max_payload is not known)."""

    request: int | None
    answer: int | None

    @classmethod
    def of(cls, max_payload: int | None, num_released: int = 0) -> "PayloadRoom":
        """The room of a batch that also releases num_released slots."""
        if max_payload is None:
            return cls(None, None)
        answer = max_payload - MESSAGE_OVERHEAD_BYTES
        return cls(answer - RELEASE_BYTES * num_released, answer)

    def fits(self, request: int = 0, answer: int = 0) -> bool:
        return (self.request is None or request <= self.request) and (self.answer is None or answer <= self.answer)

    def take(self, request: int, answer: int) -> None:
        if self.request is not None:
            self.request -= request
            self.answer -= answer


def draft_row_bytes(num_new: int, sampling: RowSampling) -> int:
    """An upper estimate of a DraftRow's encoded size, its target features left out."""
    return ROW_OVERHEAD_BYTES + TOKEN_BYTES * num_new + sum(a.nbytes for a in sampling.arrays())


def draft_answer_bytes(num_draft: int, sampled: bool, tree: bool = False) -> int:
    """An upper estimate of a DraftResult's encoded size with num_draft drafts, or nodes of a tree
    (each with its parent index); sampled (schemas.generation.draft_is_sampled): room for a sparse
    proposal (a Gumbel-coupled row's point mass needs less)."""
    per_draft = TOKEN_BYTES * (1 + tree) + PROPOSAL_ENTRY_BYTES * MAX_DRAFT_SUPPORT * sampled
    return ROW_OVERHEAD_BYTES + num_draft * per_draft


def verify_row_bytes(row: VerifyRow) -> int:
    """An upper estimate of a VerifyRow's encoded size: its arrays plus ROW_OVERHEAD_BYTES."""
    proposal = row.proposal
    arrays = (row.new_token_ids, row.draft_token_ids, row.parents, row.logprobs.logprob_token_ids, proposal.ids,
              proposal.probs, *row.sampling.arrays())
    return ROW_OVERHEAD_BYTES + sum(a.nbytes for a in arrays if a is not None)


def verify_answer_bytes(num_draft: int) -> int:
    """An upper estimate of a VerifyResult's encoded size, its target features left out: up to
    num_draft + 1 emitted tokens."""
    return ROW_OVERHEAD_BYTES + TOKEN_BYTES * (num_draft + 1)


def first_commit_bytes(encoded_commit: int, max_tokens: int, prompt_len: int, logprobs: LogprobOptions) -> int:
    """An upper estimate of a request's largest commit or side record: its first commit
    (encoded_commit bytes, prompt included) with room for a replay's whole completion, or the
    prompt logprobs per prompt position (logprob, rank, logz, top-n ids and values, the
    requested ids)."""
    return encoded_commit + TOKEN_BYTES * max_tokens + MESSAGE_OVERHEAD_BYTES + \
        prompt_len * side_position_bytes(logprobs, prompt=True)


def side_position_bytes(logprobs: LogprobOptions, prompt: bool) -> int:
    """An upper estimate of the side-channel bytes one position of a row adds: SIDE_POSITION_BYTES,
    the top-n ids and values, the requested ids' values and, at a completion position, its
    sampling mask; 0 for a prompt position without prompt_logprobs or a row without a side channel."""
    top_n = logprobs.prompt_logprobs if prompt else logprobs.logprobs
    reported = top_n is not None if prompt else logprobs.wants_side_channel
    if not reported:
        return 0
    mask = TOKEN_BYTES * logprobs.max_mask_size if logprobs.sampling_mask and not prompt else 0
    return SIDE_POSITION_BYTES + 8 * (top_n or 0) + TOKEN_BYTES * len(logprobs.logprob_token_ids) + mask
