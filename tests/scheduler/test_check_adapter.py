"""scheduler.validation.check_adapter: an adapter fits a pool made for its base, by the id the
store matched it to or by the fingerprint of the executors' model folder, within the pool's rank."""

import pytest

from common.errors import FailedPrecondition, InvalidArgument
from protos import common_pb2, executor_pb2
from scheduler.validation import check_adapter

FP = "1f" * 32


def adapter(base_model="org/tiny", fingerprint=FP, rank=8) -> common_pb2.AdapterInfo:
    return common_pb2.AdapterInfo(name="bot", version=2, base_model=base_model, rank=rank,
                                  base_fingerprint=fingerprint)


def pool(model_id="org/tiny", fingerprint="") -> executor_pb2.InfoResponse:
    return executor_pb2.InfoResponse(model_id=model_id, base_fingerprint=fingerprint,
                                     max_lora_rank=16)


def test_the_registered_id_or_the_fingerprint_fits():
    check_adapter(adapter(), pool())
    check_adapter(adapter(base_model="org/tiny/"), pool())
    check_adapter(adapter(), pool("My-Local-Copy", FP))  # started under its folder's name


@pytest.mark.parametrize("info", [
    adapter(fingerprint=""),  # unregistered, or registered without a fingerprint
    adapter(fingerprint="2e" * 32),  # another model
])
def test_another_base_is_refused(info):
    with pytest.raises(FailedPrecondition, match="bot@2 was trained for base model 'org/tiny', "
                                                 "but this pool serves 'My-Local-Copy'"):
        check_adapter(info, pool("My-Local-Copy", FP))
    with pytest.raises(FailedPrecondition):
        check_adapter(info, pool("My-Local-Copy", ""))  # a random-weights pool has none


def test_rank_is_still_checked():
    with pytest.raises(InvalidArgument, match="rank 32"):
        check_adapter(adapter(rank=32), pool())
