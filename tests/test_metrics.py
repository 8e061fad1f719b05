"""The CPU peak behind MFU is the best of several timed GEMMs (scripted clocks, no real timing)."""
import pytest
import torch

from observability import metrics

N = 32  # the matmuls run for real; only the clock is scripted
FLOPS = 2 * N ** 3


def scripted_clock(durations):
    """A clock for measured_cpu_peak_flops: its start reading, then (before, after) around each timed matmul.

    Fails the test if read once more than the durations allow (one timing too many)."""
    readings, now = [0.0], 0.0
    for d in durations:
        readings += [now, now + d]
        now += d
    readings.reverse()

    def clock():
        if not readings:
            pytest.fail("one timing more than scripted")
        return readings.pop()

    clock.unread = readings
    return clock


def busy_cpu(durations):
    """A CPU clock for durations of wall time during which every thread ran all the time."""
    return scripted_clock([d * torch.get_num_threads() for d in durations])


def test_the_peak_is_the_fastest_of_at_least_min_timings():
    wall = [0.5, 0.2, 0.4, 0.25, 0.6]  # the second timing was the quietest
    clock, cpu = scripted_clock(wall), busy_cpu(wall)
    cpu.unread.pop()  # the CPU clock has no start reading
    assert metrics.measured_cpu_peak_flops(N, seconds=0.0, min_timings=5, clock=clock, cpu_clock=cpu) == \
        pytest.approx(FLOPS / 0.2, rel=1e-12)
    assert not clock.unread and not cpu.unread  # exactly five timings


def test_time_the_threads_were_descheduled_does_not_lower_the_peak():
    wall = [0.4, 0.4, 0.4]
    clock, cpu = scripted_clock(wall), scripted_clock([0.4 * torch.get_num_threads(), 0.1 * torch.get_num_threads(),
                                                       0.2 * torch.get_num_threads()])
    cpu.unread.pop()
    # The second timing: 0.4 s of wall time, but the threads ran only 0.1 s of it (other jobs had the cores).
    assert metrics.measured_cpu_peak_flops(N, seconds=0.0, min_timings=3, clock=clock, cpu_clock=cpu) == \
        pytest.approx(FLOPS / 0.1, rel=1e-12)


def test_timing_goes_on_for_at_least_the_given_seconds():
    # 0.3 s a matmul, 1 s asked: four timings (1.2 s) although one would do; the third was fastest.
    wall = [0.3, 0.3, 0.1, 0.5]
    clock, cpu = scripted_clock(wall), busy_cpu(wall)
    cpu.unread.pop()
    assert metrics.measured_cpu_peak_flops(N, seconds=1.0, min_timings=1, clock=clock, cpu_clock=cpu) == \
        pytest.approx(FLOPS / 0.1, rel=1e-12)
    assert not clock.unread and not cpu.unread
