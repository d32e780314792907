"""The receiver rule and the max_seq_len room of one row, as the drafter and the verifier both
judge it (docs/PROTOCOL.md#receiver-rule-and-resync).

A row says the receiver should hold cached_len committed tokens of its request before it appends
the row's num_new new tokens. A receiver holding fewer (or no slot for the request, holding 0)
cannot go on without guessing and answers need_resync; otherwise it truncates its slot to
cached_len and appends. The history is then cached_len + num_new tokens, and a slot holds at
most max_seq_len positions: what is left after the history is the room for drafts (the verifier
holds history + drafts, so a drafter offers no more than fit there).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ReceiverVerdict:
    """need_resync: the receiver holds fewer than cached_len committed tokens. room: the
    positions of max_seq_len left after the history (cached_len + num_new); negative when the
    history itself does not fit."""

    need_resync: bool
    room: int


def receiver_rule(held: int, cached_len: int, num_new: int, max_seq_len: int) -> ReceiverVerdict:
    """The verdict on a row expecting cached_len committed tokens and bringing num_new, at a
    receiver holding `held` committed tokens of the request (0 without a slot for it)."""
    return ReceiverVerdict(need_resync=cached_len > held, room=max_seq_len - cached_len - num_new)
