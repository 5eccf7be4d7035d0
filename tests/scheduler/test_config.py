"""The scheduler's command line (scheduler/config.py): every Limits and Timeouts field is a flag
with its help, and the flags fill the config."""

from dataclasses import fields

from scheduler.config import FLAG_HELP, SchedulerConfig
from scheduler.limits import Limits
from scheduler.timeouts import Timeouts


def test_every_limit_and_timeout_has_the_help_of_its_flag():
    assert set(FLAG_HELP) == {f.name for f in (*fields(Limits), *fields(Timeouts))}
    assert all(text.strip() for text in FLAG_HELP.values())


def test_the_flags_fill_the_config():
    config = SchedulerConfig.from_args(["--executor", "127.0.0.1:1", "--store", "127.0.0.1:2",
                                        "--max-num-seqs", "7", "--prefix-cache", "pool",
                                        "--rpc-s", "3"])
    assert config.limits.max_num_seqs == 7 and config.limits.prefix_cache == "pool"
    assert config.timeouts.rpc_s == 3.0 and config.limits.max_queue_s == Limits.max_queue_s
