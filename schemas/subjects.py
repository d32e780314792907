"""NATS subject names (docs/PROTOCOL.md#subjects) under a configurable prefix.

    <p>.generate                 client -> scheduler (queue group "schedulers")
    <p>.cancel                   client -> every scheduler (the owner acts, the others ignore it)
    <p>.draft.<drafter_id>       scheduler -> drafter
    <p>.verify.<verifier_id>     scheduler -> verifier
    <p>.post.<id>.commit         scheduler -> postprocessor
    <p>.post.<id>.side           verifier -> postprocessor
    <p>.stop.<scheduler_id>      postprocessor -> the scheduler that owns the request
    <p>.heartbeat                every instance -> schedulers
"""

import re
from dataclasses import dataclass

from schemas.errors import ErrorCode, SpecbusError

DEFAULT_PREFIX = "specbus"
SCHEDULER_QUEUE_GROUP = "schedulers"
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
        return f"{self.prefix}.generate"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

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
