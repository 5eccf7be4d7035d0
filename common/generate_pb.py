"""A Generate request (scheduler.proto) read, and its Usage written, the same way at every front
door: the gateway (its gRPC and HTTP faces, for the pool behind it) and a scheduler's own Generate
(for a direct caller). The prompt itself is made and checked by common/prompt_bounds.py."""

from collections.abc import Sequence

from tokenizers import Tokenizer

from common.adapter_ref import AdapterRef
from common.detokenizer import OutputProcessor
from common.wire import DEFAULT_MAX_NEW_TOKENS
from protos import scheduler_pb2


def max_new_tokens(request: scheduler_pb2.GenerateRequest) -> int:
    """The most tokens it may generate: its max_new_tokens, DEFAULT_MAX_NEW_TOKENS when unset."""
    return request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS


def output_processor(request: scheduler_pb2.GenerateRequest, tokenizer: Tokenizer | None,
                     eos_token_ids: Sequence[int]) -> OutputProcessor:
    """What reads its output tokens (into text, with `tokenizer`; None: ids only) and ends it: at
    max_new_tokens, at one of its stop_token_ids or the model's `eos_token_ids` (unless it
    ignores EOS), at one of its stop strings."""
    return OutputProcessor(tokenizer, max_new_tokens=max_new_tokens(request),
                           stop_token_ids=request.stop_token_ids, stop=list(request.stop),
                           eos_token_ids=() if request.ignore_eos else eos_token_ids,
                           include_stop_str=request.include_stop_str,
                           skip_special_tokens=not request.show_special_tokens)


def stop_fields(output: OutputProcessor) -> dict:
    """A last GenerateResponse's stop_string or stop_token_id: what of the request ended it."""
    reason = output.stop_reason
    if reason is None:
        return {}
    return {"stop_string": reason} if isinstance(reason, str) else {"stop_token_id": reason}


def usage_pb(start: scheduler_pb2.StreamStart, prompt_tokens: int, completion_tokens: int,
             adapter: AdapterRef | None) -> scheduler_pb2.Usage:
    """The Usage of a request that started as `start` says (queue and first-token seconds,
    cached prompt tokens, an activated LoRA that did not activate), served by `adapter`
    (None: the base model; none is named when the adapter did not activate)."""
    served = adapter if adapter is not None and not start.adapter_inactive else None
    return scheduler_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        queue_seconds=start.queue_seconds,
        time_to_first_token_seconds=start.time_to_first_token_seconds,
        adapter=served.to_pb() if served else None,
        cached_prompt_tokens=start.cached_prompt_tokens,
        adapter_inactive=start.adapter_inactive)
