"""Fair share of a scheduler's capacity between client users: pure functions, no NATS.

Capacity is max_running + max_queue requests. A user's share is capacity * w_user / W, where W
sums the weights of the users that have requests (running or queued) and of the user asking, so
a lone user may use everything (work conserving) and a newcomer is entitled to its part at once.

- Admission (`Admission.admit`, admission.py): with room, anyone is admitted. Full, a user under its
  share is admitted and the newest queued request of the user most over its share is refused in
  its place (`overloaded`, queued requests only: running ones are never preempted); a user at or
  over its share, or a full scheduler with nothing to refuse, is refused.
- Start order (`Admission.start_order`): a queued request of the user with the fewest running
  requests per weight starts first; a user's own requests start in arrival order.
- A step's prefill (services/scheduler/step_planner.py): the step's prefill tokens are split
  between the users with prompts waiting, weighted max-min fair by what each asks
  (`split_fairly`), and while another user's rows decode in the step a user's prefill takes at
  most as many tokens as those rows, or MIN_STEP_TOKENS (`prefill_caps`: prefill parity), so
  one user's flood of long prompts lengthens another's decode step by about that step's own
  tokens (docs/PROTOCOL.md#tenant-isolation). While a step holds several users' rows, the
  side-channel bytes of their prompt logprobs are split and capped by the same two functions.

Weights come from `SchedulerConfig.user_weights` ("alice=2,bob=1"; a user not listed weighs 1).
The client user of a request is the one whose inbox it streams to (`_INBOX.<user>.…`, which the
scheduler has already checked against the subject it came on).
"""

from collections.abc import Iterable, Mapping

from schemas.errors import ErrorCode, SpecbusError

DEFAULT_WEIGHT = 1.0


def parse_user_weights(text: str) -> dict[str, float]:
    """ "alice=2,bob=0.5" -> {"alice": 2.0, "bob": 0.5}; SpecbusError naming `user_weights`."""
    weights: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        user, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not user.strip() or not weight > 0 or weight == float("inf"):
            raise SpecbusError(ErrorCode.invalid_field, f"expected user=positive weight, got {item!r}",
                               "user_weights")
        weights[user.strip()] = weight
    return weights


def user_of_inbox(client_inbox: str) -> str:
    """The client user an inbox `_INBOX.<user>.…` belongs to ("" for another shape)."""
    parts = client_inbox.split(".")
    return parts[1] if len(parts) > 2 else ""


def share(user: str, loads: Mapping[str, int], weights: Mapping[str, float], capacity: int,
          arriving: str | None = None) -> float:
    """user's share of capacity among the users with load, user itself and the user arriving."""
    active = {name for name, load in loads.items() if load > 0} | {user} | ({arriving} if arriving else set())
    total = sum(weights.get(name, DEFAULT_WEIGHT) for name in active)
    return capacity * weights.get(user, DEFAULT_WEIGHT) / total


def most_over_share(user: str, loads: Mapping[str, int], queued: Iterable[str], weights: Mapping[str, float],
                    capacity: int) -> str | None:
    """Among the users with a queued request (queued: their names, repeats allowed), the one
    furthest over its share (load / weight largest) when user arrives; None when none is over."""
    over = [name for name in set(queued)
            if name != user and loads.get(name, 0) > share(name, loads, weights, capacity, arriving=user)]
    return max(over, key=lambda name: (loads[name] / weights.get(name, DEFAULT_WEIGHT), name), default=None)


def start_order_key(running_by_user: Mapping[str, int], weights: Mapping[str, float]):
    """A key for min(): the queued request whose user runs the fewest requests per weight."""
    return lambda user: running_by_user.get(user, 0) / weights.get(user, DEFAULT_WEIGHT)


def split_fairly(demands: Mapping[str, int], weights: Mapping[str, float], room: int) -> dict[str, int]:
    """room tokens split between users by demand, weighted max-min fair (water-filling): a user
    asking less than its weighted slice of what is left gets what it asks, the others share the
    rest by weight (rounded down, the remainder one token each in name order)."""
    shares = dict.fromkeys(demands, 0)
    active = sorted(user for user, demand in demands.items() if demand > 0)
    while room > 0 and active:
        total = sum(weights.get(user, DEFAULT_WEIGHT) for user in active)
        met = [user for user in active if demands[user] <= room * weights.get(user, DEFAULT_WEIGHT) / total]
        if met:
            for user in met:
                shares[user], room = demands[user], room - demands[user]
            active = [user for user in active if user not in met]
            continue
        for user in active:
            shares[user] = int(room * weights.get(user, DEFAULT_WEIGHT) / total)
        for user in active[:room - sum(shares[user] for user in active)]:
            shares[user] += 1
        break
    return shares


def prefill_caps(shares: Mapping[str, int], decode_tokens: Mapping[str, int], least: int) -> dict[str, int]:
    """Prefill parity (module docstring): each user's prefill share, at most the tokens of the
    other users' decode rows in the step (decode_tokens: user -> its rows' tokens), or least,
    where there are any."""
    total = sum(decode_tokens.values())
    caps = {}
    for user, tokens in shares.items():
        others = total - decode_tokens.get(user, 0)
        caps[user] = min(tokens, max(others, least)) if others else tokens
    return caps
