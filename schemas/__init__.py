"""specbus wire protocol: message models, packed arrays, msgpack codec, subjects, error codes."""

from schemas.arrays import (MAX_ARRAY_BYTES, IdMatrix, LogprobMatrix, LogprobVector, Packed, ProbMatrix, Ranks,
                            TokenIds)
from schemas.bus.codec import (MESSAGE_TYPES, decode, decode_any, decode_heartbeat, encode, encode_beats, error_reply,
                           field_path, reply_version, validate)
from schemas.commits import Commit, LogprobArrays, SideChannelRecord, StopNotice
from schemas.bus.control import Heartbeat
from schemas.errors import CodecError, ErrorCode, SpecbusError
from schemas.generation import (CancelRequest, GenerateRequest, LogprobOptions, RowSampling, SamplingParams,
                                SpeculativeOptions, check_limits, new_request_id)
from schemas.bus.protocol import (DEGRADED_REASONS, MAX_SPECULATIVE_TOKENS, MAX_TOKENS_CAP, MAX_TOP_LOGPROBS,
                              PROTOCOL_MIN, PROTOCOL_VERSION)
from schemas.steps import (DraftRequest, DraftResponse, DraftResult, DraftRow, FeatureBlock, Proposal, VerifyRequest,
                           VerifyResponse, VerifyResult, VerifyRow)
from schemas.streams import Admitted, SamplingMask, StreamChunk, TokenLogprob, Usage
from schemas.bus.subjects import DEFAULT_PREFIX, SCHEDULER_QUEUE_GROUP, Subjects, check_instance_id
from schemas.bus.wire import Error, Message

__all__ = [
    "MAX_ARRAY_BYTES", "IdMatrix", "LogprobMatrix", "LogprobVector", "Packed", "ProbMatrix", "Ranks", "TokenIds",
    "decode", "decode_any", "decode_heartbeat", "encode", "encode_beats", "error_reply", "field_path",
    "reply_version", "validate",
    "CodecError", "ErrorCode", "SpecbusError",
    "DEGRADED_REASONS", "MAX_SPECULATIVE_TOKENS", "MAX_TOKENS_CAP", "MAX_TOP_LOGPROBS", "MESSAGE_TYPES",
    "PROTOCOL_MIN", "PROTOCOL_VERSION", "Admitted", "CancelRequest", "Commit", "DraftRequest", "DraftResponse", "DraftResult",
    "DraftRow", "Error", "FeatureBlock", "GenerateRequest", "Heartbeat", "LogprobArrays", "LogprobOptions", "Message",
    "Proposal",
    "RowSampling", "SamplingMask", "SamplingParams", "SideChannelRecord", "SpeculativeOptions", "StopNotice",
    "StreamChunk", "TokenLogprob", "Usage", "VerifyRequest", "VerifyResponse", "VerifyResult", "VerifyRow",
    "check_limits", "new_request_id",
    "DEFAULT_PREFIX", "SCHEDULER_QUEUE_GROUP", "Subjects", "check_instance_id",
]
