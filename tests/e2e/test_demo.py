"""`make demo`'s main job, as a newcomer runs it: every service as a process, the workload over
gRPC and through the gateway's OpenAI API, and every adapter answering its task."""

import re
import subprocess
import sys


def test_the_demo_runs_and_its_adapters_answer_through_both_faces():
    done = subprocess.run([sys.executable, "-m", "loraplex.cli", "demo", "--requests", "32"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "all services stopped." in out
    faces = dict(re.findall(r"through (gRPC|the gateway's OpenAI)\D*(\d+) requests", out))
    assert int(faces["gRPC"]) > 0 and int(faces["the gateway's OpenAI"]) > 0
    exact = re.findall(r"(\d+) of (\d+) adapter answers exact", out)
    assert all(int(got) >= 0.8 * int(of) for got, of in exact), out[-2000:]
