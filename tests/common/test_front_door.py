"""What the gateway and a scheduler's own Generate share (common/prompt_bounds.py ModelPrompts,
common/generate_pb.py): a prompt made and checked, a request's output read and its usage written,
by one piece of code for both."""

import pytest
from tokenizers import Tokenizer

from common.adapter_ref import AdapterRef
from common.detokenizer import Finish
from common.errors import InvalidArgument
from common.generate_pb import max_new_tokens, output_processor, usage_pb
from common.prompt_bounds import THREAD_TOKENIZE_CHARS, ContextExceeded, ModelPrompts
from common.wire import DEFAULT_MAX_NEW_TOKENS
from protos import scheduler_pb2

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny['model_dir']}/tokenizer.json")


async def test_a_text_prompt_is_tokenized_and_its_real_count_checked(tokenizer):
    prompts = ModelPrompts("m", tokenizer, limit=64)
    ids = await prompts.ids("The little cat", None, 8)
    assert list(ids) == tokenizer.encode("The little cat").ids
    chat = await prompts.ids("The little cat", None, 8, chat=True)
    assert list(chat) == tokenizer.encode("The little cat", add_special_tokens=False).ids
    with pytest.raises(ContextExceeded) as err:
        await prompts.ids("The little cat", None, 64, field="max_tokens")
    assert err.value.param == "max_tokens" and f"({len(ids)} tokens)" in str(err.value)


async def test_a_text_too_long_is_refused_on_its_length_alone(tokenizer):
    prompts = ModelPrompts("m", tokenizer, limit=64)
    with pytest.raises(ContextExceeded) as err:
        await prompts.ids("x" * (THREAD_TOKENIZE_CHARS + 1), None, 8, chat=True)
    assert err.value.param == "messages" and "characters is at least" in str(err.value)


async def test_token_ids_empty_prompts_and_no_tokenizer():
    prompts = ModelPrompts("m", None, limit=8)
    assert list(await prompts.ids(None, [5, 6], 6)) == [5, 6]
    with pytest.raises(ContextExceeded):
        await prompts.ids(None, [5, 6], 7)
    for ids in ([], None):
        with pytest.raises(InvalidArgument, match="the prompt is empty"):
            await prompts.ids(None, ids, 1)
    with pytest.raises(InvalidArgument, match="model 'm' has no tokenizer"):
        await prompts.ids("hi", None, 1)


def test_max_new_tokens_defaults_when_unset():
    assert max_new_tokens(scheduler_pb2.GenerateRequest()) == DEFAULT_MAX_NEW_TOKENS
    assert max_new_tokens(scheduler_pb2.GenerateRequest(max_new_tokens=3)) == 3


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_output_stops_at_its_stop_ids_and_at_eos_unless_it_ignores_it(ignore_eos):
    request = scheduler_pb2.GenerateRequest(stop_token_ids=[7], ignore_eos=ignore_eos)
    output = output_processor(request, None, [EOS])
    assert output.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert output.stop_ids == ({7} if ignore_eos else {7, EOS})
    assert output.append(EOS)[1] is (None if ignore_eos else Finish.STOP)


def test_usage_names_the_adapter_only_when_it_served():
    start = scheduler_pb2.StreamStart(queue_seconds=0.5, time_to_first_token_seconds=0.75,
                                      cached_prompt_tokens=16)
    ref = AdapterRef("a", 3)
    usage = usage_pb(start, 20, 4, ref)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (20, 4, 16)
    assert (usage.queue_seconds, usage.time_to_first_token_seconds) == (0.5, 0.75)
    assert AdapterRef.from_pb(usage.adapter) == ref and not usage.adapter_inactive
    start.adapter_inactive = True  # (an activated LoRA that did not activate: the base served)
    usage = usage_pb(start, 20, 4, ref)
    assert not usage.HasField("adapter") and usage.adapter_inactive
    assert not usage_pb(start, 20, 4, None).HasField("adapter")
