"""common.allocator: the malloc settings the store and executor apply at start."""

import subprocess
import sys

import pytest

from common.allocator import keep_freed_memory


def test_settings_apply_on_glibc_and_bad_values_are_refused():
    # In a child process: the settings are process-wide and outlive the call.
    code = "from common.allocator import keep_freed_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "True"  # glibc, as on every machine this runs on
    with pytest.raises(ValueError, match="mmap threshold"):
        keep_freed_memory(mmap_threshold_bytes=64 << 20)
    with pytest.raises(ValueError, match="trim"):
        keep_freed_memory(trim_threshold_bytes=-1)
