"""Ascend-only decisions, tested through a fake device layer that behaves as MindSpore 2.10's
source says (issue 22), and the settings rule read back on CPU's real ``set_memory``.

Sources the fakes follow (MindSpore 2.10):
* ``mindspore/runtime/memory.py``, ``set_memory``: one call per process
  (``RuntimeConf.is_memory_configured``), defaults written for every argument not given;
* the Ascend pool reads ``init_size`` once, at its first allocation (``std::call_once`` in
  ``GetInstance``), and ``Initialize`` halves it; under VMM it skips initialisation ("Skip
  initialization of memory pool since vmm enabled", ``libmindspore_memory_pool.so``);
* Parameters are persistent (``set_from_persistent_mem(tensor->is_parameter())``) and
  ``move_to`` makes a common-pool allocation.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.mindspore

ms = pytest.importorskip("mindspore")

from ms_memopt.core.poolplan import PoolPlan  # noqa: E402
from ms_memopt.mindspore import pool_mode  # noqa: E402
from ms_memopt.mindspore.pool_info import PoolInfo, detect_pool, driver_version, parse_alloc_conf  # noqa: E402

GiB = 1 << 30
ASCEND_BESTFIT = PoolInfo(device="Ascend", kind="ascend-bestfit", vmm=False, mode="pynative", somas=False,
                          basis="test")
ASCEND_VMM = PoolInfo(device="Ascend", kind="ascend-vmm", vmm=True, mode="pynative", somas=False, basis="test")


class FakeSetMemory:
    """``ms.runtime.set_memory`` as 2.10 behaves: once per process, every argument written."""

    DEFAULTS = {"init_size": "2GB", "increase_size": "2GB", "max_size": "1024GB", "optimize_level": "O0"}

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kwargs) -> None:
        if self.calls:
            raise RuntimeError("The 'set_memory' can not be set repeatedly.")
        self.calls.append({**self.DEFAULTS, **kwargs})


@pytest.fixture
def fake_ascend(monkeypatch):
    fake = FakeSetMemory()
    state = {"started": False}
    monkeypatch.setattr(ms.runtime, "set_memory", fake)
    monkeypatch.setattr(pool_mode, "_memory_configured", lambda: bool(fake.calls))
    monkeypatch.setattr(pool_mode, "_pool_started", lambda: state["started"])
    monkeypatch.setattr(pool_mode, "detect_pool", lambda: ASCEND_BESTFIT)
    fake.state = state
    return fake


def _plan(total: int = GiB) -> PoolPlan:
    return PoolPlan.build({"parameters.bfloat16": total // 2, "activations": total // 2}, 512, rings=("activations",))


def test_reservation_passes_every_setting_back_and_doubles_for_the_halving(fake_ascend):
    note = pool_mode.reserve_pool(_plan(), pool=ASCEND_BESTFIT)
    assert note.startswith("reserved")
    (call,) = fake_ascend.calls
    assert call["init_size"] == "2.000GB"              # Initialize gives half to persistent memory
    current = pool_mode.memory_settings()
    assert call["optimize_level"] == ("O1" if str(current["memory_optimize_level"]) in ("1", "O1") else "O0")
    assert call["max_size"] == pool_mode._gb(current["max_device_memory"])
    assert call["increase_size"] == pool_mode._gb(current["mempool_block_size"])


@pytest.mark.parametrize("why", ["configured", "started", "vmm"])
def test_reservation_is_refused_when_it_cannot_work(fake_ascend, why):
    pool = ASCEND_VMM if why == "vmm" else ASCEND_BESTFIT
    if why == "configured":
        fake_ascend(max_size="60GB")                     # MindFormers' build_context did it
        fake_ascend.calls[:] = [fake_ascend.calls[0]]
    if why == "started":
        fake_ascend.state["started"] = True
    note = pool_mode.reserve_pool(_plan(), pool=pool)
    assert note.startswith("not reserved")
    assert len(fake_ascend.calls) == (1 if why == "configured" else 0)
    if why != "vmm":
        assert "launch script" in note and "init_size='2.000GB'" in note


def test_pool_mode_reserves_before_it_allocates_anything(fake_ascend, monkeypatch):
    """The pool reads init_size at its first allocation, so the reservation must come before
    the parameters are combined (an allocation)."""
    from mindspore import nn

    order = []
    real_combine = pool_mode.combine_tensor_list_contiguous
    monkeypatch.setattr(pool_mode, "combine_tensor_list_contiguous",
                        lambda *a, **k: (order.append("combine"), real_combine(*a, **k))[1])
    real_set = ms.runtime.set_memory
    monkeypatch.setattr(ms.runtime, "set_memory", lambda **k: (order.append("set_memory"), real_set(**k))[1])

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Dense(8, 8) for _ in range(4)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    plan = pool_mode.enable_pool_mode(Net(), checkpoint_every=2, activation_estimator=lambda b: (1024, 256))
    assert order == ["set_memory", "combine"]
    assert plan.notes["reservation"].startswith("reserved") and plan.notes["pool"]["kind"] == "ascend-bestfit"


def test_compaction_on_ascend_relocates_no_parameter_and_says_why(monkeypatch, tmp_path):
    """On Ascend, Parameters are persistent and a relocated copy is a common-pool allocation:
    the callback moves none (nor drops compiled graphs, which would reset the dataset sink
    state) and names the remedy for the pool."""
    from mindspore import nn

    from ms_memopt.mindspore import compaction

    def refuse(*args, **kwargs):
        raise AssertionError("must not be called on Ascend")

    monkeypatch.setattr(compaction, "live_compact", refuse)
    monkeypatch.setattr(compaction, "_recompile_graphs", refuse)
    net = nn.Dense(4, 4)
    for pool, words in ((ASCEND_BESTFIT, "persistent pool"), (ASCEND_VMM, "VMM pool")):
        callback = compaction.CompactionCallback(every=1, barrier=None, log_dir=tmp_path)
        callback._pool = pool
        record = callback.step(1, network=net)
        assert record["live"] is None and words in record["live_skipped"]
        assert record["pool"]["kind"] == pool.kind
        assert record["pool"]["holes_decide_ooms"] is (not pool.vmm)


def test_detect_pool_follows_the_settings():
    assert parse_alloc_conf("enable_vmm:True,older_pool:False") == {"enable_vmm": "True", "older_pool": "False"}
    cases = [
        (dict(alloc_conf="enable_vmm:False", driver=(24, 1)), "ascend-bestfit"),
        (dict(alloc_conf="older_pool:True", driver=(24, 1)), "ascend-bestfit"),
        (dict(alloc_conf="", driver=(23, 0)), "ascend-bestfit"),
        (dict(alloc_conf="", driver=(24, 1)), "ascend-vmm"),
        (dict(alloc_conf="enable_vmm:True", driver=None), "ascend-vmm"),
    ]
    for kwargs, kind in cases:
        assert detect_pool(device="Ascend", mode="pynative", optimize_level=0, **kwargs).kind == kind, kwargs
    graph = detect_pool(device="Ascend", mode="graph", optimize_level="O1", alloc_conf="", driver=None)
    assert graph.somas and graph.mode == "graph"
    assert detect_pool().kind == "cpu-bestfit"          # this machine


def test_driver_version_reads_version_info(tmp_path):
    info = tmp_path / "version.info"
    info.write_text("Version=24.1.rc2\nascendhal_version=7.35.23\n")
    assert driver_version((str(info),)) == (24, 1)
    assert driver_version((str(tmp_path / "missing"),)) is None


_SETTINGS = textwrap.dedent("""
    import json, sys
    import mindspore as ms
    from ms_memopt.mindspore.pool_mode import memory_settings, reserve_pool
    from ms_memopt.core.poolplan import PoolPlan
    ms.set_context(memory_optimize_level="O1")
    before = memory_settings()
    plan = PoolPlan.build({"parameters.float32": 1 << 20}, 512)
    first = reserve_pool(plan, force=True)          # CPU: forced, the real set_memory runs
    second = reserve_pool(plan, force=True)         # set_memory was called: refused
    print(json.dumps({"before": before, "after": memory_settings(), "first": first, "second": second}))
""")


def test_no_setting_the_user_made_changes_real_set_memory(tmp_path):
    """The user's ``memory_optimize_level="O1"`` read back after our reservation: still 1 (a
    plain ``set_memory(init_size=...)`` turns it to 0)."""
    script = tmp_path / "settings.py"
    script.write_text(_SETTINGS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"]["memory_optimize_level"] == 1
    assert got["after"] == got["before"]
    assert got["first"].startswith("reserved") and got["second"].startswith("not reserved: set_memory was already")
