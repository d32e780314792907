"""Target features on the scheduler's side, for requests drafted by an eagle drafter
(docs/PROTOCOL.md#feature-level-drafts). No NATS, no torch: a FeatureBlock's data is bytes.
batch_builder.py calls these where it builds and applies draft and verify batches, commits.py
where a verified row brings features back.

A request (scheduler_types.Request) keeps `features_end`, the position after the features its
drafter holds or has on their way to it, and `feature_blocks`, the blocks received from the
verifier and not yet delivered (contiguous, ending at features_end):
- its verify rows ask features_from = features_end; a block that comes back
  starting there is kept (`receive`), any other is dropped (the drafter changed meanwhile);
- its draft row carries the pending blocks joined, as much of them as the message has room for
  (`take`); once the drafter answered the row, what it carried is dropped (`delivered`); a row
  that got no answer carries it again (the drafter skips what it already holds);
- a drafter that lost its pairs (need_resync), another drafter, or a new run (failover) starts
  over (Request.restart_drafter): nothing pending, features_end 0, so the next verify row asks
  features_from 0 and the verifier answers the whole history from its buffer.

Sizes: a step's features are the positions the step computes (at most max_step_tokens plus
the drafts), unless a row asks from far back (after a drafter resync). `answer_bytes` bounds a
row's share of the VerifyResponse; verify_batches defers the features of a row whose answer has
no room left to a later step, and a draft row carries what fits; the drafter proposes nothing
until it holds features up to the end of the history, so a large backlog costs steps without
drafts, never exactness.
"""

from schemas.bus.protocol import MAX_FEATURE_BLOCK_BYTES
from schemas.draft_kinds import reads_features
from schemas.steps import FeatureBlock
from services.scheduler.drafts.draft_method import method_of

BLOCK_OVERHEAD_BYTES = 64  # a FeatureBlock's keys, start, shape and dtype


def drafted_by_eagle(placement, request) -> bool:
    """Whether the request's drafter is a live one of a kind that reads the target's features (an
    eagle drafter: schemas/draft_kinds.py), which wants its features (a scoring request never
    drafts)."""
    instance = placement.registry.instances.get(request.drafter_id) if request.drafter_id else None
    return (instance is not None and placement.alive(request.drafter_id) and reads_features(method_of(instance.info))
            and not request.scoring)


def bytes_per_position(placement, verifier_id: str) -> int:
    """Bytes of one position's features from this verifier (bf16: 2 x its hidden size); a whole
    block's worth when its heartbeat does not say."""
    instance = placement.registry.instances.get(verifier_id)
    hidden = "" if instance is None else instance.info.model_ids.get("hidden_size", "")
    return 2 * int(hidden) if hidden.isdigit() and int(hidden) > 0 else MAX_FEATURE_BLOCK_BYTES


def answer_bytes(features_from: int, end: int, num_draft: int, per_position: int) -> int:
    """The most a verify row's features can take: positions features_from .. end + num_draft - 1
    (its tokens through end, and accepted drafts), at most one block."""
    positions = max(0, end + num_draft - features_from)
    return BLOCK_OVERHEAD_BYTES + min(positions * per_position, MAX_FEATURE_BLOCK_BYTES) if positions else 0


def width(block: FeatureBlock) -> int:
    return block.shape[1]


def cut(block: FeatureBlock, start: int, stop: int) -> FeatureBlock | None:
    """Positions [start, stop) of block (clipped to it); None when that is empty."""
    start, stop = max(start, block.start), min(stop, block.end)
    if stop <= start:
        return None
    row = 2 * width(block)
    data = block.data[(start - block.start) * row:(stop - block.start) * row]
    return FeatureBlock(start=start, shape=[stop - start, width(block)], data=data)


def join(blocks: list[FeatureBlock]) -> FeatureBlock | None:
    """Contiguous blocks of one width as one block; None for none. ValueError for a gap, an overlap
    or another width."""
    if not blocks:
        return None
    for before, after in zip(blocks, blocks[1:]):
        if after.start != before.end or width(after) != width(before):
            raise ValueError(f"feature blocks [{before.start}, {before.end}) x {width(before)} and "
                             f"[{after.start}, {after.end}) x {width(after)} do not join")
    if len(blocks) == 1:
        return blocks[0]
    return FeatureBlock(start=blocks[0].start, shape=[blocks[-1].end - blocks[0].start, width(blocks[0])],
                        data=b"".join(block.data for block in blocks))


def take(blocks: list[FeatureBlock], room: int) -> FeatureBlock | None:
    """The first positions of the pending blocks, joined, that fit in room bytes and in one block;
    None when none fits or none is pending."""
    if not blocks:
        return None
    per_position = 2 * width(blocks[0])
    count = (min(room, MAX_FEATURE_BLOCK_BYTES) - BLOCK_OVERHEAD_BYTES) // per_position
    start = blocks[0].start
    return join([piece for block in blocks if (piece := cut(block, start, start + count)) is not None])


def receive(request, block: FeatureBlock | None) -> bool:
    """Keep a block a verify row returned if it continues the request's features; False when it
    was dropped."""
    if block is None:
        return True
    if block.start != request.features_end or (request.feature_blocks and width(block) !=
                                                width(request.feature_blocks[0])):
        return False
    request.feature_blocks.append(block)
    request.features_end = block.end
    return True


def delivered(request, end: int) -> None:
    """The drafter answered a row that carried the pending features up to position end."""
    request.feature_blocks = [piece for block in request.feature_blocks
                              if (piece := cut(block, end, block.end)) is not None]

