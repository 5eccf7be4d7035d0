"""Logprobs as Generate's callers get them (scheduler.proto TopLogprob, PromptToken): token ids
with the text each adds, made wherever a request is detokenized (the scheduler's Generate, the
gateway). A token's text is what it adds to the text before it, decoded as its continuation
(common/detokenizer.py), so a prompt's token texts concatenate to the prompt as its tokens
decode, and an alternative's text is what it would have added in the sampled token's place."""

from collections.abc import Sequence

from tokenizers import Tokenizer

from common.detokenizer import OutputProcessor
from protos import common_pb2, scheduler_pb2


def top_logprobs_pb(output: OutputProcessor, token_ids: Sequence[int],
                    logprobs: Sequence[float]) -> list[scheduler_pb2.TopLogprob]:
    """The alternatives of the next token of `output` (before it is appended)."""
    texts = output.peek(token_ids)
    return [scheduler_pb2.TopLogprob(token_id=t, logprob=lp, text=text)
            for t, lp, text in zip(token_ids, logprobs, texts, strict=True)]


def prompt_tokens_pb(tokenizer: Tokenizer | None, prompt_ids: Sequence[int],
                     logprobs: common_pb2.TokenLogprobs) -> list[scheduler_pb2.PromptToken]:
    """Every prompt token with its text, and, all but the first, its logprob and alternatives
    (`logprobs`: those of prompt_ids[1:])."""
    reader = OutputProcessor(tokenizer, max_new_tokens=len(prompt_ids) + 1)
    tokens, at = [], 0
    for i, token_id in enumerate(prompt_ids):
        token = scheduler_pb2.PromptToken(token_id=token_id)
        if i:
            n = logprobs.num_top[i - 1] if logprobs.num_top else 0
            token.logprob = logprobs.logprobs[i - 1]
            token.top_logprobs.extend(top_logprobs_pb(
                reader, logprobs.top_token_ids[at:at + n], logprobs.top_logprobs[at:at + n]))
            at += n
        token.text = reader.append(token_id)[0]
        tokens.append(token)
    if tokens:
        tokens[-1].text += reader.close()  # (a character the prompt's last token left open)
    return tokens
