"""The protocol versions a process speaks: a window [low, high] (docs/PROTOCOL.md#version-rule).

A receiver accepts a message of any version in its window and refuses every other with
`unsupported_version` (field "v"). A sender picks, for each message, the highest version that
it and every process the message reaches speak: `Window.toward(peer_high, ...)`, where a peer's
high end comes from its heartbeat (`Heartbeat.protocol_version`, with `protocol_min` its low end),
or, for a reply, from the version of the message answered. A heartbeat reaches everybody, so it
goes out once per version of the window (`Window.versions()`), and a receiver keeps the copy
addressed to it, the one at `toward(beat's high end)` (`Window.keeps`).

Every process of one release speaks [PROTOCOL_MIN, PROTOCOL_VERSION]. To rehearse an upgrade
without editing code, SPECBUS_PROTOCOL_VERSION=PROTOCOL_VERSION+1 makes a process speak the
rehearsal version too ([PROTOCOL_VERSION, PROTOCOL_VERSION+1]), and SPECBUS_PROTOCOL_MIN raises
its low end (e.g. to the rehearsal version: the roll after). The rehearsal version is
PROTOCOL_VERSION with one change an older peer refuses, as a real bump's new field is refused:
every top-level message carries the key REHEARSAL_KEY (True), which a message of a lower version
must not carry (models refuse unknown fields) and one of the rehearsal version must.
"""

import os
from dataclasses import dataclass

from schemas.bus.protocol import PROTOCOL_MIN, PROTOCOL_VERSION

VERSION_ENV = "SPECBUS_PROTOCOL_VERSION"
MIN_ENV = "SPECBUS_PROTOCOL_MIN"
REHEARSAL_VERSION = PROTOCOL_VERSION + 1
REHEARSAL_KEY = "rehearsal"


@dataclass(frozen=True)
class Window:
    low: int
    high: int

    def __post_init__(self) -> None:
        if not PROTOCOL_MIN <= self.low <= self.high <= REHEARSAL_VERSION:
            raise ValueError(f"protocol window [{self.low}, {self.high}]: this code speaks versions "
                             f"{PROTOCOL_MIN} to {REHEARSAL_VERSION} ({REHEARSAL_VERSION} only to rehearse)")

    def speaks(self, v: object) -> bool:
        return type(v) is int and self.low <= v <= self.high

    def toward(self, *peer_highs: int) -> int:
        """The version to send in to peers whose windows end at peer_highs: the highest every
        side speaks (never below our low end; a peer that cannot take it refuses it, typed)."""
        return max(self.low, min((self.high, *peer_highs)))

    def versions(self) -> range:
        return range(self.low, self.high + 1)

    def keeps(self, beat_v: int, beat_high: int) -> bool:
        """Whether a heartbeat copy sent in beat_v by a peer whose window ends at beat_high is
        the copy addressed to this window (the others are the same beat for other versions)."""
        return beat_v == self.toward(beat_high)


def read_window(env: dict[str, str] | os._Environ = os.environ) -> Window:
    try:
        high = int(env.get(VERSION_ENV) or PROTOCOL_VERSION)
        low = int(env.get(MIN_ENV) or (PROTOCOL_MIN if high == PROTOCOL_VERSION else PROTOCOL_VERSION))
    except ValueError:
        raise ValueError(f"{VERSION_ENV} / {MIN_ENV}: expected whole version numbers, got "
                         f"{env.get(VERSION_ENV)!r} / {env.get(MIN_ENV)!r}") from None
    try:
        return Window(low, high)
    except ValueError as exc:
        raise ValueError(f"{VERSION_ENV} / {MIN_ENV}: {exc}") from None


WINDOW = read_window()  # this process's
