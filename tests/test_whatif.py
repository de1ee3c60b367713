"""What-if replays of a real recording: smaller capacity, compaction at step ends, pool mode."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event, Trace
from ms_memopt.replay.whatif import lifetime_tags, pool_regions, replay_policy
from ms_memopt.io.traces import load_trace

# the demo GPT, 4 PyNative steps of 8..32 tokens, raw stderr with VLOG_v=12906 and step marks
RECORDING = Path(__file__).parent / "data" / "pool_log" / "gpt_varying_seq_4steps.log.gz"
KiB = 1 << 10


def test_lifetime_tags_mark_what_outlives_a_step():
    trace = Trace([Event("alloc", id=1, size=100), Event("alloc", id=2, size=100), Event("free", id=2),
                   Event("alloc", id=3, size=100, pool="persistent"), Event("free", id=3),
                   Event("alloc", id=4, size=100, tag="activation"), Event("step", step=1),
                   Event("free", id=1), Event("free", id=4), Event("alloc", id=5, size=100)])
    tags = {e.id: e.tag for e in lifetime_tags(trace).events if e.action == "alloc"}
    # kept past the step: a parameter; the persistent pool's: a parameter; what fits no purpose
    # (made after the last step mark, made and freed before it) goes to the workspace
    assert tags == {1: "parameter", 2: "workspace", 3: "parameter", 4: "activation", 5: "workspace"}
    assert pool_regions(lifetime_tags(trace), 4096) == {"parameters": 1024, "activations": 1536, "workspace": 1536}
    with pytest.raises(InputError, match="long-lived"):
        pool_regions(lifetime_tags(trace), 1024)


def test_the_real_sequence_dies_of_fragmentation_and_compaction_at_step_ends_saves_it():
    trace = load_trace(RECORDING)
    assert trace.meta["pool"] == "DynamicMemPoolBestFit"
    capacity = 2500 * KiB
    base = replay_policy(trace, "baseline", allocator="mindspore-bestfit", capacity=capacity)
    assert base.ooms and all(o.kind == "fragmentation" for o in base.ooms)
    compact = replay_policy(trace, "compact", allocator="mindspore-bestfit", capacity=capacity)
    assert compact.policy["compactions"] == 4 and compact.policy["frag_after_max"] == 0
    assert not compact.ooms
    pool = replay_policy(trace, "pool", allocator="mindspore-bestfit", capacity=capacity)
    assert sum(pool.policy["regions"].values()) == capacity
    unbounded = replay_policy(trace, "baseline", allocator="mindspore-bestfit", capacity=None)
    assert unbounded.address_match == 1.0 and not unbounded.ooms


def test_policies_refuse_what_they_cannot_do(tmp_path):
    no_steps = Trace([Event("alloc", id=1, size=100)])
    with pytest.raises(InputError, match="no step events"):
        replay_policy(no_steps, "compact", allocator="mindspore", capacity=None)
    with pytest.raises(InputError, match="give --capacity"):
        replay_policy(no_steps, "pool", allocator="mindspore", capacity=None)
    with pytest.raises(InputError, match="unknown policy"):
        replay_policy(no_steps, "defrag", allocator="mindspore", capacity=None)


def test_cli_policy_json():
    proc = subprocess.run([sys.executable, "-m", "ms_memopt", "replay", str(RECORDING), "--capacity", "2500KiB",
                           "--policy", "compact", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"]["name"] == "compact" and out["oom_count"] == 0
    human = subprocess.run([sys.executable, "-m", "ms_memopt", "replay", str(RECORDING), "--capacity", "2500KiB",
                            "--policy", "pool"], capture_output=True, text=True, timeout=120)
    # MindSpore's CPU pool holds no weights: its regions are the gradients, activations and workspace
    assert human.returncode == 0 and "pool mode: workspace" in human.stdout and "gradients" in human.stdout
