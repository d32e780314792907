"""NATS subject names (docs/PROTOCOL.md#subjects) under a configurable prefix.

    <p>.generate.<user>          client user -> scheduler (queue group "schedulers")
    <p>.cancel.<user>            client user -> every scheduler (the owner acts, the others ignore it)
    <p>.draft.<drafter_id>       scheduler -> drafter
    <p>.verify.<verifier_id>     scheduler -> verifier
    <p>.post.<id>.commit         scheduler -> postprocessor
    <p>.post.<id>.side           verifier -> postprocessor
    <p>.stop.<scheduler_id>      postprocessor -> the scheduler that owns the request
    <p>.heartbeat                every instance -> schedulers

The client user's name is the last token of its generate and cancel subjects: NATS does not tell
a subscriber who published, so that token, which the server lets each user publish only with its
own name (services/runtime/auth.py), is how the scheduler knows who sent a request. Without auth a
client uses DEFAULT_CLIENT_USER.
"""

import re
from dataclasses import dataclass

from schemas.errors import ErrorCode, SpecbusError

DEFAULT_PREFIX = "specbus"
SCHEDULER_QUEUE_GROUP = "schedulers"
DEFAULT_CLIENT_USER = "client"
# One subject token: no dots, spaces or wildcards, so an id can never widen a subscription.
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_INSTANCE_ID = re.compile(INSTANCE_ID_PATTERN)
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def check_instance_id(value: str, field: str = "instance_id") -> str:
    if not isinstance(value, str) or not _INSTANCE_ID.match(value):
        raise SpecbusError(ErrorCode.invalid_field,
                           f"{value!r} is not a valid id: 1-64 characters from A-Z a-z 0-9 _ -", field)
    return value


@dataclass(frozen=True)
class Subjects:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or len(self.prefix) > 128 or not _PREFIX.match(self.prefix):
            raise SpecbusError(ErrorCode.invalid_field,
                               f"{self.prefix!r} is not a valid subject prefix: "
                               "dot-separated tokens of A-Z a-z 0-9 _ -",
                               "prefix")

    @property
    def generate(self) -> str:
        """The root of the generate subjects; a client publishes to `generate_for(user)`."""
        return f"{self.prefix}.generate"

    @property
    def cancel(self) -> str:
        """The root of the cancel subjects; a client publishes to `cancel_for(user)`."""
        return f"{self.prefix}.cancel"

    def generate_for(self, user: str) -> str:
        return f"{self.generate}.{check_instance_id(user, 'user')}"

    def cancel_for(self, user: str) -> str:
        return f"{self.cancel}.{check_instance_id(user, 'user')}"

    def user_of(self, subject: str) -> str:
        """The client user of a `generate_for`/`cancel_for` subject (the token after the root)."""
        return subject.rsplit(".", 1)[-1]

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}.heartbeat"

    def draft(self, drafter_id: str) -> str:
        return f"{self.prefix}.draft.{check_instance_id(drafter_id, 'drafter_id')}"

    def verify(self, verifier_id: str) -> str:
        return f"{self.prefix}.verify.{check_instance_id(verifier_id, 'verifier_id')}"

    def post_commit(self, postprocessor_id: str) -> str:
        return f"{self.prefix}.post.{check_instance_id(postprocessor_id, 'postprocessor_id')}.commit"

    def post_side(self, postprocessor_id: str) -> str:
        return f"{self.prefix}.post.{check_instance_id(postprocessor_id, 'postprocessor_id')}.side"

    def stop_notice(self, scheduler_id: str) -> str:
        return f"{self.prefix}.stop.{check_instance_id(scheduler_id, 'scheduler_id')}"
