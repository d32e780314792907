"""Trees or chains: per decode row and step, whether the row asks its drafter for a tree of drafts
(docs/PROTOCOL.md#tree-drafts) or for the chain adaptive k picks, by which is expected to emit
more tokens per second; on with SchedulerConfig.max_tree_nodes > 0.

    chain:  (R + E(k_t)) / time(k_t)                  adaptive_k.py: k_t its best chain, 0 included
    tree s: (R + E_s) / time_tree(N_s)                 for each size s of `tree_sizes`: E_s tokens a
                                                       step asking s nodes emits, N_s nodes it
                                                       verifies, both measured means
    time_tree(N) = verify_tree(T0 + N + 1) + draft(depth) + commit

- The sizes: max_tree_nodes, then halved while a tree of that many nodes still branches (more
  nodes than the request's k): `tree_sizes`. The row asks the size of the best rate, or the chain.
- E_s, N_s: the row's own steps that asked s (decayed by ACCEPT_DECAY per such step), behind
  PRIOR_WEIGHT pseudo-steps of its drafter's across requests, kept per drafter, acceptance rule
  and size as adaptive k's priors. A step that asked a tree and was answered counts,
  whatever shape came back: a drafter that answers the ask with a chain (prompt lookup whose
  matches make one path, a row it drafts no tree for) is measured the same way.
- verify_tree: adaptive k's table of verify batches that held a tree row, by their new tokens (a
  tree's nodes count as tokens; a tree forward's token costs more than a chain's, hence a table
  of its own); before any, the chain table (the answers so far were chains).
- Measure first: until a drafter and rule have MIN_SAMPLES steps of every size, its rows ask the
  first size short of them; after that, a row alone in its batch whose chain sizes adaptive k
  still measures asks a chain.
- Explore: after probe_steps scheduler steps of one choice (a tree or the chain) for a drafter and
  rule, one row takes the other once (a probe), so the loser's estimates move; a probe of trees
  asks the size with the fewest steps. A probe after which the preference stays doubles the next
  wait (at most MAX_PROBE_BACKOFF times); one that changes it resets it.

Plain logic, no clocks: the step planner (step_planner.py) asks `choose` and tells `verified`;
adaptive_k.py holds the costs. Only greedy and Gumbel-coupled rows ask trees (a rejection-sampled
row keeps its chain, as it keeps its k), never a row with structured outputs (the verifier
follows a grammar along one path).
"""

from dataclasses import dataclass, field

from services.scheduler.drafts.adaptive_k import (ACCEPT_DECAY, MAX_PROBE_BACKOFF, MIN_SAMPLES, PRIOR_MAX_STEPS,
                                          PRIOR_WEIGHT, AdaptiveK, RowState)


@dataclass
class TreeCounts:
    """Sums over tree steps, decayed or not: the steps, the tokens they emitted, the nodes they verified."""

    steps: float = 0.0
    tokens: float = 0.0
    nodes: float = 0.0

    def record(self, nodes: int, tokens: int, decay: float = 1.0) -> None:
        self.steps = decay * self.steps + 1.0
        self.tokens = decay * self.tokens + tokens
        self.nodes = decay * self.nodes + nodes

    def means(self, prior: "TreeCounts") -> tuple[float, float]:
        """(tokens, nodes) per step: these counts behind PRIOR_WEIGHT pseudo-steps at prior's means."""
        weight = PRIOR_WEIGHT / max(prior.steps, 1.0)
        steps = self.steps + PRIOR_WEIGHT
        return (self.tokens + weight * prior.tokens) / steps, (self.nodes + weight * prior.nodes) / steps


@dataclass
class TreeRow:
    """One request's part: its own tree steps by the size they asked (decayed), the size its step
    in flight asked (0: a chain), and whether that step is a probe."""

    counts: dict[int, TreeCounts] = field(default_factory=dict)
    asked: int = 0
    probing: bool = False


def tree_sizes(max_nodes: int, k: int) -> list[int]:
    """The tree sizes a request of k drafts a step may ask, largest first: max_nodes, then halved
    while a tree of that many nodes still branches (more nodes than k)."""
    sizes = [max_nodes]
    while sizes[-1] // 2 > k:
        sizes.append(sizes[-1] // 2)
    return sizes


@dataclass
class TreeRun:
    """A drafter and rule's current choice: a tree or not, the scheduler steps it was taken since it
    changed or was probed (the step counted last), the probes in a row that left it, and the choice a
    verified probe tried, judged at the next choose."""

    tree: bool = False
    steps: int = 0
    counted: int | None = None
    failed: int = 0
    judge: bool | None = None


@dataclass(frozen=True)
class RowPlace:
    """Where a decode row sits in its step, as adaptive k's choose takes it: its verifier and drafter,
    the base_tokens new tokens of its verify batch besides its own, the base_k drafts its drafter
    batch already asks, alone in its verify batch or not, the others decode rows beside it, the
    scheduler step (None: each call is a step)."""

    verifier_id: str
    drafter_id: str
    base_tokens: int = 0
    base_k: int = 0
    alone: bool = True
    others: int = 0
    step: int | None = None


class TreeChoice:
    """The scheduler's tree histories per drafter and rule, over adaptive k's costs."""

    def __init__(self, adaptive: AdaptiveK, probe_steps: int):
        self.adaptive = adaptive
        self.probe_steps = probe_steps
        self.priors: dict[tuple[str, str], dict[int, TreeCounts]] = {}
        self.runs: dict[tuple[str, str], TreeRun] = {}

    def choose(self, own: RowState, row: TreeRow, prior_key: tuple[str, str], depth: int, sizes: list[int],
               place: RowPlace) -> int:
        """The nodes of the tree the row asks, one of `sizes` (`tree_sizes`), `depth` deep, or 0 for
        adaptive k's chain of at most depth drafts (module docstring); own: the row's chain acceptance."""
        row.probing, row.asked = False, 0
        priors = self.priors.setdefault(prior_key, {})
        unmeasured = [size for size in sizes if priors.setdefault(size, TreeCounts()).steps < MIN_SAMPLES]
        if unmeasured:
            row.asked = unmeasured[0]
            return row.asked
        _, chain_rate = self.adaptive.best(own.acceptance, prior_key, depth, place.verifier_id, place.base_tokens,
                                           place.drafter_id, place.base_k, place.alone, place.others)
        if chain_rate is None:
            return 0  # adaptive k measures its chain sizes first, or nothing is timed
        rates = {size: self.tree_rate(row, priors[size], size, depth, place) for size in sizes}
        best = max(sizes, key=lambda size: -1.0 if rates[size] is None else rates[size])
        prefer_tree = rates[best] is not None and rates[best] > chain_rate
        if self.explore(row, prior_key, prefer_tree, place.step):
            row.asked = best if prefer_tree else min(sizes, key=lambda size: priors[size].steps)
        return row.asked

    def tree_rate(self, row: TreeRow, prior: TreeCounts, size: int, depth: int, place: RowPlace) -> float | None:
        """The tokens per second of a step asking a tree of `size` nodes (module docstring)."""
        tokens, mean_nodes = row.counts.get(size, TreeCounts()).means(prior)
        return self.adaptive.step_rate(tokens, place.others, place.verifier_id,
                                       place.base_tokens + min(round(mean_nodes), size) + 1, place.drafter_id, depth,
                                       place.base_k, tree=True)

    def explore(self, row: TreeRow, prior_key: tuple[str, str], prefer_tree: bool, step: int | None) -> bool:
        """The preferred choice, or the other once after probe_steps (x the back-off) scheduler steps
        of it (module docstring)."""
        run = self.runs.setdefault(prior_key, TreeRun())
        if run.judge is not None:  # a probe was verified since the last choice: did it move the preference?
            run.failed = 0 if prefer_tree == run.judge else run.failed + 1
            run.judge = None
        if prefer_tree != run.tree:
            run.tree, run.steps = prefer_tree, 1
        elif step is None or step != run.counted:
            run.steps += 1
        run.counted = step
        row.probing = run.steps >= self.probe_steps * min(2 ** run.failed, MAX_PROBE_BACKOFF)
        if row.probing:
            run.steps = 0
            return not prefer_tree
        return prefer_tree

    def verified(self, row: TreeRow, prior_key: tuple[str, str], asked: int, nodes: int | None,
                 num_accepted: int) -> None:
        """A decode row verified: asked, the tree size it asked (row.asked of its last `choose`;
        0: a chain); nodes, the drafts it verified (None: its drafter did not answer, nothing to
        count); num_accepted, those accepted."""
        if row.probing:
            self.runs.setdefault(prior_key, TreeRun()).judge = asked > 0
            row.probing = False
        if not asked or nodes is None:
            return
        row.counts.setdefault(asked, TreeCounts()).record(nodes, num_accepted + 1, ACCEPT_DECAY)
        prior = self.priors.setdefault(prior_key, {}).setdefault(asked, TreeCounts())
        prior.record(nodes, num_accepted + 1)
        if prior.steps > PRIOR_MAX_STEPS:
            prior.steps, prior.tokens, prior.nodes = prior.steps / 2, prior.tokens / 2, prior.nodes / 2
