"""How step peaks are measured: the profiler replay of benchmarks/peak_memory.py, its limit
method, its largest-batch search, and the callback's per-step peak (StepPeakMemory)."""

import importlib
import mmap
import sys
from pathlib import Path

import pytest
import torch
from lightning_act.monitor import StepPeakMemory
from torch import nn
from torch.profiler import ProfilerActivity, profile

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MIB = 2**20


@pytest.fixture(scope="module")
def peak_memory():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("peak_memory")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_replay_finds_the_peak_of_the_live_bytes(peak_memory):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(MIB // 4)  # 1 MiB
        b = torch.ones(2 * MIB // 4)  # 2 MiB: 3 MiB live, the peak
        del a
        c = torch.ones(MIB // 8)  # 0.5 MiB: 2.5 MiB live
        del b, c
    memory = peak_memory.replay(prof.profiler.kineto_results.experimental_event_tree())
    assert memory.peak_bytes == 3 * MIB
    assert sorted(a.size for a in memory.live_at_peak) == [MIB, 2 * MIB]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.slow  # 4 s
def test_limit_keeps_nothing_and_bounds_the_compressed_peak(peak_memory):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4096, 256, generator=generator), torch.randint(0, 10, (4096,), generator=generator))
    workload = peak_memory.Workload(MLP(), batch, lambda m, x, y: nn.functional.cross_entropy(m(x), y), [], 4096)
    measured = {}
    for name in ("none", "act_2bit", "codec_floor", "limit"):
        method = peak_memory.METHODS[name]()
        method.prepare(workload)
        peak_memory.train_step(workload, method)
        measured[name] = peak_memory.measure_step(workload, method, torch.device("cpu"))
    none, act, floor, limit = measured["none"], measured["act_2bit"], measured["codec_floor"], measured["limit"]
    # Without compression the forward keeps both ReLU outputs (4096 x 512 floats each; the
    # linear outputs before them are freed) and the logits; the limit keeps none of them.
    assert none.kept_bytes >= 2 * 4096 * 512 * 4
    assert limit.kept_bytes < 0.02 * none.kept_bytes
    assert act.kept_bytes < none.kept_bytes / 8
    # No codec goes below the limit; without compression the peak is higher still. (2 bits
    # need not beat none here: in so small a model decoding a ReLU output for backward
    # costs as much as the activations it saved.)
    assert limit.peak_bytes <= act.peak_bytes
    assert limit.peak_bytes < none.peak_bytes
    # The codec floor keeps exactly the 2-bit records' bytes, so it lies between the limit and
    # the 2-bit run; here the kernels allocate nothing beyond their records and outputs. (To
    # within one small block: in the whole suite, about one run in four, one 2 KiB block more
    # or less lands in one of the two forwards; it is not the codec's, whose records are MiBs.)
    assert abs(floor.kept_bytes - act.kept_bytes) <= 4096
    assert limit.peak_bytes < floor.peak_bytes
    assert abs(floor.peak_bytes - act.peak_bytes) <= 4096


@pytest.mark.parametrize("guess", [1, 7, 37, 38, 39, 100, 1000])
def test_largest_fitting_finds_the_threshold_from_any_guess(peak_memory, guess):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= 38

    assert peak_memory.largest_fitting(fits, guess) == 38
    assert len(tried) <= 2 * (abs(guess - 38).bit_length() + 2)


def test_largest_fitting_is_zero_when_nothing_fits(peak_memory):
    assert peak_memory.largest_fitting(lambda batch: False, 16) == 0


def test_step_peak_on_the_cpu_sees_a_freed_allocation():
    peak = StepPeakMemory(torch.device("cpu"))
    if peak.resident_peak_bytes() is None:
        pytest.skip("needs Linux /proc/self/clear_refs")
    peak.start()
    before = peak.resident_peak_bytes()
    # Fresh pages from the kernel, written so they are resident: memory the C allocator
    # kept from earlier tests could be reused without raising the resident size.
    block = mmap.mmap(-1, 64 * MIB)
    block.write(b"\1" * (64 * MIB))
    block.close()
    assert peak.resident_peak_bytes() >= before + 63 * MIB
    peak.start()  # a new step forgets the old peak
    assert peak.resident_peak_bytes() < before + 32 * MIB
    if peak.exact:  # the live-tensor counter: a freed tensor is in the peak, the mapping was not
        live = peak.peak_bytes()
        freed = torch.ones(16 * MIB, dtype=torch.uint8)
        del freed
        assert live + 16 * MIB <= peak.peak_bytes() < live + 17 * MIB


@pytest.mark.slow  # 2.5 s
def test_the_step_that_surveys_group_axes_peaks_with_the_steps_after_it(peak_memory):
    """The first step surveys each slot's group axis, a piece of the tensor at a time: its
    temporaries stay a small share of the tensor it stores, so that step peaks with the
    steady ones (reordering and rounding whole tensors at once peaked it at 1.8x)."""
    from lightning_act import compress_activations

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    x = torch.randn(8, 128, 64)
    peaks = []
    for _ in range(2):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with compress_activations(layer, bits=2):
                loss = layer(x).square().mean()
            loss.backward()
        peaks.append(peak_memory.replay(prof.profiler.kineto_results.experimental_event_tree()).peak_bytes)
    assert peaks[0] <= 1.05 * peaks[1]


def test_the_peak_of_work_within_a_step_keeps_the_steps_peak():
    from lightning_act.monitor import StepPeakMemory

    meter = StepPeakMemory(torch.device("cpu"))
    if not meter.exact:
        pytest.skip("the CPU kernels are not built (LIGHTNING_ACT_KERNELS=reference)")
    meter.start()
    early = torch.ones(1 << 20)  # 4 MiB, freed before the work
    step_peak = meter.peak_bytes()
    del early
    result, held = meter.peak_of(lambda: torch.ones(1 << 18).sum())  # 1 MiB at most
    assert result == 1 << 18
    assert 1 << 20 <= held < 2 << 20
    assert meter.peak_bytes() >= step_peak  # the 4 MiB before the work stay in the step's peak
