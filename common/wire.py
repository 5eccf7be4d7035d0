"""Constants of the wire protocol that are not in the .proto files: metadata keys and values that
clients and servers must agree on."""

# Metadata a caller sends with every RPC: "authorization: Bearer <key>".
AUTHORIZATION = "authorization"
BEARER = "Bearer "
# A service calling on behalf of a tenant (a gateway calling Generate) names it here.
ON_BEHALF_OF = "loraplex-tenant"
# A scheduler names each Step stream it opens to an executor here (a fresh id per stream), and
# binds its LoadAdapter and UnloadAdapter calls to it (their stream_id): see executor.proto.
STEP_STREAM = "loraplex-step-stream"
# Trailing metadata of a RESOURCE_EXHAUSTED (or retryable UNAVAILABLE) answer: seconds to wait.
RETRY_AFTER = "retry-after"
# Trailing metadata of an UNAVAILABLE that ended a request mid-stream (its scheduler was lost):
# how many tokens the client got before it.
TOKENS_DELIVERED = "loraplex-tokens-delivered"
# A store's initial metadata on Push once the header passed its checks (see adapter_store.proto):
# the client sends the weights only after it.
PUSH_ACCEPTED = ("loraplex-push", "header-accepted")

# What a Generate request whose max_new_tokens is 0 (unset) generates at most (scheduler.proto),
# on a scheduler and on a gateway alike (common/generate_pb.py). (An HTTP API that documents its
# own default uses that API's: see gateway/tgi_api.py and gateway/openai_api.py.)
DEFAULT_MAX_NEW_TOKENS = 16
# Stop strings a request may carry, and the longest one: the scheduler's defaults
# (SchedulerConfig.max_stop_strings, max_stop_chars), and what a gateway, which applies them,
# accepts.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Longest cache_salt a Generate request (or an OpenAI request body) may carry.
MAX_CACHE_SALT_CHARS = 256
