"""Suffix decoding's index: every request's prompt and output, per tenant, and the drafts that
continue the longest earlier match of a request's history. Pure Python, no torch, no clocks: the
scheduler holds it (services/scheduler/drafts/suffix_choice.py decides when its drafts are used).

The idea is suffix decoding (Oliaro et al., 2024, "SuffixDecoding"; Snowflake's ArcticInference
`method: "suffix"`): a request's next tokens often repeat what followed the same context before,
in its own prompt (prompt lookup) or in earlier requests of the same kind (a template, a tool
call, code). This is its own code, over n-gram occurrence lists rather than a suffix tree.

- `SuffixIndex`: one tenant's sequences (token lists, least recently used first) and, for each
  n-gram of KEY_LENGTHS ending at a position, the positions it ended at (packed seq id, end).
  Bounded by max_tokens tokens: a sequence extended past the budget evicts the least recently
  used others; one sequence alone is never indexed past the budget. An evicted sequence's
  occurrences are dropped lazily (skipped when read) and compacted away once they outnumber the
  live ones, so the occurrence lists stay within twice the budget's entries.
- `propose`: the longest match. The history's last n tokens for n in KEY_LENGTHS, longest first,
  until one occurred before with a continuation; its RECENT_OCCURRENCES most recent occurrences
  are extended backwards (up to MAX_MATCH tokens) and those of the longest match kept. Then a
  chain: at each depth the continuation most of them agree on (a tie: the most recent), its
  probability the fraction that agree times the parent's (the chance every draft so far is
  accepted, if the future follows the past's frequencies), stopped under min_prob. The request's
  own earlier occurrence reads on into the drafts already proposed (a repeating period).
  `propose_tree`: the best nodes by that probability, as a tree of several continuations.
- `SuffixPools`: an index per tenant (the client user a request streams to), or one shared by
  all with `shared`; each request's history synced into its tenant's index as it grows.

Why per tenant by default: a draft drawn from another tenant's requests would make this
tenant's tokens come faster when the other sent the same text, which tells it what the other
sent (the prefix cache keeps salts per user for the same reason, prefix_hints.py). One tenant's
traffic never changes another's drafts: separate indexes, separate budgets.
"""

import heapq
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

KEY_LENGTHS = (8, 4, 2, 1)  # n-grams indexed per position, longest first
MAX_MATCH = 32  # a match is extended backwards this far at most
RECENT_OCCURRENCES = 64  # occurrences of the matched n-gram looked at, most recent first
POSITION_BITS = 32  # an occurrence: seq id << POSITION_BITS | end position
POSITION_MASK = (1 << POSITION_BITS) - 1


@dataclass
class SuffixProposal:
    """Drafts and their estimated chance of acceptance. probs[i]: that node i and every node on
    its path are accepted (a chain's: drafts 0..i); the expected accepted drafts of the whole
    proposal are their sum. parents: None for a chain, else docs/PROTOCOL.md#tree-drafts's."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    parents: list[int] | None = None


class SuffixIndex:
    """One tenant's sequences and n-gram occurrences within max_tokens tokens (module docstring)."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.occurrences: dict[tuple[int, ...], list[int]] = {}
        self.num_tokens = 0
        self.num_entries = 0  # occurrence entries, live or of evicted sequences
        self.dead_entries = 0
        self.next_id = 0
        self.evicted = 0  # sequences evicted, ever

    def add(self) -> int:
        """A new empty sequence; its id."""
        sid = self.next_id
        self.next_id += 1
        self.sequences[sid] = []
        return sid

    def alive(self, sid: int) -> bool:
        return sid in self.sequences

    def extend(self, sid: int, tokens: list[int]) -> int:
        """Append tokens to a live sequence and index them (no further than max_tokens for one
        sequence), then evict the least recently used others while over the budget; the tokens
        indexed."""
        seq = self.sequences[sid]
        self.sequences.move_to_end(sid)
        tokens = tokens[:max(self.max_tokens - len(seq), 0)]
        for token in tokens:
            seq.append(token)
            end = len(seq)
            for n in KEY_LENGTHS:
                if end >= n:
                    self.occurrences.setdefault(tuple(seq[end - n:end]), []).append(sid << POSITION_BITS | end)
                    self.num_entries += 1
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self.evict(next(iter(self.sequences)))
        return len(tokens)

    def evict(self, sid: int) -> None:
        """Drop a sequence; its occurrences are skipped from now on and compacted away later."""
        seq = self.sequences.pop(sid)
        self.num_tokens -= len(seq)
        self.dead_entries += sum(max(len(seq) - n + 1, 0) for n in KEY_LENGTHS)
        self.evicted += 1
        if self.dead_entries > self.num_entries - self.dead_entries:
            self.compact()

    def compact(self) -> None:
        """Remove every occurrence of an evicted sequence, and n-grams left with none."""
        live = self.sequences
        for key in list(self.occurrences):
            kept = [o for o in self.occurrences[key] if o >> POSITION_BITS in live]
            if kept:
                self.occurrences[key] = kept
            else:
                del self.occurrences[key]
        self.num_entries = sum(len(entries) for entries in self.occurrences.values())
        self.dead_entries = 0

    def match(self, context: list[int]) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest earlier match of context's suffix (module docstring): its length and its
        occurrences as (sequence, the position after the match), most recent first."""
        for n in KEY_LENGTHS:
            if len(context) < n:
                continue
            entries = self.occurrences.get(tuple(context[-n:]))
            found: list[tuple[int, list[int], int]] = []
            for entry in reversed(entries or ()):
                seq, end = self.sequences.get(entry >> POSITION_BITS), entry & POSITION_MASK
                if seq is None or end >= len(seq):
                    continue  # evicted, or nothing follows it (the context itself)
                length = n
                while length < MAX_MATCH and length < end and length < len(context) and \
                        seq[end - length - 1] == context[-length - 1]:
                    length += 1
                found.append((length, seq, end))
                if len(found) == RECENT_OCCURRENCES:
                    break
            if found:
                longest = max(length for length, _, _ in found)
                return longest, [(seq, end) for length, seq, end in found if length == longest]
        return 0, []

    def propose(self, context: list[int], max_drafts: int, min_prob: float, own: int | None = None) -> SuffixProposal:
        """A chain of up to max_drafts drafts continuing context's longest match (module
        docstring); own: context's sequence id, whose continuation reads on into the drafts."""
        if max_drafts <= 0:
            return SuffixProposal()
        match_len, found = self.match(context)
        own_seq = self.sequences.get(own) if own is not None else None
        if own_seq is not None and len(own_seq) != len(context):
            own_seq = None  # capped at the budget: it is not the context
        proposal = SuffixProposal(match_len=match_len)
        prob = 1.0
        while found and len(proposal.token_ids) < max_drafts:
            nexts = [(seq, pos, at(seq, pos, own_seq, proposal.token_ids)) for seq, pos in found]
            counts = Counter(token for _, _, token in nexts if token is not None)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            prob *= count / sum(counts.values())
            if prob < min_prob:
                break
            proposal.token_ids.append(token)
            proposal.probs.append(prob)
            found = [(seq, pos + 1) for seq, pos, t in nexts if t == token]
        return proposal

    def propose_tree(self, context: list[int], max_nodes: int, max_depth: int, min_prob: float) -> SuffixProposal:
        """A tree of up to max_nodes drafts no deeper than max_depth: the nodes of highest
        probability (module docstring), taken best first (a child never beats its parent), laid
        out in depth-first preorder."""
        match_len, found = self.match(context)
        nodes: list[tuple[int, int, float]] = []  # (token, parent node or -1, prob) in the order taken
        heap: list[tuple] = []  # (-prob, order pushed, token, parent node, depth, occurrences after it)
        pushed = itertools.count()  # ties: the earlier pushed (the more recent continuation) first

        def expand(node: int, prob: float, depth: int, occurrences: list[tuple[list[int], int]]) -> None:
            if depth >= max_depth:
                return
            groups: dict[int, list[tuple[list[int], int]]] = {}
            for seq, pos in occurrences:
                if pos < len(seq):
                    groups.setdefault(seq[pos], []).append((seq, pos + 1))
            total = sum(len(group) for group in groups.values())
            for token, group in groups.items():
                if prob * len(group) / total >= min_prob:
                    heapq.heappush(heap, (-prob * len(group) / total, next(pushed), token,
                                          node, depth + 1, group))

        expand(-1, 1.0, 0, found)
        while heap and len(nodes) < max_nodes:
            neg_prob, _, token, parent, depth, group = heapq.heappop(heap)
            nodes.append((token, parent, -neg_prob))
            expand(len(nodes) - 1, -neg_prob, depth, group)
        return tree_layout(nodes, match_len)


def at(seq: list[int], pos: int, own: list[int] | None, drafts: list[int]) -> int | None:
    """The token at pos of seq, reading on into drafts past the end of the context's own sequence."""
    if pos < len(seq):
        return seq[pos]
    if seq is own and pos - len(seq) < len(drafts):
        return drafts[pos - len(seq)]
    return None


def tree_layout(nodes: list[tuple[int, int, float]], match_len: int) -> SuffixProposal:
    """Nodes (token, parent index or -1, prob), each after its parent, as a depth-first preorder proposal."""
    children: dict[int, list[int]] = {}
    for index, (_, parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(index)
    order: list[tuple[int, int]] = []  # (node, new index of its parent)
    stack = [(child, -1) for child in reversed(children.get(-1, []))]
    while stack:
        node, parent = stack.pop()
        order.append((node, parent))
        stack += [(child, len(order) - 1) for child in reversed(children.get(node, []))]
    return SuffixProposal(token_ids=[nodes[n][0] for n, _ in order], probs=[nodes[n][2] for n, _ in order],
                          match_len=match_len, parents=[parent for _, parent in order])


class SuffixPools:
    """Each tenant's SuffixIndex of max_tokens tokens, or one for all with `shared` (module
    docstring). A request is synced by its id into its tenant's index; `seqs` maps it to its
    sequence there while it runs (a request evicted while running starts a new sequence)."""

    def __init__(self, max_tokens: int, shared: bool = False):
        self.max_tokens = max_tokens
        self.shared = shared
        self.indexes: dict[str, SuffixIndex] = {}
        self.seqs: dict[str, tuple[int, int]] = {}  # request id -> (sequence id, history tokens synced)

    def tenant(self, user: str) -> str:
        return "" if self.shared else user

    def index(self, user: str) -> SuffixIndex:
        key = self.tenant(user)
        if key not in self.indexes:
            self.indexes[key] = SuffixIndex(self.max_tokens)
        return self.indexes[key]

    def sync(self, request_id: str, user: str, history: list[int]) -> int:
        """Index the history tokens of a request not indexed yet; its sequence id."""
        index = self.index(user)
        sid, synced = self.seqs.get(request_id, (None, 0))
        if sid is None or not index.alive(sid) or synced > len(history):
            sid, synced = index.add(), 0
        index.extend(sid, history[synced:])
        self.seqs[request_id] = (sid, len(history))
        return sid

    def ended(self, request_id: str, user: str, history: list[int]) -> None:
        """The request's last tokens indexed; it stays in the index (least recently used first out)."""
        self.sync(request_id, user, history)
        del self.seqs[request_id]

    def propose(self, request_id: str, user: str, history: list[int], max_drafts: int,
                min_prob: float) -> SuffixProposal:
        """A chain for a request from its tenant's index, its history synced first."""
        sid = self.sync(request_id, user, history)
        return self.index(user).propose(history, max_drafts, min_prob, own=sid)
