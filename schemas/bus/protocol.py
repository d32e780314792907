"""The protocol's version and its named limits (docs/PROTOCOL.md#encoding).

One owner for each number a message validates against; the models of schemas/ import them,
and `python -m schemas.doc_tables` lists them in docs/PROTOCOL.md. Constants only: no models.
"""

# 2 adds trees of draft tokens (DraftTokens.parents) and a scheduler's ask for one (DraftRow.max_nodes);
# 3 adds version windows (Heartbeat.protocol_min): a process speaks every version from PROTOCOL_MIN to
# PROTOCOL_VERSION and refuses the others (docs/PROTOCOL.md#version-rule; schemas/bus/versions.py)
PROTOCOL_VERSION = 3
PROTOCOL_MIN = 3  # the oldest version this release still speaks: 2 knows no windows
MAX_TOKENS_CAP = 4096  # default cap on max_tokens; a scheduler passes its own via decode(context=...)
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 64
# Draft tokens of a chain at most, and the depth of every path of a tree of draft tokens: no step
# accepts more drafts than this.
MAX_SPECULATIVE_TOKENS = 16
# Nodes of a tree of draft tokens at most (docs/PROTOCOL.md#tree-drafts): the verifier runs every node
# through the target as a position of one forward, so a row's verify cost grows with its nodes, not its
# depth. 64 positions are four chains of full depth, and hold the 63-node static tree Medusa and EAGLE-1
# verify (mc_sim_7b_63).
MAX_TREE_NODES = 64
# Heartbeat.model_ids["tokenizer"] of an instance with no vocabulary of its own (the ngram drafter):
# it fits every target.
ANY_TOKENIZER = "any"
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_MASK_SIZE = 1 << 20
MAX_BATCH_ROWS = 1024
MAX_PROMPT_CHARS = 1 << 20
MAX_CHAT_MESSAGES = 1024
MAX_TIMEOUT_S = 3600.0
MIN_TEMPERATURE = 0.01  # logits / 0.01 stay finite in float32 for any finite bf16/fp32 logit below ~3e36
MAX_TEMPERATURE = 100.0  # flatter than this is uniform to float32 precision for any real model
MIN_TOP_P = 1e-6  # a normal float32; top_p below the top token's probability keeps that token alone
MAX_TOP_K = 1 << 20  # above any vocabulary; top_k >= vocab size is "off"
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| at most, as OpenAI: -100 bans a token in practice, +100 forces it
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most, as OpenAI
MIN_REPETITION_PENALTY = 0.01  # logits / 0.01 stay finite in float32, as for MIN_TEMPERATURE
MAX_REPETITION_PENALTY = 100.0  # logits * 100 stay finite in float32 for any finite bf16/fp32 logit below ~3e36
# a structured output's grammar (its JSON schema serialised, regex, Lark text or choices together),
# characters at most: it travels with every row of every step
MAX_GRAMMAR_CHARS = 1 << 16
MAX_CHOICES = 256  # alternatives of a `choice` structured output
MAX_INBOX_LEN = 256  # characters of a client's reply subject (Commit.client_inbox)
# Ids of a sampled draft's sparse proposal, at most, per draft position: a drafter samples from
# its top MAX_DRAFT_SUPPORT ids (renormalised), and schedulers size draft batches by it.
MAX_DRAFT_SUPPORT = 256

MAX_FEATURE_SIZE = 1 << 16  # values per position of a FeatureBlock (the target's hidden size) at most
# bytes of one FeatureBlock's data at most: a row's share of a message; larger goes in pieces
MAX_FEATURE_BLOCK_BYTES = 4 << 20

# Reasons a chunk can be flagged with; `degraded` accepts any snake_case word so a new
# fallback does not need a protocol bump, but these are the ones the pipeline emits.
DEGRADED_REASONS = ("draft_timeout", "logprobs_timeout", "logprobs_invalid", "migrated", "verifier_retry",
                    "residual_fallback", "resync", "failover")
