"""Out-of-memory reports in a failed job's text logs: MindSpore, torch_npu and PyTorch, as printed.

A 1024-card job that died of an OOM leaves logs, not recordings: msrun's ``worker_N.log``,
MindFormers' ``output/log/rank_N/``, a launcher's stdout, each tens or hundreds of MB. What the
framework printed when the allocation failed is in there. :func:`read_oom_log` streams one log
(plain or gzip, any size, lines bounded) and returns every OOM report in it as an
:class:`OOMReport`: the framework and allocator that printed it, the request, every figure in
bytes with the text it was printed as and the range of bytes that text stands for, and the step,
time and rank where the log has them.

The wordings, each from the source or the binary that prints it (docs/doctor.md lists them):

* **MindSpore 2.x, Ascend two-pointer adapter** (``ascend_two_pointer_mem_adapter.cc``, in the 2.10
  wheel's ``lib/plugin/ascend/libmindspore_ascend_res_manager.so``): ``Out of Memory!!! Request
  memory size: <N>B, Memory Statistic:`` then ``Device MOC memory size: <M>M`` (``Device HBM
  memory size`` before 2.5), ``MindSpore Used memory size``, ``MindSpore memory base address``,
  ``Total Static Memory size``, ``Total Dynamic memory size``, ``Actual peak memory usage`` or,
  kernel by kernel, ``Used peak memory usage (without fragments)`` and ``Actual peak memory usage
  (with fragments)``, ``Dynamic memory size of this graph``; then "Please try to reduce
  'batch_size'...". ``M`` is the byte count divided by 2**20, rounded down.
* **MindSpore dynamic pool** (``abstract_dynamic_mem_pool.cc`` / ``mem_dynamic_allocator.cc``, in
  ``lib/libmindspore_memory_pool.so``): ``Memory not enough: current free memory size[<D>] is smaller
  than required size[<R>].`` (the device memory the pool could still reserve, and the request);
  ``TotalUsedMemStatistics : <U> plus TotalUsedByEventMemStatistics : <E> and plus alloc size : <R>
  is more than total mem size : <T>.`` (the eager-free/VMM path); and, at ``GLOG_v=1``, the pool's
  state at the failure: ``The dynamic memory pool[<type>] stat info : {"in used mem":...MB, ...,
  "idle mem":...MB, ...}`` (two decimals, truncated) or, from the best-fit pool, ``Common mem pool
  info: Total allocated mem:<M>M, ..., total idle mem:<M>M. Block unit size:<M>M, block
  counts:<n>, block[0] stream id:0 block size:<M>M idle size:<M>M actual size: <M>M.``
* **MindSpore runtime** (``libmindspore_ms_backend.so``, ``libmindspore_ge_backend.so``):
  ``Device(id:<d>) memory isn't enough and alloc failed, kernel name: <k>, alloc size: <R>B.``
* **MindSpore GPU** (``libmindspore_gpu.so``): ``Memory not enough:Current free memory size[<D>]
  is smaller than required size[<R>].``
* **PyTorch CUDA** (``c10/cuda/CUDACachingAllocator.cpp``; sizes by ``format_size``: bytes up to
  1 KiB, else KiB/MiB/GiB with two decimals, rounded): up to 2.0 ``CUDA out of memory. Tried to
  allocate <S> (GPU <d>; <S> total capacity; <S> already allocated; <S> free; [<S> allowed; ]<S>
  reserved in total by PyTorch)`` (``<S> cached`` before 1.4); from 2.1 ``Tried to allocate <S>.
  GPU <d> has a total capacity of <S> of which <S> is free. [<S> allowed; ]Process <pid> has <S>
  memory in use. | Including non-PyTorch memory, this process has <S> memory in use. Of the
  allocated memory <S> is allocated by PyTorch, [with <S> allocated in private pools (e.g., CUDA
  Graphs), ]and <S> is reserved by PyTorch but unallocated.`` (2.1.0 printed "total capacty").
* **torch_npu** (``torch_npu/csrc/core/npu/NPUCachingAllocator.cpp``): ``NPU out of memory. Tried to
  allocate <S> (NPU <d>; <S> total capacity; <S> already allocated; <S> current active; <S> free;
  [<S> allowed; ]<S> reserved in total by PyTorch)`` followed by "If reserved memory is >>
  allocated memory..." (some releases with no space before "If").

Damaged text is expected: messages cut short, wrapped in tracebacks or in ``[rank3]:`` prefixes,
re-wrapped or commented by a user, repeated by every layer that re-raises them. A report keeps
what could be read and says what was missing; repeats of one message a few lines apart are one
report.

Speed: the log is read in chunks; a chunk is searched for a few trigger byte strings before any
regular expression runs, and only the lines around a trigger are parsed. Steps come from the last
step line before each report (MindSpore's ``LossMonitor`` "epoch: 1 step: 437, loss is", MindFormers'
"step:[  437/ 1000]", Megatron/MindSpeed-LLM's "iteration      437/   10000 |"), found by
searching each chunk backwards, so the cost stays that of a byte scan.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "worker_3.log")
    >>> _ = open(path, "w").write(
    ...     "epoch: 1 step: 436, loss is 2.5\\n"
    ...     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.20 GiB. GPU 0 has a total "
    ...     "capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has "
    ...     "78.07 GiB memory in use. Of the allocated memory 63.61 GiB is allocated by PyTorch, and 13.96 GiB "
    ...     "is reserved by PyTorch but unallocated.\\n")
    >>> log = read_oom_log(path)
    >>> r = log.reports[0]
    >>> r.framework, r.rank, r.step, r.request.printed, r.figures["reserved_unallocated"].value
    ('pytorch', 3, 437, '4.20 GiB', 14989435863)
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from ms_memopt.core.errors import InputError
from ms_memopt.core.lines import open_binary, read_head

__all__ = ["Figure", "OOMReport", "LogScan", "read_oom_log", "scan_bytes", "parse_message", "contradictions",
           "rank_of_path", "TRIGGERS", "ANCHORS"]

MiB = 1 << 20
#: bytes read at a time (a window spanning two chunks is completed from the next)
CHUNK_BYTES = 4 << 20
#: a line longer than this is cut for parsing (progress bars redrawn with \r make megabyte lines)
MAX_LINE = 1 << 16
#: bytes without any line end after which the input is refused (a long line is cut to MAX_LINE and
#: read on; an endless one, /dev/zero, would never end)
MAX_ENDLESS = 256 << 20
#: lines after a trigger that may still belong to its message (MindSpore's statistic block, a
#: wrapped PyTorch message)
WINDOW_LINES = 14
#: a message repeated within this many lines (re-raised, logged twice, error.log + info.log) is one report
REPEAT_LINES = 400
#: the longest message read (a pool state dump with many blocks); a window never grows past it
MAX_WINDOW_LINES = 400
#: the lines of MindSpore's pool state dump, after the logger's header (``DumpDynamicMemPoolStateInfo``)
_STATE_WORDS = ("stat info :", "pool info: Total allocated mem", "Dump state info for", "In used mem buf info for",
                "Mem block info - total count", "Mem block total size", "Free mem buf total size",
                "Eager free mem buf total size", '{"addr_"', "stream id : ")
#: reports kept per log (an inference server retrying for days prints millions); the rest are counted
MAX_REPORTS = 10000
#: two requests this close are one (MindSpore's pool aligns the kernel's size up to 512 B; PyTorch rounds)
_SAME_REQUEST = 4096
#: the byte strings one of which every OOM message contains (checked before any regex)
TRIGGERS = (b"out of memory", b"Out of Memory", b"Tried to allocate", b"emory not enough", b"memory isn't enough",
            b"Allocate memory failed",
            b"Memory isn't enough", b"is more than total mem size", b"stat info :", b"pool info: Total allocated mem",
            b"OutOfMemoryError")
#: what a chunk is searched for before anything else: every trigger holds one of these (a line holding
#: one is then checked against the triggers); three passes of ``bytes.find`` per chunk
ANCHORS = (b"emory", b"Tried to allocate", b"TotalUsedMem")
#: a rank's other failure (an HCCL timeout, another exception), looked for in the log's tail
ERROR_TRIGGERS = (b"ERROR", b"rror", b"HCCL", b"imeout", b"Traceback")
#: the end of a log searched for a failure that is not an OOM
TAIL_BYTES = 256 << 10
#: until a log's step line is known, only this much before each report or chunk end is searched for one
STEP_SEARCH_BYTES = 1 << 20
_STEP_TOKENS = (b"step: ", b"step:[", b"iteration ")


@dataclass
class Figure:
    """One printed figure: ``value`` in bytes as printed, ``low``/``high`` the bytes the printed text
    can stand for (MindSpore's ``M`` is rounded down: ``[v, v + 1 MiB)``; PyTorch's two decimals are
    rounded: ``v ± 0.005`` of the unit), ``printed`` the text itself."""

    value: int
    low: int
    high: int
    printed: str

    @property
    def exact(self) -> bool:
        return self.low == self.high


@dataclass
class OOMReport:
    """One out-of-memory report as a log holds it; every size in bytes (:class:`Figure`).

    ``framework``: ``"mindspore"``, ``"torch_npu"`` or ``"pytorch"``. ``allocator``: what printed it
    (``"ascend-two-pointer"``, ``"dynamic-pool"``, ``"dynamic-pool-vmm"``, ``"gpu-pool"``,
    ``"npu-caching"``, ``"cuda-caching"``). ``wording``: the message version read. ``figures``: name
    -> :class:`Figure` (``capacity``, ``device_free``, ``allocated``, ``reserved``,
    ``reserved_unallocated``, ``pool_idle``, ``ms_used``, ``static``, ``dynamic_graph`` ...).
    ``step``: the step that failed (the last logged step + 1) and ``last_step_line`` the line it was
    read from; ``time``: the logger's timestamp nearest before the report; ``line``: its first line
    (1-based). ``blocks_idle``: per pool block idle bytes when the best-fit pool's state was
    printed. ``cut``: the message ended before its last figure. ``notes``: what was odd.
    ``contradictions``: figures that cannot hold together (:func:`contradictions`).
    """

    framework: str
    allocator: str
    wording: str
    line: int
    request: Figure | None = None
    figures: dict[str, Figure] = field(default_factory=dict)
    device: int | None = None
    rank: int | None = None
    step: int | None = None
    last_step_line: str | None = None
    time: str | None = None
    kernel: str | None = None
    blocks_idle: list[int] = field(default_factory=list)
    vmm: bool | None = None
    cut: bool = False
    notes: list[str] = field(default_factory=list)
    text: str = ""
    source: str | None = None
    #: pairs of figures that cannot both be true as the source defines them (reserved below
    #: allocated, free above the total, ...): :func:`contradictions`, set by the verdict
    contradictions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LogScan:
    """What one log (or the logs of one rank) holds: its OOM reports in order, the first other
    failure line (an HCCL timeout, another traceback) with its line number and time, the last
    step logged, and the bytes read."""

    source: str
    rank: int | None
    reports: list[OOMReport] = field(default_factory=list)
    first_error: str | None = None
    first_error_line: int | None = None
    first_error_time: str | None = None
    last_step: int | None = None
    bytes_read: int = 0
    reports_dropped: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


# --- sizes as printed ------------------------------------------------------------------------------
_UNITS = {"bytes": 1, "byte": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE = r"(\d{1,15}(?:\.\d{1,6})?)\s?(bytes|byte|KiB|MiB|GiB|TiB|KB|MB|GB|TB|B)\b"


def _torch_size(number: str, unit: str) -> Figure:
    """A size printed by PyTorch's ``format_size`` (fixed, two decimals, rounded to nearest)."""
    scale = _UNITS[unit.lower()]
    value = float(number)
    decimals = len(number.split(".")[1]) if "." in number else 0
    half = 0 if scale == 1 else 0.5 * 10 ** -decimals * scale
    exact = round(value * scale)
    return Figure(exact, max(0, int(exact - half)), int(exact + half), f"{number} {unit}")


def _mib_floor(number: str) -> Figure:
    """MindSpore's ``size / kMBToByte`` followed by ``M``: MiB rounded down."""
    v = int(number)
    return Figure(v * MiB, v * MiB, (v + 1) * MiB - 1, f"{number}M")


def _mb_truncated(number: str) -> Figure:
    """MindSpore's ``MemStat::Format``: MiB with the decimals cut (not rounded), then ``MB``."""
    decimals = len(number.split(".")[1]) if "." in number else 0
    low = round(float(number) * MiB)
    return Figure(low, low, low + int(10 ** -decimals * MiB) - 1, f"{number}MB")


def _bytes(number: str) -> Figure:
    v = int(number)
    return Figure(v, v, v, f"{number}B")


# --- where a report sits -----------------------------------------------------------------------------
_RANK_PATH = (re.compile(r"worker_(\d{1,6})\.log"), re.compile(r"rank_?(\d{1,6})(?![\d])"),
              re.compile(r"(?:^|[/_.-])(\d{1,6})\.log$"))
_RANK_LINE = re.compile(r"\[(?:rank|Rank|RANK)\s?(\d{1,6})\]|\brank[= ](\d{1,6})\b")
_TIME = (re.compile(r"(\d{4}-\d{2}-\d{2})-(\d{2}:\d{2}:\d{2})\.(\d{3})\.\d{3}"),     # MindSpore's glog
         re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[.,](\d{1,6}))?"))   # Python logging, ISO
_STEP = (re.compile(rb"epoch:\s*\d+\s+step:\s*(\d+)"),                   # MindSpore LossMonitor
         re.compile(rb"step:\[\s*(\d+)\s*/\s*\d+\]"),                      # MindFormers
         re.compile(rb"iteration\s+(\d+)\s*/\s*\d+\s*\|"))                 # Megatron, MindSpeed-LLM


def rank_of_path(path: str | os.PathLike) -> int | None:
    """The rank a log's path names: msrun's ``worker_N.log``, ``rank_N/``, ``rankN``, ``N.log``.

    Example:
        >>> rank_of_path("job/output/log/rank_104/info.log"), rank_of_path("msrun/worker_7.log")
        (104, 7)
    """
    text = str(path).replace("\\", "/")
    for pattern in _RANK_PATH:
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    return None


def _time_of(text: str) -> str | None:
    for pattern in _TIME:
        m = pattern.search(text)
        if m:
            frac = m.group(3) or "000"
            return f"{m.group(1)} {m.group(2)}.{frac[:3].ljust(3, '0')}"
    return None


def _last_step(data: bytes, end: int | None = None, start: int = 0,
               tokens: tuple[bytes, ...] = _STEP_TOKENS) -> tuple[int, str, bytes] | None:
    """The last step line in ``data[start:end]``: searched backwards from each step token (no regex
    over the whole chunk); ``(step, line, token)``."""
    end = len(data) if end is None else end
    best = None
    for token in tokens:
        pos = end
        for _ in range(64):              # a token inside a non-step line: look a little further back
            pos = data.rfind(token, start, pos)
            if pos < 0 or (best is not None and pos < best[0]):
                break
            line_start = data.rfind(b"\n", 0, pos) + 1
            stop = data.find(b"\n", pos)
            stop = len(data) if stop < 0 else stop
            line = data[line_start:min(stop, line_start + 4096)]
            for pattern in _STEP:
                m = pattern.search(line)
                if m:
                    best = (pos, int(m.group(1)), line.decode("utf-8", "replace").strip(), token)
                    break
            else:
                continue
            break
    return None if best is None else (best[1], best[2], best[3])


# --- the messages ---------------------------------------------------------------------------------------
_CLEAN = re.compile(r"\s+")
_PREFIX = re.compile(r"(?m)^\s*(?:#+|//|>+|\[rank\d+\]:|\(\w+ rank=\d+ pid=\d+\))\s?")
_MS_OOM = re.compile(r"Out of Memory!!! Request memory size: (\d{1,20})(?!\d)\s?B?")   # more digits: no size
_MS_STAT = {
    "capacity": re.compile(r"Device (?:HBM|MOC) memory size: (\d{1,15})M"),
    "ms_used": re.compile(r"MindSpore Used memory size: (\d{1,15})M"),
    "static": re.compile(r"Total Static Memory size: (\d{1,15})M"),
    "dynamic_total": re.compile(r"Total Dynamic memory size: (\d{1,15})M"),
    "dynamic_graph": re.compile(r"Dynamic memory size of this graph: (\d{1,15})M"),
    "used_peak": re.compile(r"Used peak memory usage \(without fragments\): (\d{1,15})M"),
    "actual_peak": re.compile(r"Actual peak memory usage(?: \(with fragments\))?: (\d{1,15})M"),
}
_MS_GROW = re.compile(r"[Mm]emory not enough:\s?([Cc])urrent free memory size\[(\d{1,20})\] is smaller than "
                      r"required size\[(\d{1,20})B?\]")
_MS_KERNEL = re.compile(r"(?:Device\(id:(\d{1,6})\) m|M)emory isn't enough and alloc failed(?: in output actor)?, "
                        r"(?:kernel name: (.*?), )?alloc size: (\d{1,20})B")
_MS_VMM = re.compile(r"TotalUsedMemStatistics : (\d{1,20})(?: plus TotalUsedByEventMemStatistics : (\d{1,20}))? "
                     r"(?:and )?plus alloc size : (\d{1,20}) is more than total mem size : (\d{1,20})")
_MS_POOL_STAT = re.compile(r"The dynamic memory pool(?:\[([^\]]*)\])? stat info : (\{.*?\})")
_MS_POOL_KV = re.compile(r'"([a-z ]+)":"?(\d{1,15}(?:\.\d{1,6})?)MB')
_MS_BESTFIT = re.compile(r"(Common|Persistent) mem pool info: Total allocated mem:(\d{1,15})M, peak used mem:(\d{1,15})M, "
                         r"in used mem:(\d{1,15})M,(?: total use by event mem:(\d{1,15})M,)? total idle mem:(\d{1,15})M")
_MS_BLOCK = re.compile(r"block\[\d{1,6}\](?: stream id:\d{1,6})? block size:(\d{1,15})M idle size:(\d{1,15})M")
_MS_BESTFIT_TOTAL = re.compile(r"The dynamic memory pool total allocated mem:(\d{1,15})M.*?in used mem:(\d{1,15})M, "
                               r"(?:total used by event mem:\d{1,15}M, )?total idle mem:(\d{1,15})M"
                               r"(?:, total eager free mem:(\d{1,15})M)?")
_MS_REFUSED = re.compile(r"Memory not enough: alloc size\[(\d{1,20})\] is smaller than required size\[(\d{1,20})\]")
_MS_ALLOC_FAILED = re.compile(r"Allocate memory failed for size: (\d{1,20})")
_MS_NODE = re.compile(r"Malloc for kernel output failed, Memory isn't enough, node:\s?(\S+)")
_MS_VMM_ON = re.compile(r"enable vmm : 1")
_MS_FREE_BUFS = re.compile(r"Free mem buf total size : (\d{1,20}), total count : (\d{1,9})")

_T_REQ = re.compile(r"(CUDA|NPU|XPU|GPU)?\s?out of memory\.?\s*Tried to allocate " + _SIZE, re.I)
_T_REQ_BARE = re.compile(r"Tried to allocate " + _SIZE)
_T_NEW_CAP = re.compile(r"(GPU|NPU|XPU) (\d{1,4}) has a total capac?i?ty of " + _SIZE + r" of which " + _SIZE + r" is free")
_T_OLD_DEV = re.compile(r"\((GPU|NPU|XPU) (\d{1,4});")
_T_OLD = {
    "capacity": re.compile(_SIZE + r" total(?: capac?i?ty)?[;) ]"),
    "allocated": re.compile(_SIZE + r" already allocated"),
    "active": re.compile(_SIZE + r" current active"),
    "device_free": re.compile(_SIZE + r" free[;)]"),
    "reserved": re.compile(_SIZE + r" reserved in total by PyTorch"),
    # before 1.4 the last figure was the cache the allocator held and did not use:
    # format_size(stats.amount_cached - stats.amount_allocated) + " cached)" (c10/cuda/
    # CUDACachingAllocator.cpp, v1.0.0 to v1.3.1, THCCachingAllocator::malloc); 1.4 printed the
    # total instead, reserved_bytes "reserved in total by PyTorch"
    "cached": re.compile(_SIZE + r" cached[;)]"),
}
_T_ALLOWED = re.compile(_SIZE + r" allowed;")
_T_MPS = re.compile(r"MPS backend out of memory \(MPS allocated: " + _SIZE + r"(?:, other allocations: " + _SIZE
                    + r")?(?:, max allowed: " + _SIZE + r")?\)\.? Tried to allocate " + _SIZE)
_T_PROCESS = re.compile(r"Process (\d{1,10}) has " + _SIZE + r" memory in use")
_T_THIS = re.compile(r"this process has " + _SIZE + r" memory in use", re.I)
_T_ALLOC = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch,"
                      r"(?: with " + _SIZE + r" allocated in private pools \(e\.g\., CUDA Graphs\),)?"
                      r"(?: and " + _SIZE + r" is reserved by PyTorch but unallocated)?")


def _normalise(text: str) -> str:
    return _CLEAN.sub(" ", _PREFIX.sub(" ", text)).strip()


def _mps_report(text: str, line: int) -> OOMReport | None:
    """PyTorch's MPS allocator (``MPSAllocator.mm``): its own wording, a limit (the high watermark)."""
    m = _T_MPS.search(text)
    if m is None:
        return None
    g = m.groups()
    report = OOMReport(framework="pytorch", allocator="mps", wording="pytorch-mps", line=line,
                       request=_torch_size(g[6], g[7]))
    report.figures["allocated"] = _torch_size(g[0], g[1])
    if g[2]:
        report.figures["other_allocations"] = _torch_size(g[2], g[3])
    if g[4]:
        report.figures["allowed"] = _torch_size(g[4], g[5])
    return report


def _reserved_figures(figures: dict[str, Figure]) -> None:
    """``reserved`` and ``reserved_unallocated`` from what the old wordings print: the total
    reserved ("reserved in total by PyTorch", 1.4 to 2.0) less what is allocated, or the unused
    cache itself ("cached", before 1.4) plus what is allocated. A total below the allocated
    bytes is left as printed: :func:`contradictions` names it."""
    allocated = figures.get("allocated")
    if allocated is None:
        return
    if "cached" in figures:
        cached = figures.pop("cached")
        figures["reserved_unallocated"] = cached
        figures["reserved"] = Figure(allocated.value + cached.value, allocated.low + cached.low,
                                     allocated.high + cached.high, f"{allocated.printed} + {cached.printed}")
    elif "reserved" in figures and figures["reserved"].high >= allocated.low:
        r, a = figures["reserved"], allocated
        figures["reserved_unallocated"] = Figure(max(0, r.value - a.value), max(0, r.low - a.high),
                                                 max(0, r.high - a.low), f"{r.printed} - {a.printed}")


def _torch_report(text: str, line: int) -> OOMReport | None:
    mps = _mps_report(text, line)
    if mps is not None:
        return mps
    m = _T_REQ.search(text) or _T_REQ_BARE.search(text)
    if m is None:
        return None
    groups = m.groups()
    number, unit = groups[-2], groups[-1]
    dev_word = (groups[0] or "").upper() if len(groups) == 3 else ""
    rest = text[m.end():]
    report = OOMReport(framework="pytorch", allocator="cuda-caching", wording="", line=line,
                       request=_torch_size(number, unit))
    new = _T_NEW_CAP.search(rest)
    old = _T_OLD_DEV.search(rest)
    figures = report.figures
    if new:
        dev_word = dev_word or new.group(1)
        report.device = int(new.group(2))
        figures["capacity"] = _torch_size(new.group(3), new.group(4))
        figures["device_free"] = _torch_size(new.group(5), new.group(6))
        report.wording = "pytorch>=2.1"
        if "capacty" in rest[:new.end()]:
            report.notes.append('"total capacty" (the 2.1.0 misspelling)')
        alloc = _T_ALLOC.search(rest)
        if alloc:
            figures["allocated"] = _torch_size(alloc.group(1), alloc.group(2))
            if alloc.group(3):
                figures["private_pools"] = _torch_size(alloc.group(3), alloc.group(4))
            if alloc.group(5):
                figures["reserved_unallocated"] = _torch_size(alloc.group(5), alloc.group(6))
        this = _T_THIS.search(rest)
        if this:
            figures["process_in_use"] = _torch_size(this.group(1), this.group(2))
        processes = _T_PROCESS.findall(rest)
        if processes:
            sizes = [_torch_size(n, u) for _, n, u in processes]
            figures["processes_in_use"] = Figure(sum(s.value for s in sizes), sum(s.low for s in sizes),
                                                 sum(s.high for s in sizes),
                                                 " + ".join(s.printed for s in sizes))
            if len(processes) > 1:
                report.notes.append(f"{len(processes)} processes hold memory on the device")
        if "reserved_unallocated" not in figures:
            report.cut = True
    elif old:
        dev_word = dev_word or old.group(1)
        report.device = int(old.group(2))
        report.wording = "pytorch<=2.0" if dev_word != "NPU" else "torch_npu"
        for name, pattern in _T_OLD.items():
            found = pattern.search(rest)
            if found:
                figures[name] = _torch_size(found.group(1), found.group(2))
        if "cached" in figures:
            report.wording = "pytorch<1.4 (cached)"
        _reserved_figures(figures)
        if "reserved" not in figures and "reserved_unallocated" not in figures:
            report.cut = True
        if re.search(r"\)\.?If reserved", rest):
            report.notes.append('no space before "If reserved"')
    else:
        report.wording = "cut"
        report.cut = True
        for name, pattern in _T_OLD.items():      # reformatted by hand: the figures without their frame
            found = pattern.search(rest)
            if found:
                figures[name] = _torch_size(found.group(1), found.group(2))
                report.wording = "reformatted"
        _reserved_figures(figures)
        if "reserved_unallocated" in figures:
            report.cut = False
    allowed = _T_ALLOWED.search(rest)
    if allowed:
        figures["allowed"] = _torch_size(allowed.group(1), allowed.group(2))
    if dev_word == "NPU" or "PYTORCH_NPU_ALLOC_CONF" in text or "(NPU " in rest[:40]:
        report.framework, report.allocator = "torch_npu", "npu-caching"
        if report.wording == "pytorch<=2.0":
            report.wording = "torch_npu"
    elif dev_word == "XPU":
        report.allocator = "xpu-caching"
    if "capacity" in figures and "allocated" in figures and figures["allocated"].low > figures["capacity"].high:
        report.notes.append("allocated exceeds the total capacity (Windows counts shared system memory)")
    return report


def _ms_fill_state(report: OOMReport, text: str) -> None:
    """The pool's state dump (``GLOG_v=1``) into the report's figures."""
    stat = _MS_POOL_STAT.search(text)
    if stat:
        values = {k: _mb_truncated(v) for k, v in _MS_POOL_KV.findall(stat.group(2))}
        for key, name in (("idle mem", "pool_idle"), ("in used mem", "pool_in_use"), ("alloc mem", "reserved"),
                          ("used by event mem", "pool_used_by_event"), ("eager free mem", "pool_eager_free"),
                          ("peak used mem", "pool_peak")):
            if key in values:
                report.figures[name] = values[key]
    idle_total = report.figures.get("pool_idle")
    for m in _MS_BESTFIT.finditer(text):
        which = m.group(1).lower()
        report.figures[f"{which}_reserved"] = _mib_floor(m.group(2))
        report.figures[f"{which}_idle"] = _mib_floor(m.group(6))
        tail = text[m.end():m.end() + 20000]
        nxt = _MS_BESTFIT.search(tail)
        tail = tail[:nxt.start()] if nxt else tail
        report.blocks_idle += [int(idle) * MiB for _, idle in _MS_BLOCK.findall(tail)]
    # AbstractDynamicMemPool's per-allocator lines: a hole is never larger than its allocator's free total
    report.blocks_idle += [int(size) for size, count in _MS_FREE_BUFS.findall(text) if int(count) > 0]
    total = _MS_BESTFIT_TOTAL.search(text)
    if total:
        report.figures["reserved"] = _mib_floor(total.group(1))
        report.figures["pool_in_use"] = _mib_floor(total.group(2))
        report.figures["pool_idle"] = _mib_floor(total.group(3))
        if total.group(4):
            report.figures["pool_eager_free"] = _mib_floor(total.group(4))
    elif idle_total is None and "common_idle" in report.figures:
        parts = [report.figures[k] for k in ("common_idle", "persistent_idle") if k in report.figures]
        report.figures["pool_idle"] = Figure(sum(p.value for p in parts), sum(p.low for p in parts),
                                             sum(p.high for p in parts), " + ".join(p.printed for p in parts))
    if _MS_VMM_ON.search(text):
        report.vmm = True
        report.allocator = "dynamic-pool-vmm"


def _mindspore_report(text: str, line: int) -> OOMReport | None:
    oom = _MS_OOM.search(text)
    if oom:
        report = OOMReport(framework="mindspore", allocator="ascend-two-pointer", wording="mindspore-two-pointer",
                           line=line, request=_bytes(oom.group(1)))
        for name, pattern in _MS_STAT.items():
            m = pattern.search(text, oom.end())
            if m:
                report.figures[name] = _mib_floor(m.group(1))
        if "Device HBM memory size" in text:
            report.wording = "mindspore-two-pointer (HBM, <2.5)"
        if "ms_used" not in report.figures:
            report.cut = True
        if "used_peak" in report.figures:
            report.notes.append("kernel-by-kernel mode: the pool's free memory at the failure is not printed")
        return report
    vmm = _MS_VMM.search(text)
    if vmm:
        report = OOMReport(framework="mindspore", allocator="dynamic-pool-vmm", wording="mindspore-used-statistics",
                           line=line, request=_bytes(vmm.group(3)), vmm=True)
        report.figures["pool_in_use"] = _bytes(vmm.group(1))
        if vmm.group(2):
            report.figures["pool_used_by_event"] = _bytes(vmm.group(2))
        report.figures["ms_total"] = _bytes(vmm.group(4))
        return report
    refused = _MS_REFUSED.search(text)
    if refused:
        # the best-fit pool (CPU; Ascend/GPU with older_pool) asked the device for a new block and got
        # fewer bytes than the request: nothing more could be reserved at that moment
        report = OOMReport(framework="mindspore", allocator="dynamic-pool", wording="mindspore-block-refused",
                           line=line, request=_bytes(refused.group(2)))
        report.figures["device_granted"] = _bytes(refused.group(1))
        if "cpu_memory_pool" in text or "plugin/cpu/" in text:
            report.allocator = "cpu-pool"
        _ms_fill_state(report, text)
        return report
    grow = _MS_GROW.search(text)
    kernel = _MS_KERNEL.search(text) or _MS_ALLOC_FAILED.search(text)
    if grow or kernel:
        gpu = grow is not None and grow.group(1) == "C"
        report = OOMReport(framework="mindspore", allocator="gpu-pool" if gpu else "dynamic-pool",
                           wording="mindspore-pool-grow" if grow else "mindspore-alloc-failed", line=line)
        if grow:
            report.figures["device_free"] = _bytes(grow.group(2))
            report.request = _bytes(grow.group(3))
        if kernel is not None and kernel.re is _MS_KERNEL:
            if kernel.group(1):
                report.device = int(kernel.group(1))
            report.kernel = (kernel.group(2) or "").strip() or None
            report.request = report.request or _bytes(kernel.group(3))
            if grow and int(kernel.group(3)) != report.request.value:
                report.notes.append(f"the kernel asked for {kernel.group(3)}B; the pool for {grow.group(3)}B")
        elif kernel is not None:
            report.request = report.request or _bytes(kernel.group(1))
        _ms_fill_state(report, text)
        return report
    node = _MS_NODE.search(text)
    if node:           # the runtime's line alone: the size is in the pool's lines around it, if anywhere
        report = OOMReport(framework="mindspore", allocator="dynamic-pool", wording="mindspore-kernel-output",
                           line=line, kernel=node.group(1), cut=True)
        _ms_fill_state(report, text)
        return report
    return None


_BARE = re.compile(r"(CUDA|NPU|HIP|XPU|GPU|MPS)?[ \w]{0,20}(?:out of memory|Out of Memory|OutOfMemoryError|OUT_OF_MEMORY"
                   r"|Allocate memory failed)")


def _bare_report(line_text: str, line: int) -> OOMReport | None:
    """An OOM message without the allocator's figures (``CUDA error: out of memory`` from the driver or a
    library, a message cut at its first words): a report whose verdict says what is missing."""
    m = _BARE.search(line_text)
    if m is None:
        return None
    word = (m.group(1) or "").upper()
    if word == "NPU" or "torch_npu" in line_text:
        framework, allocator = "torch_npu", "npu-caching"
    elif ("mindspore" in line_text or "Out of Memory" in line_text or "Allocate memory failed" in line_text
          or re.search(r"\[(ERROR|WARNING)\] [A-Z_]+\(", line_text)):
        framework, allocator = "mindspore", "dynamic-pool"
    else:
        framework, allocator = "pytorch", "cuda-caching"
    return OOMReport(framework=framework, allocator=allocator, wording="no figures", line=line, cut=True,
                     notes=["an out-of-memory message without the allocator's figures (a driver's or a library's "
                            "error, or a message cut at its first words)"])


#: ``(smaller, larger, what the source says)``: figure ``smaller`` can never exceed figure ``larger``
#: as its source defines them (a sum names several figures with ``+``). PyTorch 2.1+ takes the
#: processes' memory from NVML and the free memory from cudaMemGetInfo, read at other moments:
#: those two are not held against the total
_ORDER = (
    ("allocated", "reserved", "the allocated bytes are part of the reserved ones"),
    ("allocated", "active", "active bytes are allocated ones plus those a stream still uses"),
    ("active", "reserved", "active bytes are part of the reserved ones"),
    ("allocated", "capacity", "the allocated bytes are on the device"),
    ("device_free", "capacity", "the device's free memory is part of its total"),
    ("reserved+device_free", "capacity", "the pool's memory and the free memory are disjoint parts of the device"),
    ("reserved", "process_in_use", "this process's memory includes what its allocator reserved"),
    ("ms_used", "capacity", "MindSpore's share is part of the device"),
    ("static+dynamic_total", "ms_used", "the static and dynamic memory are parts of MindSpore's share"),
    ("pool_in_use", "reserved", "memory in use is part of what the pool allocated"),
    ("pool_idle", "reserved", "idle memory is part of what the pool allocated"),
)


def contradictions(report: OOMReport) -> list[str]:
    """The figures of ``report`` that cannot all be true as their source defines them: one line
    each, naming both figures as printed. Only a contradiction at every byte their printed
    rounding allows counts (``smaller.low > larger.high``).

    Example:
        >>> r = parse_message("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
        ...                   "6.64 GiB already allocated; 21.00 MiB free; 150.86 MiB reserved in total by PyTorch)")
        >>> contradictions(r)
        ['allocated (6.64 GiB) exceeds reserved (150.86 MiB), though the allocated bytes are part of the reserved ones']
    """
    figures = report.figures
    out = []
    for smaller, larger, why in _ORDER:
        parts = [figures.get(name) for name in smaller.split("+")]
        big = figures.get(larger)
        if big is None or any(p is None for p in parts):
            continue
        if sum(p.low for p in parts) > big.high:
            printed = " + ".join(p.printed for p in parts)
            out.append(f"{smaller.replace('+', ' + ')} ({printed}) exceeds {larger} ({big.printed}), though {why}")
    return out


def parse_message(text: str, line: int = 1) -> OOMReport | None:
    """The OOM report in one message's text (several lines joined), or ``None``.

    Example:
        >>> r = parse_message("Out of Memory!!! Request memory size: 1088627200B, Memory Statistic:\\n"
        ...                   "Device HBM memory size: 32768M\\nMindSpore Used memory size: 1024M\\n")
        >>> r.allocator, r.request.value, r.figures["ms_used"].high
        ('ascend-two-pointer', 1088627200, 1074790399)
    """
    flat = _normalise(text)
    return _mindspore_report(flat, line) or _torch_report(flat, line)


# --- the stream ------------------------------------------------------------------------------------------
class _Scanner:
    """Line windows around triggers, carried across chunks; one per log."""

    def __init__(self, source: str, rank: int | None) -> None:
        self.scan = LogScan(source=source, rank=rank)
        self.line_no = 0                 # lines consumed so far
        self.window: list[str] = []      # lines of the message being collected
        self.window_line = 0
        self.window_left = 0
        self.step: tuple[int, str] | None = None
        self.time: str | None = None
        self.recent: list[tuple[int, str]] = []     # (line, text) of the last few lines, for the time before
        self.window_text_head = ""
        self.step_token: bytes | None = None
        self.before = b""                        # the last line that held an anchor but no trigger

    # a MindSpore report gathers its pieces: the pool's grow failure, its state dump, the runtime line
    def _add(self, report: OOMReport) -> None:
        report.source = self.scan.source
        report.rank = report.rank if report.rank is not None else self.scan.rank
        if self.step is not None:
            report.step, report.last_step_line = self.step[0] + 1, self.step[1]
        report.time = report.time or self.time
        reports = self.scan.reports
        if reports and report.request is None and report.framework == "mindspore":
            last = reports[-1]
            if last.framework == "mindspore" and report.line - last.line <= REPEAT_LINES:
                last.kernel = last.kernel or report.kernel
                return
        if reports:
            last = reports[-1]
            if (report.line - last.line <= REPEAT_LINES and last.framework == report.framework
                    and last.rank == report.rank and last.request is not None and report.request is not None
                    and abs(last.request.value - report.request.value) <= _SAME_REQUEST):
                # the same failure again: re-raised, logged twice, or MindSpore's pieces in turn
                for name, fig in report.figures.items():
                    last.figures.setdefault(name, fig)
                last.blocks_idle = last.blocks_idle or report.blocks_idle
                last.kernel = last.kernel or report.kernel
                last.device = last.device if last.device is not None else report.device
                if last.allocator == "dynamic-pool" and report.allocator != "dynamic-pool":
                    last.allocator = report.allocator
                if last.cut and not report.cut:
                    last.cut, last.wording, last.text = False, report.wording, report.text
                return
        if len(reports) >= MAX_REPORTS:
            self.scan.reports_dropped += 1       # memory stays bounded on a log of endless retries
            return
        reports.append(report)

    def _close_window(self) -> None:
        text = "\n".join(self.window)
        self.window = []
        report = parse_message(text, self.window_line)
        head = self.window_text_head
        if report is None:
            report = _bare_report(head, self.window_line)
            if report is None:
                return
        report.text = _normalise(text)[:2000]
        if report.allocator == "dynamic-pool" and (b"plugin/cpu/" in self.before or "plugin/cpu/" in head):
            report.allocator = "cpu-pool"           # MindSpore's CPU device pool (best fit, no VMM)
        report.time = _time_of(head) or self.time
        rank = _RANK_LINE.search(head)
        if rank:
            report.rank = int(rank.group(1) or rank.group(2))
        self._add(report)

    def feed_line(self, raw: bytes) -> None:
        self.line_no += 1
        if self.window:
            text = raw[:MAX_LINE].decode("utf-8", "replace")
            self.window.append(text)
            self.window_left -= 1
            if len(self.window) < MAX_WINDOW_LINES and any(k in text for k in _STATE_WORDS):
                self.window_left = max(self.window_left, 3)     # a pool state dump: read it to its end
            if self.window_left <= 0 or _ends_message(text) or len(self.window) >= MAX_WINDOW_LINES:
                self._close_window()
            return
        if any(t in raw for t in TRIGGERS):
            text = raw[:MAX_LINE].decode("utf-8", "replace")
            if self._is_state_line(text) and self.scan.reports and self.line_no - self.scan.reports[-1].line < 60:
                _ms_fill_state(self.scan.reports[-1], _normalise(text))
                return
            self.window = [text]
            self.window_line = self.line_no
            self.window_text_head = text
            self.window_left = WINDOW_LINES
            t = _time_of(text)
            if t:
                self.time = t
            if _ends_message(text):
                self._close_window()
            return

    def note_context(self, body: bytes, start: int, end: int) -> None:
        """The last step line and logger time in ``body[start:end]`` (lines passed over unparsed)."""
        if end <= start:
            return
        if self.step_token is not None:          # the log's own step line: one backward search
            step = _last_step(body, end, start, (self.step_token,))
        else:                                     # not seen yet: every kind, in the region's last MiB
            step = _last_step(body, end, max(start, end - STEP_SEARCH_BYTES))
        if step is not None:
            self.step = step[:2]
            self.step_token = step[2]
        t = _last_time(body[max(start, end - 65536):end])
        if t:
            self.time = t

    @staticmethod
    def _is_state_line(text: str) -> bool:
        return "stat info :" in text or "pool info: Total allocated mem" in text

    def flush(self) -> None:
        if self.window:
            self._close_window()


_ERROR_WORDS = re.compile(r"HCCL|hccl|NCCL|[Tt]imeout|timed out|EI00\d\d|Error|ERROR|Traceback")


def _is_failure(text: str) -> bool:
    return bool(_ERROR_WORDS.search(text)) and "WARNING" not in text[:40]


def _ends_message(text: str) -> bool:
    return ("Please try to reduce" in text or "PYTORCH_CUDA_ALLOC_CONF" in text or "to avoid fragmentation" in text
            or "PYTORCH_NPU_ALLOC_CONF" in text or "Memory Management" in text or "alloc size:" in text
            or "is more than total mem size" in text or "is reserved by PyTorch but unallocated" in text
            or "reserved in total by PyTorch)" in text or "empty_cache" in text
            or "Allocate memory failed for size" in text)


def scan_bytes(chunks, *, source: str = "<log>", rank: int | None = None) -> LogScan:
    """Every OOM report in a stream of byte chunks (any split); :func:`read_oom_log` on a file."""
    scanner = _Scanner(source, rank)
    carry = b""
    total = 0
    tail = b""
    endless = 0                                     # bytes since the last line end
    for chunk in chunks:
        total += len(chunk)
        first = chunk.find(b"\n")
        if first < 0:                               # no line ends in this chunk
            carry = (carry + chunk)[:MAX_LINE]
            endless += len(chunk)
            if endless > MAX_ENDLESS:               # /dev/zero, a disk image: not a text log, and no end
                raise InputError(f"no line end in {MAX_ENDLESS >> 20} MiB; expected a text log", source=source)
            continue
        endless = len(chunk) - chunk.rfind(b"\n") - 1
        last = chunk.rfind(b"\n")
        if carry:                                   # the line that straddles the previous chunk
            head = carry + chunk[:first]
            _feed(scanner, head, 0, len(head))
        else:
            _feed(scanner, chunk, 0, first)
        if last > first:
            _feed(scanner, chunk, first + 1, last)
        carry = chunk[last + 1:last + 1 + MAX_LINE]
        tail = (tail + chunk[:last])[-TAIL_BYTES:] if last < TAIL_BYTES else chunk[max(0, last - TAIL_BYTES):last]
    if carry:
        _feed(scanner, carry, 0, len(carry))
        tail = (tail + b"\n" + carry)[-TAIL_BYTES:]
    scanner.flush()
    _first_error(scanner.scan, tail, scanner.line_no)
    scanner.scan.bytes_read = total
    scanner.scan.last_step = None if scanner.step is None else scanner.step[0]
    return scanner.scan


def _feed(scanner: _Scanner, body: bytes, pos: int, n: int) -> None:
    """The whole lines ``body[pos:n]`` (``n`` at a line end). The few anchors are searched with
    ``bytes.find`` (each position remembered until passed, so every byte is searched once per
    anchor); only a line holding an anchor is checked against the triggers, and only a trigger line
    opens a message window."""
    nxt = [body.find(a, pos, n) for a in ANCHORS]
    # the triggers too, each position remembered until passed: anchor lines before the next trigger's
    # line are none of them a trigger line, so they are passed in one step (a log where every line
    # held "emory" went line by line in Python, at 2 MB/s)
    tnxt = [body.find(t, pos, n) for t in TRIGGERS]
    noted = pos                                # step and time are known up to here
    while pos <= n:
        if scanner.window:                     # a message being read: every line until it ends
            end = body.find(b"\n", pos, n)
            end = n if end < 0 else end
            scanner.feed_line(body[pos:end])
            pos = noted = end + 1
            continue
        live = [p for p in nxt if p >= pos]
        if not live:
            scanner.line_no += body.count(b"\n", pos, n) + 1
            scanner.note_context(body, noted, n)
            return
        hit = min(live)
        for i, p in enumerate(tnxt):
            if 0 <= p < pos:
                tnxt[i] = body.find(TRIGGERS[i], pos, n)
        trig = [p for p in tnxt if p >= pos]
        tstart = max(pos, body.rfind(b"\n", pos, min(trig)) + 1) if trig else n + 1
        if hit < tstart:                       # anchor lines, then the trigger's line (or the chunk's end)
            last = max(body.rfind(a, pos, tstart) for a in ANCHORS)
            start = max(pos, body.rfind(b"\n", pos, last) + 1)
            end = body.find(b"\n", last, n)
            end = n if end < 0 else end
            scanner.line_no += body.count(b"\n", pos, end) + 1
            scanner.before = body[start:end][:MAX_LINE]   # the last of them, as line by line
            pos = end + 1
            for i, p in enumerate(nxt):
                if 0 <= p < pos:
                    nxt[i] = body.find(ANCHORS[i], pos, n)
            continue
        start = max(pos, body.rfind(b"\n", pos, hit) + 1)
        end = body.find(b"\n", hit, n)
        end = n if end < 0 else end
        line = body[start:end]
        scanner.line_no += body.count(b"\n", pos, start)
        if any(t in line for t in TRIGGERS):
            scanner.note_context(body, noted, start)
            scanner.feed_line(line)
            noted = end + 1
        else:
            scanner.line_no += 1
            scanner.before = line[:MAX_LINE]       # e.g. the CPU pool's "malloc memory failed." just before
        pos = end + 1
        for i, p in enumerate(nxt):
            if 0 <= p < pos:
                nxt[i] = body.find(ANCHORS[i], pos, n)


def _first_error(scan: LogScan, tail: bytes, lines: int) -> None:
    """The first failure line in the log's last :data:`TAIL_BYTES` (a rank that died after a peer's
    OOM fails at its end: an HCCL timeout, the exception that follows)."""
    pos = 0
    for _ in range(10000):
        hits = [p for p in (tail.find(a, pos) for a in ERROR_TRIGGERS) if p >= 0]
        if not hits:
            return
        hit = min(hits)
        start = tail.rfind(b"\n", 0, hit) + 1
        end = tail.find(b"\n", hit)
        end = len(tail) if end < 0 else end
        text = tail[start:min(end, start + 2000)].decode("utf-8", "replace").strip()
        if _is_failure(text):
            scan.first_error = text[:500]
            scan.first_error_line = lines - tail.count(b"\n", end)
            scan.first_error_time = _time_of(text)
            return
        pos = end + 1


_TIME_B = re.compile(rb"\d{4}-\d{2}-\d{2}[- T]\d{2}:\d{2}:\d{2}[.,]\d{3}")


def _last_time(data: bytes) -> str | None:
    """The last timestamp in the last 64 KiB of ``data`` (a logger's line header)."""
    tail = data[-65536:]
    pos = len(tail)
    for _ in range(200):
        pos = tail.rfind(b":", 0, pos)
        if pos < 0:
            return None
        start = tail.rfind(b"\n", 0, pos) + 1
        stop = tail.find(b"\n", pos)
        line = tail[start:stop if stop >= 0 else len(tail)][:300]
        if _TIME_B.search(line):
            return _time_of(line.decode("utf-8", "replace"))
        pos = start - 1 if start > 0 else -1
        if pos < 0:
            return None
    return None


def read_oom_log(path: str | os.PathLike, *, rank: int | None = None) -> LogScan:
    """Every OOM report in the text log at ``path`` (plain or gzip), read as a stream.

    Args:
        path: the log.
        rank: the rank it belongs to (default: read from the path, :func:`rank_of_path`).

    Returns:
        a :class:`LogScan`; ``reports`` empty when the log holds no OOM message.

    Raises:
        InputError: the file cannot be read (or its gzip data is corrupt).
    """
    source = str(path)
    rank = rank_of_path(path) if rank is None else rank
    head = read_head(path, 1 << 16, expected="a text log", gunzip=True)
    text = head.decode("utf-8", errors="replace")
    if b"\x00" in head or text.count("\ufffd") > max(16, len(text) // 20):    # /dev/urandom never ends
        raise InputError("binary data; expected a text log (a job's stdout/stderr, plain or gzip)", source=source)
    with open_binary(path, expected="a text log") as stream:
        def chunks():
            while True:
                chunk = stream.read(CHUNK_BYTES)
                if not chunk:
                    return
                yield chunk
        return scan_bytes(chunks(), source=source, rank=rank)
