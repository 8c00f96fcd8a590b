"""CPU thread choice (sit_vit5.utils.cpu_threads): an explicit request, then OMP_NUM_THREADS, then the model
size and the free cores."""

from __future__ import annotations

from sit_vit5.utils.cpu_threads import TINY_MODEL_PARAMS, choose_cpu_threads, free_cores


def test_cpu_thread_choice():
    requested = choose_cpu_threads(10**9, requested=3, environ={"OMP_NUM_THREADS": "2"})
    assert requested == (3, "train.cpu_threads")
    assert choose_cpu_threads(10**9, environ={"OMP_NUM_THREADS": "2"})[0] == 2
    assert choose_cpu_threads(TINY_MODEL_PARAMS - 1, load=0.0, environ={})[0] == 1
    big = choose_cpu_threads(TINY_MODEL_PARAMS, load=0.0, environ={})[0]
    assert big == free_cores(0.0) >= 1
    assert free_cores(load=1e6) == 1  # never more than the free cores, never zero
